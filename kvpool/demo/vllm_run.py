"""`kvpool demo --engine vllm`: the demo's RAG and chat requests through two vLLM engines on the pool.

`kvpool up` (a subprocess) starts a master, one store, a vLLM prefill and a vLLM decode api_server with
kvpool's connector, and the router in vLLM mode: per request the router sends the prompt to the prefill
engine (one token; its blocks are published), then to the decode engine, which loads the prompt from the
pool (or recomputes, per its cost model) and streams the answer. The cold reference of each request goes
straight to the decode engine with a fresh cache salt: a namespace nothing is cached in, neither in the pool
nor in vLLM's own prefix cache. Greedy tokens of both must be equal.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from kvpool.demo.run import COMMON_ROWS, EQUAL_ROW, _pct, scenario_table
from kvpool.demo.workload import DemoRequest, chat_requests, default_chat_trace, rag_requests
from kvpool.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvpool.report import write_report
from kvpool.trace import Trace

BLOCK_SIZE = 64
MAX_MODEL_LEN = 8192  # the RAG prompts are ~4,250 byte tokens with the embedded model
START_TIMEOUT_S = 900.0  # two vLLM engines start in minutes on a loaded 2-core host
REQUEST_TIMEOUT_S = 600.0

SPEC = """\
# written by `kvpool demo --engine vllm`
[cluster]
block_size = {block_size}
model = {model}

[master]
port = 0

[store]
count = 1
segment_size = "256MiB"

