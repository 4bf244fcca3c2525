"""`kvpool bench master`: prompt matches of 64 blocks from concurrent clients against a real master.

A master process and one store process on 127.0.0.1; `prompts` chains of `blocks` blocks are published
for real (reserve → UCX write → commit: `publish_per_s` counts prompts). Then `clients` client processes
(real clients are separate nodes: one interpreter each, so no client shares another's GIL), each with its
own channel, match one prompt per stream message (or per unary call with `--unary`; `--depth D`: D
messages in flight per stream, each still one prompt, latency from its send to its answer), counting
the hit and taking no lease, for `duration_s`; the rate counts from the common start until the last client
reports. Clients are the lean load generator (`master_load`, pre-serialized requests, default) or the
library's `MasterClient` (`client="api"`). Baseline measured in the same run: one client alone.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.master_load import LeanJob, lean_client
from kvpool.client import MasterClient, PoolClient
from kvpool.client import convert as cv
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, start_master, start_store
from kvpool.report import write_report
from kvpool.types import KVLayout


def _client(
    address: str,
    ns: bytes,
    chains: Sequence[Sequence[bytes]],
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
    errors = 0
    with MasterClient(address, timeout_s=5) as c:
        stream = None if unary else c.match_stream()
        call = c.match if stream is None else stream.match
        call(ns, chains[0])  # warm the channel
        ready.release()
        go.wait()
        stop_at = time.perf_counter() + duration_s
        i = k
        if stream is not None and depth > 1:  # pipelined: `depth` prompts in flight, one per message
            sent: deque[float] = deque()
            while True:
                more = time.perf_counter() < stop_at
                if not more and not sent:
                    break
                while more and len(sent) < depth:
                    sent.append(time.perf_counter())
                    stream.send(ns, chains[i % len(chains)], count_hit=True)
                    i += clients
                m = stream.receive()
                lat.append(time.perf_counter() - sent.popleft())
                errors += m.num_matched != len(chains[0])
        while stream is None or depth <= 1:
            if time.perf_counter() >= stop_at:
                break
            t0 = time.perf_counter()
            m = call(ns, chains[i % len(chains)], count_hit=True, num_prompt_tokens=0)
            lat.append(time.perf_counter() - t0)
            errors += m.num_matched != len(chains[0])
            i += clients
        if stream is not None:
            stream.close()
    out.put((k, lat, errors))


def _phase(
    address: str,
    ns: bytes,
    chains: Sequence[Sequence[bytes]],
    clients: int,
    duration_s: float,
    unary: bool,
    depth: int,
    client: str = "lean",
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # no fork: the parent holds gRPC channels
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    if client == "lean":
        reqs = [cv.match_pb(ns, chain, True, 0, 0, "").SerializeToString() for chain in chains]
        args: list[tuple[Any, ...]] = [
            (LeanJob(address, reqs, len(chains[0]), k, clients, unary, depth, duration_s), ready, go, out)
            for k in range(clients)
        ]
        target: Any = lean_client
    else:
        args = [
            (address, ns, chains, k, clients, unary, depth, ready, go, duration_s, out)
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
    all_ms = np.array([x for _, per, _ in results for x in per]) * 1000
    return {
        "clients": clients,
        "mode": ("unary" if unary else "stream" if depth <= 1 else f"stream x{depth}") + f", {client}",
        "matches": int(all_ms.size),
        "match_per_s": round(all_ms.size / elapsed, 1),
        "match_p50_ms": round(float(np.percentile(all_ms, 50)), 3),
        "match_p99_ms": round(float(np.percentile(all_ms, 99)), 3),
        "short_matches": sum(e for _, _, e in results),
    }


TARGET_MATCH_PER_S = 3000.0
TARGET_MATCH_P99_MS = 10.0


def grade(summary: dict[str, Any]) -> dict[str, Any]:
    """The verdict of a summary's own figures: `target_met` (bool) = match_per_s >= `TARGET_MATCH_PER_S`,
    match_p99_ms <= `TARGET_MATCH_P99_MS`, and no short match (an answer with fewer blocks than were
    published is a wrong answer, never a fast one) in the measured phase."""
    checks = {
        "match_per_s_met": summary["match_per_s"] >= TARGET_MATCH_PER_S,
        "match_p99_met": summary["match_p99_ms"] <= TARGET_MATCH_P99_MS,
        "no_short_matches_met": summary["short_matches"] == 0,
    }
    return checks | {"target_met": all(checks.values())}


def run_master_bench(
    *,
    clients: int,
    blocks: int,
    prompts: int,
    duration_s: float,
    unary: bool,
    json_out: Path | None,
    depth: int = 1,
    client: str = "lean",
) -> dict[str, Any]:
    from rich.table import Table

    from kvpool.console import console
    from transfer import UcxTransport

    layout = KVLayout.from_fingerprint(LAYOUT)
    master = start_master()
    store = None
    transport = UcxTransport()
    try:
        segment = f"{max(64, (prompts * blocks * layout.block_nbytes >> 20) * 2)}MiB"
        store = start_store(master.grpc_address, "bench-s0", segment=segment)
        with MasterClient(master.grpc_address) as c:
            while not any(n.alive for n in c.list_nodes()):
                time.sleep(0.05)
            time.sleep(0.3)
            ns, _ = c.register_namespace("bench", "v1", LAYOUT)
        chains = [
            hash_blocks(ns, [p] * (blocks * layout.block_size), layout.block_size) for p in range(prompts)
        ]
        data = [np.full(layout.block_nbytes, b % 251, dtype=np.uint8) for b in range(blocks)]
        with PoolClient(master.grpc_address, transport, block_nbytes=layout.block_nbytes) as pc:
            t0 = time.perf_counter()
            for chain in chains:
                pc.put_blocks(ns, None, chain, data)
            publish_s = time.perf_counter() - t0
        records = [
            _phase(master.grpc_address, ns, chains, 1, duration_s / 2, unary, depth, client),
            _phase(master.grpc_address, ns, chains, clients, duration_s, unary, depth, client),
        ]
    finally:
        transport.close()
        if store is not None:
            store.kill()
        master.kill()
    main = records[-1]
    summary = {
        "match_per_s": main["match_per_s"],
        "match_p50_ms": main["match_p50_ms"],
        "match_p99_ms": main["match_p99_ms"],
        "short_matches": main["short_matches"],
        "publish_per_s": round(prompts / publish_s, 2),
        "publish_blocks_per_s": round(prompts * blocks / publish_s, 1),
        "baseline_one_client_match_per_s": records[0]["match_per_s"],
        "blocks_per_match": blocks,
        "clients": clients,
        "stream_depth": 0 if unary else depth,
        "client": client,
        "target": "match_per_s >= 3000 and match_p99_ms <= 10, no short match",
    }
    summary |= grade(summary)
    table = Table(title=f"kvpool bench master ({blocks}-block prompts)")
    cols = ("clients", "mode", "matches", "match_per_s", "match_p50_ms", "match_p99_ms", "short_matches")
    for col in cols:
        table.add_column(col)
    for r in records:
        table.add_row(*[str(r[k]) for k in cols])
    out = console()
    out.print(table)
    out.print(f"publish: {summary['publish_per_s']} prompts/s ({summary['publish_blocks_per_s']} blocks/s)")
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    out.print(f"target ({summary['target']}): {verdict}")
    return write_report(json_out, "master", records, summary)
