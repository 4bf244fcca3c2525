"""`kvpool bench vllm-replay`: the Mooncake conversation trace replayed on vLLM engines, with and
without kvpool, in one run.

A seeded subset of whole sessions (`vllm_replay_trace`) is replayed, arrivals divided by `speedup`, a
session's next turn never sent before its previous one answered, `max_tokens` greedy tokens each, on
three setups one after the other:
  - two engines without kvpool (vLLM's own prefix cache only), round robin;
  - two engines with kvpool's connector and a pool (master + one store, a segment of one engine's KV
    cache), round robin;
  - one engine alone (prefix cache only).
Each engine is vLLM's OpenAI server (`--python`, a venv with vllm) pinned to one core with `taskset`,
`VLLM_CPU_KVCACHE_SPACE=kv_cache_gib`, warmed with one unrelated request. Requests stream: TTFT is the
time from sending to the first streamed token; `usage.prompt_tokens_details.cached_tokens` (the last
chunk) gives the reused tokens (vLLM's cache and the pool's). vLLM returns `kv_transfer_params` only in
non-streaming responses, so each request's pool decision comes from the connector's `pool:` log line
(request ids are set with `X-Request-Id`; the requests: `kvpool.bench.vllm_replay_client`). This module
imports no vllm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from kvpool.bench.vllm_replay_client import probe, replay, warm
from kvpool.bench.vllm_replay_report import SETUPS, plot_report, print_report, summarize
from kvpool.bench.vllm_replay_trace import (
    BlockTokens,
    ReplayRequest,
    default_trace,
    load_trace,
    select_subset,
)
from kvpool.errors import InvalidArgument
from kvpool.report import write_report

LAYOUT = "kv1:float32:b64:l4:h4:d32"  # the embedded model's KV in fp32, block 64
BLOCK_SIZE = 64
START_TIMEOUT_S = 600.0
SETTLE_S = 2.0  # after the warm-up of a connector engine: its publishes land
_POOL_LINE = re.compile(
    r"\[cmpl-r(\d+)-[^\]]*\] pool: (\d+) of (\d+) blocks matched, local (\d+), decision (\w+) \((.*?)\): "
    r"load (\d+)"
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def engine_command(
    *, python: str, model_dir: str, port: int, core: int, master: str, max_model_len: int, kv_cache_gib: float
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of one OpenAI server pinned to `core`; with `master`, kvpool's connector."""
    argv = [
        "taskset",
        "-c",
        str(core),
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--distributed-executor-backend",
        "uni",
        "--disable-uvicorn-access-log",
    ]
    if master:
        kv = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"master": master, "url": f"http://127.0.0.1:{port}"},
        }
        argv += ["--kv-transfer-config", json.dumps(kv)]
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "OMP_NUM_THREADS": "1",
    }
    return argv, env


def parse_decisions(log: str) -> dict[int, dict[str, Any]]:
    """The connector's logged decisions by replay index (request id `cmpl-r<index>-…`)."""
    out: dict[int, dict[str, Any]] = {}
    for m in _POOL_LINE.finditer(log):
        out[int(m[1])] = {
            "decision": m[5],
            "reason": m[6],
            "num_pool_blocks": int(m[2]),
            "num_local_blocks": int(m[4]),
            "num_load_blocks": int(m[7]),
        }
    return out


