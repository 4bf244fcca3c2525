"""`kvpool bench master --blocks N`: the master holding N resident blocks, measured through its public
gRPC service only.

A master and `stores` store processes (a tiny layout: the master is measured, not the data) on
127.0.0.1. The fill (`master_scale`) publishes the conversation trace's prefix tree under salted
namespaces (`master_scale_work`) with Reserve → UCX write → Commit until N blocks are resident; the
master's VmRSS before and after gives `bytes_per_block` (VmHWM: `peak_bytes_per_block`). Then `clients`
client processes (real clients are separate nodes: one interpreter each), each with its own channel,
match `prompt_blocks`-block prompts drawn uniformly from every resident chain (a trace request's path in
one namespace, padded with blocks no one published; the hits each must find are known), one prompt per
stream message (or per unary call with `--unary`; `--depth D`: D messages in flight per stream), counting
the hit and taking no lease, for `duration_s`; the rate counts from the common start until the last client
reports. Clients are the lean load generator (`master_load`, pre-serialized requests, default) or the
library's `MasterClient` (`client="api"`). Baseline measured in the same run: one client alone. The
publish, rebuild and lock-held phases: `master_scale_phases`.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvpool.bench import master_scale_phases as phases
from kvpool.bench import master_scale_work as work
from kvpool.bench.master_load import LeanJob, lean_client
from kvpool.bench.master_scale import TINY_LAYOUT, ScaleCluster, fill_without_bytes, memory_estimate_bytes
from kvpool.client import MasterClient
from kvpool.client import convert as cv
from kvpool.errors import InvalidArgument
from kvpool.report import write_report


def _client(
    address: str,
    prompts: Sequence[tuple[bytes, Sequence[bytes]]],
    want: Sequence[int],
    k: int,
    clients: int,
    unary: bool,
    depth: int,
    ready: Any,
    go: Any,
    duration_s: float,
    out: Any,
) -> None:
    """One client (its own process: real clients are separate nodes, each with its own interpreter)."""
    lat: list[float] = []
    errors = matched = 0
    n = len(prompts)
    with MasterClient(address, timeout_s=5) as c:
        stream = None if unary else c.match_stream()
        call = c.match if stream is None else stream.match
        call(*prompts[0])  # warm the channel
        ready.release()
        go.wait()
        stop_at = time.perf_counter() + duration_s
        i = k
        if stream is not None and depth > 1:  # pipelined: `depth` prompts in flight, one per message
            sent: deque[tuple[float, int]] = deque()
            while True:
                more = time.perf_counter() < stop_at
                if not more and not sent:
                    break
                while more and len(sent) < depth:
                    sent.append((time.perf_counter(), i % n))
                    stream.send(*prompts[i % n], count_hit=True)
                    i += clients
                m = stream.receive()
                t_sent, j = sent.popleft()
                lat.append(time.perf_counter() - t_sent)
                matched += m.num_matched
                errors += m.num_matched != want[j]
        while stream is None or depth <= 1:
            if time.perf_counter() >= stop_at:
                break
            t0 = time.perf_counter()
            m = call(*prompts[i % n], count_hit=True, num_prompt_tokens=0)
            lat.append(time.perf_counter() - t0)
            matched += m.num_matched
            errors += m.num_matched != want[i % n]
            i += clients
        if stream is not None:
            stream.close()
    out.put((k, lat, errors, matched))


def _phase(
    address: str,
    prompts: Sequence[tuple[bytes, Sequence[bytes]]],
    want: Sequence[int],
    clients: int,
    duration_s: float,
    unary: bool,
    depth: int,
    client: str = "lean",
) -> dict[str, Any]:
    """`clients` processes match `prompts` (namespace, hashes) round-robin for `duration_s`; prompt i must
    match `want[i]` blocks (an answer with fewer or more is a short match: a wrong answer)."""
    ctx = mp.get_context("spawn")  # no fork: the parent holds gRPC channels
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    if client == "lean":
        reqs = [cv.match_pb(ns, chain, True, 0, 0, "").SerializeToString() for ns, chain in prompts]
        args: list[tuple[Any, ...]] = [
            (LeanJob(address, reqs, list(want), k, clients, unary, depth, duration_s), ready, go, out)
            for k in range(clients)
        ]
        target: Any = lean_client
    else:
        args = [
            (address, prompts, want, k, clients, unary, depth, ready, go, duration_s, out)
            for k in range(clients)
        ]
        target = _client
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a bench client did not start")
    go.set()
    t0 = time.perf_counter()
    results = [out.get(timeout=duration_s + 120) for _ in procs]
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    all_ms = np.array([x for r in results for x in r[1]]) * 1000
    return {
        "clients": clients,
        "mode": ("unary" if unary else "stream" if depth <= 1 else f"stream x{depth}") + f", {client}",
        "matches": int(all_ms.size),
        "match_per_s": round(all_ms.size / elapsed, 1),
        "match_p50_ms": round(float(np.percentile(all_ms, 50)), 3),
        "match_p99_ms": round(float(np.percentile(all_ms, 99)), 3),
        "short_matches": sum(r[2] for r in results),
        "hit_blocks_per_match": round(sum(r[3] for r in results) / max(1, all_ms.size), 2),
    }


TARGETS: dict[str, tuple[str, float]] = {
    "bytes_per_block": ("<=", 160),
    "peak_bytes_per_block": ("<=", 240),
    "match_p99_ms": ("<=", 10),
    "match_per_s": (">=", 2000),
    "publish_blocks_per_s": (">=", 100_000),
    "rebuild_blocks_per_s": (">=", 1_000_000),
    "node_death_lock_ms": ("<=", 100),
    "watermark_tick_ms": ("<=", 100),
}
"""The targets of the master at scale (set for N = 20 M; graded at any N)."""


def grade(summary: dict[str, Any]) -> dict[str, Any]:
    """The verdict of a summary's own figures: `<figure>_met` per `TARGETS` entry the summary measured
    (None: not measured, no verdict), `no_short_matches_met` (an answer other than the blocks resident is
    a wrong answer, never a fast one), and `target_met` (bool) = all of them."""
    checks: dict[str, bool] = {}
    for name, (op, bound) in TARGETS.items():
        value = summary.get(name)
        if value is not None:
            checks[f"{name}_met"] = value <= bound if op == "<=" else value >= bound
    checks["no_short_matches_met"] = summary["short_matches"] == 0
    return checks | {"target_met": all(checks.values())}


def check_memory(blocks: int, extra_blocks: int) -> tuple[int, int]:
    """(bytes the run needs, bytes available) (`master_scale.memory_estimate_bytes`); raises
    `InvalidArgument` when it would not fit this host's available memory."""
    need, have = memory_estimate_bytes(blocks, extra_blocks), psutil.virtual_memory().available
    if need > have:
        raise InvalidArgument(
            f"{blocks:,} blocks need about {need / 2**30:.1f} GiB of RAM (master, stores, clients); "
            f"{have / 2**30:.1f} GiB are available"
        )
    return need, have


