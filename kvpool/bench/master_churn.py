"""`kvpool bench master-churn`: match latency and master memory before vs after client-created churn.

The figure: repeating an operation a client can issue at will leaves O(1) state on the master and
does not slow its hot path. A master process and one store process on 127.0.0.1; `prompts` chains of
`blocks` blocks are published for real (as in `kvpool bench master`). Then, in order:

1. *before*: `reps` rounds of `matches` prompt matches (one client, one unary call at a time, requests
   serialized once, the hit counted, no lease), each round's p50/p99 kept;
2. *churn*: `cycles` flush/re-register cycles on a second namespace (publish `churn_blocks` blocks,
   `InvalidateNamespace`, `RegisterNamespace`), then `salts` `RegisterNamespace` calls, each with a
   distinct cache salt (one tenant, `churn/<i>`: each salt is a namespace);
3. *after*: the same rounds as *before*, same requests.

The master's VmRSS (from /proc) and `Stats.num_namespaces` / `num_blocks` are read before, between the
cycles and the salts, and after. The baseline is measured in the same run; the spread of p99 over the
rounds of one phase is the noise the before/after change is read against. A figure, never a timed
assertion.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.client import MasterClient, PoolClient
from kvpool.client import convert as cv
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from kvpool.report import write_report
from kvpool.types import KVLayout

_UNARY = "/kvpool.v1.Master/MatchPrefix"
_COLS = ("phase", "round", "matches", "match_p50_ms", "match_p99_ms", "short_matches")


def rss_mib(pid: int) -> float:
    """VmRSS of process `pid` in MiB (0.0 where /proc cannot tell)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


@contextmanager
def _pool(prompts: int, blocks: int, churn_blocks: int) -> Iterator[tuple[Proc, PoolClient]]:
    """A master and one store, sized for the working set plus one churn cycle's blocks (flushed blocks
    are reclaimed in the background: room for many cycles' worth)."""
    from transfer import UcxTransport

    layout = KVLayout.from_fingerprint(LAYOUT)
    master = start_master()
    store = None
    transport = UcxTransport()
    try:
        need = (prompts * blocks + 64 * max(1, churn_blocks)) * layout.block_nbytes
        store = start_store(master.grpc_address, "churn-s0", segment=f"{max(64, (need >> 20) * 2)}MiB")
        with MasterClient(master.grpc_address) as c:
            while not any(n.alive for n in c.list_nodes()):
                time.sleep(0.05)
        time.sleep(0.3)
        with PoolClient(master.grpc_address, transport, block_nbytes=layout.block_nbytes) as pc:
            yield master, pc
    finally:
        transport.close()
        if store is not None:
            store.kill()
        master.kill()


def _matches(address: str, reqs: Sequence[bytes], want: int, n: int, phase: str, rnd: int) -> dict[str, Any]:
    """`n` sequential unary matches of the pre-serialized `reqs`, round-robin; one round's record."""
    import grpc

    from kvpool.v1 import kvpool_pb2 as pb

    lat = np.empty(n)
    short = 0
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(_UNARY, request_serializer=None, response_deserializer=None)
        for r in reqs[: min(len(reqs), 50)]:  # warm the channel
            call(r, timeout=5)
        for i in range(n):
            t0 = time.perf_counter()
            raw = call(reqs[i % len(reqs)], timeout=5)
            lat[i] = time.perf_counter() - t0
            short += pb.MatchPrefixResponse.FromString(raw).num_matched != want
    ms = lat * 1000
    return {
        "phase": phase,
        "round": rnd,
        "matches": n,
        "match_p50_ms": round(float(np.percentile(ms, 50)), 3),
        "match_p99_ms": round(float(np.percentile(ms, 99)), 3),
        "short_matches": short,
    }


def _state(c: MasterClient, master: Proc) -> dict[str, Any]:
    s = c.stats()
    return {
        "rss_mib": rss_mib(master.popen.pid),
        "num_namespaces": s.num_namespaces,
        "num_blocks": s.num_blocks,
    }


def _cycles(c: MasterClient, pc: PoolClient, cycles: int, churn_blocks: int) -> float:
    """The flush/re-register cycles on namespace ("churn", "v1"); seconds they took."""
    layout = KVLayout.from_fingerprint(LAYOUT)
    ns, _ = c.register_namespace("churn", "v1", LAYOUT)
    chain = hash_blocks(ns, [7] * (max(1, churn_blocks) * layout.block_size), layout.block_size)
    data = [np.full(layout.block_nbytes, 7, dtype=np.uint8)] * len(chain)
    t0 = time.perf_counter()
    for _ in range(cycles):
        if churn_blocks > 0:
            pc.put_blocks(ns, None, chain, data)
        c.invalidate(ns)
        c.register_namespace("churn", "v1", LAYOUT)
    return round(time.perf_counter() - t0, 2)


def _salts(c: MasterClient, salts: int) -> float:
    """`salts` registrations, each with a distinct salt of one tenant; seconds they took."""
    t0 = time.perf_counter()
    for i in range(salts):
        c.register_namespace("churn", "v1", LAYOUT, cache_salt=f"churn/{i}")
    return round(time.perf_counter() - t0, 2)


def _median(records: Sequence[dict[str, Any]], key: str) -> float:
    return round(float(np.median([r[key] for r in records])), 3)