def run_setup(
    setup: str,
    *,
    num_engines: int,
    master: str,
    requests: list[ReplayRequest],
    tokens: BlockTokens,
    python: str,
    model_dir: str,
    max_model_len: int,
    max_tokens: int,
    kv_cache_gib: float,
    workdir: Path,
    console: Console,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start the engines (in parallel), warm them, replay, stop them; (records, setup info)."""
    from rich.progress import Progress

    from kvpool.cluster.process import RoleProcess

    procs: list[RoleProcess] = []
    urls: list[str] = []
    info: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        for core in range(num_engines):
            port = free_port()
            argv, env = engine_command(
                python=python,
                model_dir=model_dir,
                port=port,
                core=core,
                master=master,
                max_model_len=max_model_len,
                kv_cache_gib=kv_cache_gib,
            )
            url = f"http://127.0.0.1:{port}"
            procs.append(
                RoleProcess(
                    f"{setup}-e{core}",
                    [],
                    log_path=workdir / f"{setup}-e{core}.log",
                    env=dict(os.environ) | env,
                    argv=argv,
                    ready_url=f"{url}/health",
                )
            )
            urls.append(url)
        with console.status(f"{setup}: starting {num_engines} engine(s)"):
            for p in procs:
                p.wait_ready(START_TIMEOUT_S)
            info["startup_s"] = time.perf_counter() - t0
            for url in urls:
                asyncio.run(warm(url, model_dir, tokens.warmup()))
            if master:
                time.sleep(SETTLE_S)
        console.print(f"  {setup}: {num_engines} engine(s) up in {info['startup_s']:.1f} s")
        t1 = time.perf_counter()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"{setup}: replay", total=len(requests))
            records = asyncio.run(
                replay(
                    requests,
                    tokens,
                    urls,
                    model=model_dir,
                    max_tokens=max_tokens,
                    on_done=lambda: progress.advance(task),
                )
            )
        info["replay_wall_s"] = time.perf_counter() - t1
        if master and requests:
            time.sleep(SETTLE_S)
            info["kv_transfer_params_probe"] = probe(urls[-1], model_dir, tokens.prompt(requests[0]))
    finally:
        for p in procs:
            p.stop(timeout_s=20.0)
    decisions: dict[int, dict[str, Any]] = {}
    for p in procs:
        decisions |= parse_decisions(p.log_path.read_text(errors="replace"))
    for rec in records:
        rec["setup"] = setup
        rec |= decisions.get(rec["index"], {"decision": None})
    return records, info


def run_vllm_replay(
    *,
    trace: Path | None = None,
    max_requests: int = 300,
    max_prompt_tokens: int = 8192,
    max_tokens: int = 16,
    speedup: float = 20.0,
    seed: int = 2026,
    kv_cache_gib: float = 1.0,
    setups: tuple[str, ...] = SETUPS,
    python: str = "",
    json_out: Path | None = None,
    plot_out: Path | None = None,
    log_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the setups on one subset, print the table, write the report (and plot). Returns it.
    `kv_cache_gib`: each engine's KV cache and the pool's segment (GiB)."""
    from kvpool.bench.vllm_bench import vllm_version
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.cluster.vllm_roles import vllm_python
    from kvpool.model.export import export_model_dir

    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise InvalidArgument(f"--setups: pick from {', '.join(SETUPS)} (got {', '.join(unknown) or 'none'})")
    if max_tokens < 1 or kv_cache_gib <= 0:
        raise InvalidArgument("--max-tokens must be >= 1 and --kv-cache-gib > 0")
    if (os.cpu_count() or 1) < 2 and any(s != "one_engine" for s in setups):
        raise InvalidArgument("two engines need two cores (one each)")
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    python = python or vllm_python()
    trace = trace or default_trace()
    version = vllm_version(python)
    requests = select_subset(
        load_trace(trace),
        max_requests=max_requests,
        max_prompt_tokens=max_prompt_tokens,
        speedup=speedup,
        seed=seed,
    )
    tokens = BlockTokens(seed)
    longest = max([r.num_prompt_tokens for r in requests] + [len(tokens.warmup())]) + max_tokens
    max_model_len = -(-(longest + 1) // BLOCK_SIZE) * BLOCK_SIZE
    num_sessions = len({r.session for r in requests})
    console.print(
        f"vLLM {version}: {len(requests)} requests in {num_sessions} sessions of {trace.name} (seed {seed}), "
        f"prompts <= {max_prompt_tokens} tokens, {max_tokens} tokens each, arrivals / {speedup:g} "
        f"({requests[-1].arrival_s:.0f} s)"
    )
    records: list[dict[str, Any]] = []
    setup_info: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-replay-") as tmp:
        workdir = log_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model_dir = str(export_model_dir(workdir / "model", force=True))
        common: dict[str, Any] = dict(
            requests=requests,
            tokens=tokens,
            python=python,
            model_dir=model_dir,
            max_model_len=max_model_len,
            max_tokens=max_tokens,
            kv_cache_gib=kv_cache_gib,
            workdir=workdir,
            console=console,
        )
        for setup in setups:
            num_engines = 1 if setup == "one_engine" else 2
            if setup != "two_engines_pool":
                recs, setup_info[setup] = run_setup(setup, num_engines=num_engines, master="", **common)
            else:
                spec = LocalClusterSpec(
                    layout=LAYOUT,
                    block_size=BLOCK_SIZE,
                    num_stores=1,
                    num_prefill=0,
                    num_decode=0,
                    segment_size=f"{kv_cache_gib:g}GiB",
                )
                pool_logs = workdir / "pool" if log_dir else None
                if pool_logs is not None:
                    pool_logs.mkdir(exist_ok=True)
                with LocalCluster(spec, log_dir=pool_logs) as cluster:
                    recs, setup_info[setup] = run_setup(
                        setup, num_engines=num_engines, master=cluster.master_address, **common
                    )
            records += recs
    summary = summarize(
        records,
        num_requests=len(requests),
        num_sessions=num_sessions,
        trace=str(trace),
        seed=seed,
        speedup=speedup,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens=max_tokens,
        kv_cache_gib=kv_cache_gib,
        pool_segment_gib=kv_cache_gib,
        block_size=BLOCK_SIZE,
        layout=LAYOUT,
        replay_span_s=requests[-1].arrival_s,
        setup_info=setup_info,
        wall_s=time.perf_counter() - t_start,
    )
    report = write_report(None, "vllm-replay", records, summary)
    report["env"] |= {"vllm": version, "engine_python": python}
    summary["date"] = report["env"]["date"]
    summary["machine"] = f"{report['env']['cpu']}, {report['env']['num_cpus']} CPUs"
    print_report(console, summary)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {json_out}")
    if plot_out is not None:
        plot_report(summary, plot_out)
        console.print(f"plot: {plot_out}")
    return report