def run_master_bench(
    *,
    blocks: int,
    prompt_blocks: int = 64,
    clients: int = 8,
    prompts: int = 4096,
    duration_s: float = 5.0,
    unary: bool = False,
    depth: int = 1,
    client: str = "lean",
    stores: int = 4,
    writers: int = 8,
    publish_chains: int = 100,
    rebuild_timeout_s: float = 900.0,
    trace: Path | None = None,
    json_out: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Fill a real master with `blocks` resident blocks (the conversation trace's tree under salted
    namespaces, through Reserve + Commit from `writers` client processes on `stores` tiny-layout
    `--metadata-only` stores), then measure memory per block, matches of `prompt_blocks`-block prompts from
    `clients` clients (1 client first: the baseline), publish rates (`publish_chains` chains per client, one
    and two replicas), the rebuild of a restarted master, and the stalls of an eviction and a node death."""
    from kvpool.bench.routing import default_trace

    trace = trace or default_trace(quick=False)
    say = _say if progress else (lambda _msg: None)
    extra = 5 * clients * publish_chains * prompt_blocks  # two passes at 1 replica, one at 2
    need, have = check_memory(blocks, extra)
    say(f"memory estimate {need / 2**30:.1f} GiB of {have / 2**30:.1f} GiB available")
    with ScaleCluster(blocks, num_stores=stores, extra_blocks=extra, store_args=("--metadata-only",)) as cl:
        time.sleep(1.0)
        rss0 = cl.master_rss_bytes()
        say(
            f"filling {blocks:,} blocks ({stores} metadata-only stores, {writers} clients, trace {trace.name})"
        )
        f = fill_without_bytes(cl, trace, blocks, clients=writers, progress=progress)
        time.sleep(2.0)
        rss1, peak = cl.master_rss_bytes(), cl.master_peak_bytes()
        say(f"filled in {f.seconds:.0f} s; master RSS {rss0 >> 20} -> {rss1 >> 20} MiB (peak {peak >> 20})")
        picks, want = work.prompts(f.tree, f.namespaces, f.resident, prompts, prompt_blocks)
        records = [
            _phase(cl.address, picks, want, 1, duration_s / 2, unary, depth, client),
            _phase(cl.address, picks, want, clients, duration_s, unary, depth, client),
        ]
        say(f"matches: {records[-1]['match_per_s']}/s, p99 {records[-1]['match_p99_ms']} ms")
        pub = phases.publish_rates(cl, clients=clients, chains=publish_chains, chain_blocks=prompt_blocks)
        say(
            f"publish: {pub['publish_blocks_per_s']} blocks/s (no bytes, batched), "
            f"{pub['publish_single_blocks_per_s']} one chain per call, {pub['publish_e2e_blocks_per_s']} e2e"
            f", {pub['bytes_per_extra_replica']} B per extra replica"
        )
        best = int(np.argmax(want))
        probe = (picks[best][0], list(picks[best][1]), want[best])
        reb = phases.rebuild(cl, [*f.salts, phases.PUBLISH_SALT], probe, rebuild_timeout_s)
        say(f"rebuild: {reb['rebuild_blocks_per_s']} blocks/s, first hit after {reb['first_hit_s']} s")
        lock = phases.lock_held(cl, probe, evict_blocks=1024)
        say(f"stalls: evict {lock['evict_stall_ms']} ms, node death {lock['node_death_stall_ms']} ms")
    main = records[-1]
    metrics = lock["lock_metrics_after"]
    summary: dict[str, Any] = {
        "blocks": blocks,
        "namespaces": len(f.namespaces),
        "trace": trace.name,
        "tree_blocks": f.tree.num_blocks,
        "stores": stores,
        "layout": TINY_LAYOUT,
        "fill_s": round(f.seconds, 1),
        "fill_blocks_per_s": round(blocks / f.seconds, 1),
        "fill_calls": f.calls,
        "fill_clients": writers,
        "store_mode": "metadata-only",
        "rss_before_bytes": rss0,
        "rss_after_fill_bytes": rss1,
        "peak_rss_bytes": peak,
        "bytes_per_block": round((rss1 - rss0) / blocks, 1),
        "peak_bytes_per_block": round((peak - rss0) / blocks, 1),
        "bytes_per_block_after_rebuild": round((reb["rss_after_rebuild_bytes"] - rss0) / blocks, 1),
        "match_per_s": main["match_per_s"],
        "match_p50_ms": main["match_p50_ms"],
        "match_p99_ms": main["match_p99_ms"],
        "short_matches": sum(r["short_matches"] for r in records),
        "hit_blocks_per_match": main["hit_blocks_per_match"],
        "baseline_one_client_match_per_s": records[0]["match_per_s"],
        "prompt_blocks": prompt_blocks,
        "clients": clients,
        "client": client,
        **pub,
        **{k: v for k, v in reb.items() if k != "rss_after_rebuild_bytes"},
        "node_death_lock_ms": metrics.get("kvpool_master_node_death_lock_ms", lock["node_death_stall_ms"]),
        # the admin Evict is not a maintenance tick: its figure is the stall a concurrent match saw
        "watermark_tick_ms": lock["evict_stall_ms"],
        "watermark_tick_metric_ms": metrics.get("kvpool_master_watermark_tick_ms"),
        "lock_held_source": "node death: the master's lock metric; watermark: the longest match a concurrent "
        "client waited during the Evict",
        **{k: v for k, v in lock.items() if not k.startswith("lock_metrics")},
        "lock_metrics": metrics,
    }
    summary |= grade(summary)
    _print(summary, records)
    return write_report(json_out, "master", records, summary)


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _print(summary: dict[str, Any], records: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from kvpool.console import console

    out = console()
    table = Table(title=f"kvpool bench master: {summary['blocks']:,} resident blocks")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for name in (
        "bytes_per_block",
        "peak_bytes_per_block",
        "bytes_per_extra_replica",
        "match_per_s",
        "match_p99_ms",
        "hit_blocks_per_match",
        "baseline_one_client_match_per_s",
        "publish_blocks_per_s",
        "publish_single_blocks_per_s",
        "publish_e2e_blocks_per_s",
        "fill_blocks_per_s",
        "rebuild_blocks_per_s",
        "first_hit_s",
        "node_death_lock_ms",
        "watermark_tick_ms",
    ):
        op, bound = TARGETS.get(name, ("", None))
        value = summary.get(name)
        table.add_row(
            name, "not measured" if value is None else f"{value:,}", f"{op} {bound:,}" if op else ""
        )
    out.print(table)
    runs = Table(title="match phases")
    cols = ("clients", "mode", "matches", "match_per_s", "match_p50_ms", "match_p99_ms", "short_matches")
    for col in cols:
        runs.add_column(col)
    for r in records:
        runs.add_row(*[str(r[k]) for k in cols])
    out.print(runs)
    out.print(f"lock-held figures: {summary['lock_held_source']}")
    missed = [k.removesuffix("_met") for k, v in summary.items() if k.endswith("_met") and v is False]
    missed = [k for k in missed if k != "target"]
    out.print(
        "[green]target met[/green]"
        if summary["target_met"]
        else f"[red]target NOT met[/red]: {', '.join(missed)}"
    )
