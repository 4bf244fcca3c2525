"""`kvpool bench crossover`: where pulling a cached prefix beats recomputing it, and does the cost model know?

Grid: models (one cluster each: a pool holds one KV layout) × links × shared-prefix lengths. Links:
  - `shm`: store on the same host (`UCX_TLS=sm,self`): block bytes copied from the store's mapped segment,
    control messages over UCX shared memory (`transfer/shared_segment.py`; the other links turn it off);
  - `tcp`: UCX over loopback tcp (`UCX_TLS=tcp`);
  - `tbf-<rate>`: UCX tcp across a veth pair between two network namespaces the benchmark creates, the
    pair throttled with `tc tbf` (root only, `kvpool.bench.netns`); the store node runs in the "remote"
    namespace, master and prefill in the other. Rates default to multiples of the model's break-even
    bandwidth (KV bytes per token ÷ calibrated recompute seconds per token), so cells fall on both sides.

Every cell measures, interleaved, `reps` times each: the real TTFT with the prefix pulled from the pool
(the prefill node runs with `KVPOOL_FORCE_DECISION=pull`) and with it recomputed (`use_cache=False`), and
records the cost model's predictions. The prefill node is restarted per link, so its link estimate comes
from its own connect-time probe and real transfers, never from the throttle setting.

The cost model's choice under `auto` is reconstructed exactly from the node's own figures: `decide_reuse`
minimises `(1+m)·load(k) + compute(k)` over k; load is affine in k and compute concave in k (the attention
pairs of `n_new = P − k·b` tokens on `k·b` cached ones fall as `−(k·b)²/2`), so the minimum is at k = 0 or
k = h, and auto pulls iff `(1+m)·load(h) + t_rec(P − h·b | h·b) < t_rec(P | 0)`; `load(h)` is the forced
node's `predicted_pull_s`, `t_rec` its calibrated `RecomputeModel` (heartbeat figures), m its margin.

Scores: a cell is right when the choice was the faster option, or the two medians are within 10 %;
`decision_accuracy` = right cells / cells; `mean_regret` = mean(chosen / best − 1).

This module holds the grid (models, throttle rates) and `run_crossover`; the measuring (cluster, prefill
caller, namespace worker) lives in `kvpool.bench.crossover_measure`, the cost model's view, the scoring and
the crossovers in `kvpool.bench.crossover_analysis`, the tables and the plot in
`kvpool.bench.crossover_report`; their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpool.bench.crossover_analysis import (
    TOLERANCE,
    breakeven_bits_per_s,
    crossover_prefix,
    crossovers,
    measured_breakeven_bits_per_s,
    predict_cell,
    score_cell,
    summarize,
)
from kvpool.bench.crossover_cluster import BenchCluster, PrefillCaller
from kvpool.bench.crossover_measure import (
    BASE_SEED,
    Job,
    LinkCase,
    ModelCase,
    run_job,
    run_job_in_netns,
    tbf_link,
    worker_main,
)
from kvpool.bench.crossover_report import plot_crossover, print_tables
from kvpool.cost import RecomputeModel
from kvpool.model.embedded import DEFAULT_SPEC, EmbeddedSpec

__all__ = [
    "BASE_SEED",
    "DEFAULT_MARGIN",
    "FAST_RATE_BITS",
    "FULL_MODELS",
    "LARGER_SPEC",
    "MIN_RATE_BITS",
    "QUICK_MODELS",
    "RATE_MULTIPLIERS",
    "TOLERANCE",
    "BenchCluster",
    "Job",
    "LinkCase",
    "ModelCase",
    "PrefillCaller",
    "breakeven_bits_per_s",
    "crossover_prefix",
    "measured_breakeven_bits_per_s",
    "plot_crossover",
    "predict_cell",
    "run_crossover",
    "run_job",
    "run_job_in_netns",
    "score_cell",
    "summarize",
    "tbf_link",
]

DEFAULT_MARGIN = 0.1
RATE_MULTIPLIERS = (0.5, 0.75, 1.33, 2.0)
MIN_RATE_BITS = 10e6
"""The transport probes a new peer with 2 x 4 MiB inside its 15 s connect deadline: below ~5 Mb/s the connect
fails and the replica is reported bad (the master then drops it), so auto rates stay above 10 Mb/s."""
"""Throttle rates as multiples of the model's break-even bandwidth; plus `FAST_RATE`."""
FAST_RATE_BITS = 1e9


LARGER_SPEC = EmbeddedSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1376)
"""8 layers, hidden 512, GQA 8/4 (head_dim 64): 16 KiB of KV per token, ~4x the default's FLOP per token.
(12 layers / hidden 768 costs ~14 ms per token on a shared 2-core CPU: 8K tokens would not fit the budget.)"""