def _spread(records: Sequence[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in records]
    return round(max(values) - min(values), 3)


RSS_GROWTH_MAX_MIB = 50.0


def grade(s: dict[str, Any]) -> dict[str, Any]:
    """The verdict of a summary's own figures (`target_met`, bool, and each check): match p99 after the
    churn not slower than before beyond the noise; master RSS grown < `RSS_GROWTH_MAX_MIB`; the flush
    cycles leave one namespace (+1: the flushed one) and each salt adds exactly one; every match full (a
    short match is a wrong answer)."""
    checks = {
        "match_p99_met": not s["match_p99_slower_beyond_noise"],
        "rss_growth_met": s["rss_growth_mib"] < RSS_GROWTH_MAX_MIB,
        "namespaces_met": s["num_namespaces_after_cycles"] == s["num_namespaces_before"] + 1
        and s["num_namespaces_after"] == s["num_namespaces_after_cycles"] + s["salts"],
        "no_short_matches_met": s["short_matches"] == 0,
    }
    return checks | {"target_met": all(checks.values())}


def run_master_churn(
    *,
    cycles: int,
    salts: int,
    matches: int,
    reps: int,
    blocks: int,
    prompts: int,
    churn_blocks: int,
    json_out: Path | None,
) -> dict[str, Any]:
    from rich.table import Table

    from kvpool.console import console

    layout = KVLayout.from_fingerprint(LAYOUT)
    with _pool(prompts, blocks, churn_blocks) as (master, pc), MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("bench", "v1", LAYOUT)
        chains = [
            hash_blocks(ns, [p] * (blocks * layout.block_size), layout.block_size) for p in range(prompts)
        ]
        data = [np.full(layout.block_nbytes, b % 251, dtype=np.uint8) for b in range(blocks)]
        for chain in chains:
            pc.put_blocks(ns, None, chain, data)
        reqs = [cv.match_pb(ns, chain, True, 0, 0, "").SerializeToString() for chain in chains]
        addr = master.grpc_address
        before = [_matches(addr, reqs, blocks, matches, "before", k + 1) for k in range(reps)]
        state_before = _state(c, master)
        cycles_s = _cycles(c, pc, cycles, churn_blocks)
        state_cycles = _state(c, master)
        salts_s = _salts(c, salts)
        after = [_matches(addr, reqs, blocks, matches, "after", k + 1) for k in range(reps)]
        state_after = _state(c, master)
    records = before + after
    p99_before, p99_after = _median(before, "match_p99_ms"), _median(after, "match_p99_ms")
    noise = max(_spread(before, "match_p99_ms"), _spread(after, "match_p99_ms"))
    summary = {
        "cycles": cycles,
        "salts": salts,
        "matches_per_round": matches,
        "rounds": reps,
        "blocks_per_match": blocks,
        "churn_blocks_per_cycle": churn_blocks,
        "match_p50_before_ms": _median(before, "match_p50_ms"),
        "match_p50_after_ms": _median(after, "match_p50_ms"),
        "match_p99_before_ms": p99_before,
        "match_p99_after_ms": p99_after,
        "match_p99_change_ms": round(p99_after - p99_before, 3),
        "match_p99_noise_ms": noise,  # the largest p99 spread over one phase's rounds
        "match_p99_slower_beyond_noise": p99_after - p99_before > noise,  # faster is never a regression
        "short_matches": sum(r["short_matches"] for r in records),
        "rss_before_mib": state_before["rss_mib"],
        "rss_after_cycles_mib": state_cycles["rss_mib"],
        "rss_after_mib": state_after["rss_mib"],
        "rss_growth_mib": round(state_after["rss_mib"] - state_before["rss_mib"], 1),
        "num_namespaces_before": state_before["num_namespaces"],
        "num_namespaces_after_cycles": state_cycles["num_namespaces"],
        "num_namespaces_after": state_after["num_namespaces"],
        "num_blocks_before": state_before["num_blocks"],
        "num_blocks_after_cycles": state_cycles["num_blocks"],
        "num_blocks_after": state_after["num_blocks"],
        "cycles_s": cycles_s,
        "salts_s": salts_s,
        "target": "match p99 after within noise of before; rss_growth_mib < 50; namespaces grow by salts + 1; "
        "no short match",
    }
    summary |= grade(summary)
    table = Table(title=f"kvpool bench master-churn ({cycles} flush cycles, {salts} salts)")
    for col in _COLS:
        table.add_column(col)
    for r in records:
        table.add_row(*[str(r[k]) for k in _COLS])
    out = console()
    out.print(table)
    out.print(
        f"match p99 {p99_before} -> {p99_after} ms (noise {noise} ms); master RSS "
        f"{summary['rss_before_mib']} -> {summary['rss_after_cycles_mib']} (after the cycles) -> "
        f"{summary['rss_after_mib']} MiB; namespaces {summary['num_namespaces_before']} -> "
        f"{summary['num_namespaces_after_cycles']} -> {summary['num_namespaces_after']}; "
        f"cycles {cycles_s} s, salts {salts_s} s"
    )
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    failed = [k.removesuffix("_met") for k, v in summary.items() if k.endswith("_met") and not v]
    out.print(
        f"target ({summary['target']}): {verdict}" + (f" (missed: {', '.join(failed)})" if failed else "")
    )
    return write_report(json_out, "master-churn", records, summary)