[prefill]
{engine}
[decode]
{engine}
[router]
port = 0
"""
ENGINE = """\
engine = "vllm"
python = {python}
kv_cache_gib = 1
engine_args = ["--max-model-len", "{max_model_len}", "--enforce-eager", "--distributed-executor-backend", "uni"]
connector = {{ match_wait_s = 10.0, pd_wait_s = 5.0 }}  # bounds on waits for the pool, on a loaded host
"""


def demo_spec(python: str, model_dir: str | None = None) -> str:
    """The cluster spec (TOML) of the demo: one store, one vLLM prefill and one vLLM decode engine, the router."""
    engine = ENGINE.format(python=json.dumps(python), max_model_len=MAX_MODEL_LEN)
    return SPEC.format(block_size=BLOCK_SIZE, model=json.dumps(model_dir or ""), engine=engine)


@dataclass(slots=True)
class UpCluster:
    """A `kvpool up` subprocess: its output lines (read on a thread), engine URLs and router URL."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)  # vllm-prefill0 -> http://host:port
    router: str = ""
    log_dir: str = ""
    engine_headers: dict[str, str] = field(default_factory=dict)  # the engines' API key (kvpool up's)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, timeout_s: float = 120.0) -> int | None:
        """SIGINT (what Ctrl-C sends: `kvpool up` stops every role), then kill after `timeout_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_up(spec_path: Path, *, timeout_s: float = START_TIMEOUT_S) -> UpCluster:
    """Run `kvpool up -c spec_path --quiet` and wait until it prints `logs in`; `Unavailable` (with its
    output) when it exits or times out first, after stopping it."""
    argv = [sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec_path), "--quiet"]
    argv += ["--timeout-s", str(int(timeout_s))]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    up = UpCluster(proc)
    out = proc.stdout
    assert out is not None
    threading.Thread(target=lambda: up.lines.extend(iter(out.readline, "")), daemon=True).start()
    deadline = time.monotonic() + timeout_s + 60
    while not any(line.startswith("logs in") for line in up.lines):
        if proc.poll() is not None or time.monotonic() > deadline:
            up.stop()
            time.sleep(0.2)  # the reader's last lines
            raise Unavailable(f"kvpool up did not start (exit {proc.returncode}):\n{up.output}")
        time.sleep(0.5)
    text = up.output
    up.engines = dict(re.findall(r"^\s*(vllm-\w+)\s+(http://\S+)/v1", text, re.M))
    router = re.search(r"^\s*router\s+(http://\S+)/v1", text, re.M)
    log_dir = re.search(r"^logs in (\S+);", text, re.M)
    up.router = router.group(1) if router else ""
    up.log_dir = log_dir.group(1) if log_dir else ""
    key_file = re.search(r"KVPOOL_SERVING_KEY_FILE=(\S+)", text)  # engines take it as their API key
    if key_file:
        up.engine_headers = {"Authorization": f"Bearer {Path(key_file.group(1)).read_text().strip()}"}
    if not up.router or not any(n.startswith("vllm-decode") for n in up.engines):
        up.stop()
        raise Unavailable(f"kvpool up printed no router or vLLM decode URL:\n{text}")
    return up


def _stream_completion(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """One streamed `POST {url}/v1/completions` (with `headers`, e.g. an engine's API key): TTFT (first
    chunk with tokens), token ids, usage."""
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise FailedPrecondition(
                f"{url}: HTTP {resp.status_code}: {resp.read().decode(errors='replace')}"
            )
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise FailedPrecondition(f"{url}: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(int(t) for t in ids)
            usage = chunk.get("usage") or usage
    if ttft is None:
        raise FailedPrecondition(f"{url}: the stream carried no token ids (is return_token_ids supported?)")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "tokens": tokens,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


def serve_vllm_workload(
    router_url: str,
    cold_url: str,
    requests: Sequence[DemoRequest],
    max_tokens: int,
    *,
    progress: Any = None,
    cold_headers: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Serve each request warm through the router and cold on one engine; one record per request, in order.

    `router_url` is kvpool's router in vLLM mode and `cold_url` a vLLM engine's base URL (a decode engine's:
    it is the one that answers through the router; `cold_headers` its API key), both without `/v1`. Each request is a streamed
    `POST /v1/completions` of its token ids with temperature 0, `max_tokens`, `return_token_ids` and usage
    in the last chunk (the engines need `--enable-prompt-tokens-details`, which `kvpool up` adds). The
    cold one carries a fresh `cache_salt` (`cold-<uuid>`): nothing of its namespace is in the pool or in the
    engine's prefix cache. Requests run one at a time, warm before cold, so the figures measure reuse, not
    contention between them.

    Record keys: `scenario`, `request_id`, `label`, `prompt_tokens`, `cached_tokens` (the warm answer's
    `usage.prompt_tokens_details.cached_tokens`: loaded from the pool or held by vLLM's prefix cache),
    `ttft_warm_s`, `ttft_cold_s` (time to the first streamed token), `output_tokens`, `greedy_equal` (the
    warm token ids equal the cold ones). An engine's or the router's error raises `FailedPrecondition`
    naming the URL and its answer; a connection failure raises httpx's error. `progress` (optional) is
    called with each record.
    """
    import httpx

    usage = {"include_usage": True}
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": max_tokens, "stream": True}
    base |= {"return_token_ids": True, "stream_options": usage}
    out = []
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client:
        for req in requests:
            body = base | {"prompt": list(req.token_ids)}
            warm = _stream_completion(client, router_url, body)
            cold_body = body | {"cache_salt": f"cold-{uuid.uuid4().hex}"}
            cold = _stream_completion(client, cold_url, cold_body, cold_headers)
            record = {
                "scenario": req.scenario,
                "request_id": req.request_id,
                "label": req.label,
                "prompt_tokens": warm["prompt_tokens"] or len(req.token_ids),
                "cached_tokens": warm["cached_tokens"],
                "ttft_warm_s": warm["ttft_s"],
                "ttft_cold_s": cold["ttft_s"],
                "output_tokens": len(warm["tokens"]),
                "greedy_equal": warm["tokens"] == cold["tokens"],
            }
            out.append(record)
            if progress is not None:
                progress(record)
    return out