FULL_MODELS = (
    ModelCase(
        name="default-l4-h256",
        spec=DEFAULT_SPEC,
        prefixes=(64, 512, 2048, 8192),
        throttled_prefixes=(64, 512, 2048),
    ),
    ModelCase(
        name="larger-l8-h512", spec=LARGER_SPEC, prefixes=(64, 256, 1024), throttled_prefixes=(64, 256, 1024)
    ),
)
QUICK_MODELS = (
    ModelCase(name="default-l4-h256", spec=DEFAULT_SPEC, prefixes=(64, 256), throttled_prefixes=(64,)),
)


# ---------------------------------------------------------------- the benchmark


@contextlib.contextmanager
def _maybe_pair(use: bool) -> Iterator[Any]:
    if not use:
        yield None
        return
    from kvpool.bench.netns import ThrottledPair

    with ThrottledPair() as pair:
        yield pair


def run_crossover(
    *,
    quick: bool = False,
    reps: int | None = None,
    rates_mbit: Sequence[float] | None = None,
    question_tokens: int = 32,
    margin: float = DEFAULT_MARGIN,
    netns: bool = True,
    fresh_calibration: bool | None = None,
    models: Sequence[ModelCase] | None = None,
    json_out: Path | None = None,
    plot_out: Path | None = None,
) -> dict[str, Any]:
    """Run the grid (see the module docstring); print tables; write the report and plot. Returns the report."""
    from rich.console import Console

    from kvpool.bench.netns import netns_unavailable_reason
    from kvpool.report import write_report

    console = Console(stderr=True)
    if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds: namespaces are deleted
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    models = tuple(models or (QUICK_MODELS if quick else FULL_MODELS))
    reps = reps or 3
    fresh = (not quick) if fresh_calibration is None else fresh_calibration
    why_not = netns_unavailable_reason() if netns else "disabled (--no-netns)"
    if why_not:
        console.print(f"[yellow]throttled links: {why_not}[/yellow]")
    t_start = time.perf_counter()
    records: list[dict[str, Any]] = []
    notes: dict[str, Any] = {"throttled_links": why_not or "measured", "rates_mbit": {}}
    with contextlib.ExitStack() as stack:
        cache_dir = (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-calib-")) if fresh else None
        )
        for case in models:
            m = {
                "name": case.name,
                "spec": asdict(case.spec),
                "prefixes": list(case.prefixes),
                "throttled_prefixes": list(case.throttled_prefixes),
            }
            recs = []
            for kind in ("shm", "tcp"):  # one cluster each: the store's transports differ
                job = Job(
                    model=m,
                    links=[asdict(LinkCase(name=kind, kind=kind))],
                    reps=reps,
                    question_tokens=question_tokens,
                    margin=margin,
                    cache_dir=cache_dir,
                )
                recs += run_job(job, log=console.log)
            records += recs
            if why_not:
                continue
            rates = [r * 1e6 for r in rates_mbit] if rates_mbit else auto_rates(recs, question_tokens, quick)
            notes["rates_mbit"][case.name] = [round(r / 1e6, 2) for r in rates]
            console.log(f"[{case.name}] throttled rates (Mb/s): {notes['rates_mbit'][case.name]}")
            tjob = Job(
                model=m,
                links=[asdict(tbf_link(r)) for r in rates],
                reps=reps,
                question_tokens=question_tokens,
                margin=margin,
                cache_dir=cache_dir,
            )
            with _maybe_pair(True) as pair:
                records += run_job_in_netns(tjob, pair, console.log)
    summary = (
        summarize(records)
        | crossovers(records, question_tokens)
        | {
            "wall_s": round(time.perf_counter() - t_start, 1),
            "reps": reps,
            "tolerance": TOLERANCE,
            "margin": margin,
            "fresh_calibration": fresh,
            **notes,
        }
    )
    print_tables(console, records, summary)
    report = write_report(json_out, "crossover", records, summary)
    if plot_out is not None:
        plot_crossover(records, summary, plot_out)
    return report


def auto_rates(records: Sequence[dict[str, Any]], question_tokens: int, quick: bool) -> list[float]:
    """Multiples of the break-even bandwidth at the grid's middle prefix (from the calibrated model)."""
    rec = sorted(records, key=lambda r: r["prefix_tokens"])[len(records) // 2]
    model = RecomputeModel(**rec["recompute_model"])
    ref = breakeven_bits_per_s(model, rec["prefix_tokens"], question_tokens, rec["token_nbytes"])
    mults = (0.5, 2.0) if quick else RATE_MULTIPLIERS
    rates = sorted({max(MIN_RATE_BITS, ref * m) for m in mults})
    return rates if quick else rates + [FAST_RATE_BITS]


if __name__ == "__main__":  # the namespace worker, still runnable as python -m kvpool.bench.crossover
    worker_main(sys.argv[1], sys.argv[2])
