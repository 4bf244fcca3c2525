"""Record the routing simulation's service-time table (`kvpool bench ttft --routing-table OUT`).

A real cluster on this machine (one store, one prefill node of the default model, `UCX_TLS=tcp`, the
store's segment not shared: the cross-host path) serves prefill-only requests, one at a time, and the
time to the first token is measured for every prompt length `P` of the grid:
- **cold**: `use_cache=False`, nothing reused;
- **pulled**: node-local tier off, the prompt's first `R = f·P` tokens (whole blocks) published in the
  pool beforehand, `KVPOOL_FORCE_DECISION=pull` so the node loads them whatever its cost model thinks;
- **local**: a second prefill node with its local tier on (256 MiB), the same prefix kept in that tier
  (one forced pull of the whole prefix first), the same prompts.
The rest of each prompt is fresh random tokens (never published). Repetitions are interleaved (rep 1 of
every cell, then rep 2, ...) so that the load of other jobs on the machine spreads over the cells.

The table (`kvpool.bench.routing_service.ServiceTimes` reads it) records each cell's per-repetition TTFTs,
the calibration the prefill node reported in its heartbeats (what a router scores with), the machine, the
load average before and after, the date, the git commit and the command.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvpool.bench.routing_service import FORMAT, ServiceTimes, reuse_tokens
from kvpool.errors import InvalidArgument

FULL_PROMPTS = (128, 512, 2048, 4096, 8192)
FULL_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
QUICK_PROMPTS = (128, 512)
QUICK_FRACTIONS = (0.5, 1.0)
BLOCK_TOKENS = 32
"""Tokens per KV block: the routing benchmark's tokens per trace hash id (`kvpool.bench.routing`)."""
LOCAL_TIER_BYTES = 256 * 2**20


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def record_service_times(
    out: Path,
    *,
    prompts: Sequence[int] = FULL_PROMPTS,
    fractions: Sequence[float] = FULL_FRACTIONS,
    reps: int = 3,
    block_tokens: int = BLOCK_TOKENS,
    model_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> ServiceTimes:
    """Measure the grid (see the module docstring), write the table to `out` (JSON) and return it.

    Raises `InvalidArgument` for an empty grid, a prompt shorter than two blocks, a fraction outside
    (0, 1] or `reps` < 1; `RuntimeError` when publishing the prefix fails.
    """
    from kvpool.bench.crossover_cluster import BenchCluster, PrefillCaller, wait_recompute_model
    from kvpool.bench.procs import pool_only_spec
    from kvpool.model import ModelRunner, embedded_model_dir
    from kvpool.report import env_info

    prompts, fractions = sorted(set(prompts)), sorted(set(fractions))
    if not prompts or not fractions or reps < 1:
        raise InvalidArgument("the grid needs at least one prompt length, one fraction and reps >= 1")
    if prompts[0] < 2 * block_tokens or not (fractions[0] > 0 and fractions[-1] <= 1):
        raise InvalidArgument(f"prompts must be >= {2 * block_tokens} tokens and fractions in (0, 1]")
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    model_dir = model_dir or str(embedded_model_dir())
    runner = ModelRunner.load(model_dir, device="cpu", block_size=block_tokens)
    layout, vocab = runner.layout, min(runner.vocab_size, 256)
    del runner
    rng = np.random.default_rng(2026)
    base = [int(t) for t in rng.integers(3, vocab, size=prompts[-1])]

    def prompt(p: int, r: int) -> list[int]:
        return base[:r] + [int(t) for t in rng.integers(3, vocab, size=p - r)]

    seg = max(256 * 2**20, 3 * prompts[-1] * layout.token_nbytes)
    env = {"KVPOOL_PULL_TIMEOUT_S": "600", "KVPOOL_SHARE_SEGMENT": "false", "KVPOOL_FORCE_DECISION": "pull"}
    spec = pool_only_spec(layout, block_size=block_tokens, model_dir=model_dir, segment_bytes=seg, env=env)
    ttfts: dict[tuple[str, int, int], list[float]] = {}
    decisions: dict[tuple[str, int, int], list[str]] = {}
    reported: dict[str, float] = {}
    cluster = BenchCluster(spec)
    with cluster:
        for kind, tier in (("pulled", 0), ("local", LOCAL_TIER_BYTES)):
            proc = cluster.start_prefill({"UCX_TLS": "tcp", "KVPOOL_LOCAL_TIER_BYTES": str(tier)})
            call = PrefillCaller(proc.info["grpc_address"])
            try:
                if kind == "pulled":
                    _, st = call(base + [5], use_cache=True, publish=True, rid="publish")
                    if st.get("publish_status") != "committed":
                        raise RuntimeError(f"publishing the prefix failed: {st.get('publish_status')}")
                else:  # one forced pull of the whole prefix: the node keeps it in its local tier
                    call(base + [6], use_cache=True, publish=False, rid="fill-local")
                call(prompt(prompts[0], block_tokens), use_cache=True, publish=False, rid="warm-up")
                if kind == "pulled":
                    model = wait_recompute_model(cluster, proc.name)
                    reported = {
                        "overhead_s": model.overhead_s,
                        "per_token_s": model.per_token_s,
                        "per_pair_s": model.per_pair_s,
                    }
                for rep in range(reps):
                    for p in prompts:
                        reused = sorted({reuse_tokens(p, f, block_tokens) for f in fractions})
                        cells = ([("cold", 0)] if kind == "pulled" else []) + [(kind, r) for r in reused]
                        for k, r in cells:
                            ttft, st = call(
                                prompt(p, r), use_cache=k != "cold", publish=False, rid=f"{k}-{p}-{r}-{rep}"
                            )
                            want = "num_local_tokens" if k == "local" else "num_pulled_tokens"
                            if k != "cold" and st.get(want, 0) != r:
                                raise RuntimeError(
                                    f"{k} cell P={p} R={r}: the node reused {st.get(want)} tokens "
                                    f"(decision {st.get('decision')}), not {r}"
                                )
                            ttfts.setdefault((k, p, r), []).append(ttft)
                            decisions.setdefault((k, p, r), []).append(str(st.get("decision")))
                    log(f"{kind}: rep {rep + 1}/{reps} done ({time.perf_counter() - t_start:.0f} s)")
            finally:
                call.close()
    table_cells = [
        {
            "kind": k,
            "prompt_tokens": p,
            "reused_tokens": r,
            "ttft_s": [round(t, 5) for t in ts],
            "decisions": sorted(set(decisions[(k, p, r)])),
        }
        for (k, p, r), ts in sorted(ttfts.items())
    ]
    env_now = env_info()
    table = {
        "format": FORMAT,
        "recorded_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["kvpool", *(shlex.quote(a) for a in sys.argv[1:])]),
        "git_commit": _git_commit(),
        "machine": {
            "cpu": env_now["cpu"],
            "num_cpus": env_now["num_cpus"],
            "platform": env_now["platform"],
            "torch": env_now.get("torch", "?"),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "note": (
                "a shared machine: other jobs ran beside the measurement, so the figures carry their "
                "noise (the load averages above; noise_sigma is the spread of the repetitions)"
            ),
        },
        "model": "embedded default" if model_dir == str(embedded_model_dir()) else model_dir,
        "transport": "UCX tcp, segment not shared (KVPOOL_SHARE_SEGMENT=false)",
        "block_tokens": block_tokens,
        "kv_bytes_per_token": layout.token_nbytes,
        "reps": reps,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "reported_recompute": reported,
        "cells": table_cells,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    return ServiceTimes.from_dict(table)