def summarize_records(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The report figures of `serve_vllm_workload` records (as `kvpool.demo.run.summarize` for kvpool's
    nodes): warm TTFT over the requests with cached tokens, hit rate = cached / prompt tokens."""
    cold = [r["ttft_cold_s"] for r in records]
    hit = [r["ttft_warm_s"] for r in records if r["cached_tokens"] > 0]
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    cold_p50 = statistics.median(cold) if cold else 0.0
    warm_p50 = statistics.median(hit) if hit else 0.0
    unequal = sum(not r["greedy_equal"] for r in records)
    return {
        "requests": len(records),
        "requests_with_hits": len(hit),
        "ttft_cold_p50_s": cold_p50,
        "ttft_cold_p90_s": _pct(cold, 0.9),
        "ttft_warm_p50_s": warm_p50,
        "ttft_warm_p90_s": _pct(hit, 0.9),
        "speedup": cold_p50 / warm_p50 if warm_p50 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "greedy_equal": unequal == 0,
        "num_unequal": unequal,
    }


def summarize_by_scenario(
    records: Sequence[dict[str, Any]],
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(figures per scenario in first-seen order, figures over all records)."""
    names = list(dict.fromkeys(r["scenario"] for r in records))
    per = {n: summarize_records([r for r in records if r["scenario"] == n]) for n in names}
    return per, summarize_records(records)


def print_report(console: Console, summaries: dict[str, dict[str, Any]], overall: dict[str, Any]) -> None:
    """One column per scenario, one row per figure (the layout of `kvpool demo`'s table)."""
    rows: list[tuple[str, Any]] = [
        *COMMON_ROWS,
        ("cached / prompt tokens", lambda s: f"{s['cached_tokens']} / {s['prompt_tokens']}"),
        ("token hit rate", lambda s: f"{s['token_hit_rate']:.1%}"),
        EQUAL_ROW,
    ]
    title = "kvpool demo (vLLM P/D): through the pool (warm) vs a cold engine"
    console.print(scenario_table(title, summaries, overall, rows))
    if "wall_s" in overall:
        console.print(f"wall time {overall['wall_s']:.1f} s")


def run_vllm_demo(
    *,
    json_out: Path | None = None,
    trace: Path | Trace | None = None,
    trace_block_tokens: int = 64,
    num_conversations: int = 4,
    questions_per_doc: int = 3,
    max_tokens: int = 8,
    python: str | None = None,
    model_dir: str | None = None,
) -> dict[str, Any]:
    """Start the cluster of `demo_spec`, serve the RAG and chat requests, stop it, print and return the
    summary (`greedy_equal` False when any warm answer differs from its cold one). `python`: the
    interpreter that has vllm (default: what `kvpool up` finds, `.venv-vllm/bin/python`)."""
    from kvpool.cluster.vllm_roles import vllm_python
    from kvpool.router.model_info import ModelInfo

    python = python or vllm_python()
    if shutil.which(python) is None:
        raise InvalidArgument(
            f"no Python with vLLM at {python!r} (make test-vllm builds .venv-vllm; or --python)"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    console = Console()
    t_start = time.perf_counter()
    info = ModelInfo.load(model_dir, block_size=BLOCK_SIZE)  # the engines' tokenizer, without torch
    if info.synthetic:
        console.print(
            f"[yellow]model {info.model_id}: SYNTHETIC weights (random, fixed seed) - its text is gibberish; "
            "the KV, the reuse and the equality checks are real.[/yellow]"
        )
    rag = rag_requests(info.encode, questions_per_doc=questions_per_doc)
    chat = chat_requests(
        trace or default_chat_trace(),
        vocab_size=min(info.vocab_size, 256),
        num_conversations=num_conversations,
        trace_block_tokens=trace_block_tokens,
    )
    requests = rag + chat
    limit = MAX_MODEL_LEN - max_tokens
    too_long = [r.request_id for r in requests if len(r.token_ids) > limit]
    if too_long:
        raise InvalidArgument(
            f"prompts longer than {limit} tokens (--max-model-len {MAX_MODEL_LEN}): {too_long}"
        )
    work = Path(tempfile.mkdtemp(prefix="kvpool-demo-vllm-"))
    spec_path = work / "cluster.toml"
    spec_path.write_text(demo_spec(python, model_dir))
    console.print(
        "starting kvpool up: master, 1 store, a vLLM prefill and a vLLM decode engine, the router "
        f"(spec {spec_path}; minutes on a small host) ..."
    )
    up = start_up(spec_path)
    try:
        console.print(f"cluster up in {time.perf_counter() - t_start:.1f} s (logs in {up.log_dir})")
        decode = next(url for name, url in sorted(up.engines.items()) if name.startswith("vllm-decode"))
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("serving requests", total=len(requests))
            records = serve_vllm_workload(
                up.router,
                decode,
                requests,
                max_tokens,
                progress=lambda _: progress.advance(task),
                cold_headers=up.engine_headers,
            )
    finally:
        code = up.stop()
        if code:
            console.print(f"[red]kvpool up exited {code}; its output:[/red]\n{up.output[-4000:]}")
    summaries, overall = summarize_by_scenario(records)
    overall["wall_s"] = time.perf_counter() - t_start
    print_report(console, summaries, overall)
    keys = (
        "ttft_cold_p50_s",
        "ttft_warm_p50_s",
        "speedup",
        "token_hit_rate",
        "greedy_equal",
        "requests",
        "wall_s",
    )
    summary = {**{k: overall[k] for k in keys}, "scenarios": summaries, "log_dir": up.log_dir}
    write_report(json_out, "demo-vllm", records, summary)
    return summary
