"""`kvpool bench index`: in-process throughput and memory of `RadixIndex` at N resident blocks.

The index is filled with chains of `chain_len` blocks (one namespace, 4 store nodes each holding whole
chains, a quarter of the blocks; one replica per block: a distinct `Location` each, as the master
would hold). Measured:
- `insert_blocks_per_s`: whole-chain inserts into an empty index until N blocks are resident.
- `match_blocks_per_s`: full-chain matches of random resident chains, `count_hit=True`, locations
  returned (as replica columns: node index, slot, generation per block), no lease; hit counts and
  recency are updated by each match.
- `bytes_per_block`: tracemalloc delta of a second, identical build (hashes and locations included:
  the index keeps them), divided by N.
- Lock-held work, on the second build: `protected_count_ms` (`num_protected_blocks` with
  100 leases live), `watermark_tick_ms` (one watermark eviction of 1,024 slots on a store:
  `evict(1024, node_id=...)`, `watermark_tick_slots` freed) and `node_death_lock_ms` (the longest single step of
  the removal of a store holding a quarter of the blocks, `node_death_blocks` dropped in `node_death_steps`
  steps, `node_death_total_ms` in all): the index's part of what the master does under its lock.
Baseline measured in the same run: a plain `dict` from hash to location tuple walked block by block
(no tree check, no counters). Rates are wall-clock; the `_cpu_` twins divide by this process's CPU
time (steadier on a shared machine), and `match_vs_baseline` is the same-run wall-clock ratio.
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.index import RadixIndex
from kvpool.types import BlockHash, Location, MonotonicClock, NamespaceId

_NS = NamespaceId(b"bench-index-ns\x00\x00")
_ROUNDS = 5
"""Match timing alternates index and baseline over this many slices of the picks."""


def _chains(
    num_blocks: int, chain_len: int, seed: int = 0
) -> tuple[list[list[BlockHash]], list[list[tuple[Location]]]]:
    raw = np.random.default_rng(seed).bytes(16 * num_blocks)
    hashes = [BlockHash(raw[i : i + 16]) for i in range(0, 16 * num_blocks, 16)]
    chains = [hashes[i : i + chain_len] for i in range(0, num_blocks, chain_len)]
    nodes = [f"store-{k}" for k in range(4)]
    locs = [
        [(Location(nodes[c % 4], c * chain_len + j, 1),) for j in range(len(chain))]
        for c, chain in enumerate(chains)
    ]
    return chains, locs


def _build(chains: list[list[BlockHash]], locs: list[list[tuple[Location]]], size_bytes: int) -> RadixIndex:
    index = RadixIndex(clock=MonotonicClock(), policy="fwlru", max_blocks=sum(map(len, chains)))
    index.register_namespace(_NS)
    for chain, chain_locs in zip(chains, locs, strict=True):
        index.insert(_NS, chain, parent=None, locations=chain_locs, size_bytes=size_bytes)
    return index


def _match_index(index: RadixIndex, picks: list[list[BlockHash]]) -> int:
    matched = 0
    for chain in picks:
        matched += index.match_prefix(_NS, chain, count_hit=True, lease_ttl_ms=0).num_matched
    return matched


def _match_dict(table_map: dict[BlockHash, tuple[Location]], picks: list[list[BlockHash]]) -> int:
    """The baseline: walk a plain dict block by block until the first miss."""
    matched = 0
    for chain in picks:
        found = []
        for h in chain:
            loc = table_map.get(h)
            if loc is None:
                break
            found.append(loc)
        matched += len(found)
    return matched


def _lock_held(index: RadixIndex, chains: list[list[BlockHash]]) -> dict[str, Any]:
    """Milliseconds of the index's lock-held operations that once grew with N (see the docstring)."""
    for chain in chains[:100]:
        index.match_prefix(_NS, chain, count_hit=False, lease_ttl_ms=3_600_000)
    t0 = time.perf_counter()
    protected = index.num_protected_blocks
    protected_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tick = index.evict(1024, node_id="store-1")
    tick_s = time.perf_counter() - t0
    before = index.num_blocks
    t0 = time.perf_counter()
    index.begin_remove_node("store-0")
    longest_s = total_s = time.perf_counter() - t0
    steps = dropped = 0
    while index.node_removals:  # (the master releases its lock between these steps)
        t0 = time.perf_counter()
        rows, _ = index.remove_node_step()
        held_s = time.perf_counter() - t0
        longest_s, total_s, steps = max(longest_s, held_s), total_s + held_s, steps + 1
        dropped += len(rows) if rows is not None else 0
    assert protected > 0 and dropped == before - index.num_blocks
    return {
        "protected_count_ms": round(protected_s * 1e3, 3),
        "watermark_tick_ms": round(tick_s * 1e3, 2),
        "watermark_tick_slots": tick.num_freed_on_node,
        "node_death_lock_ms": round(longest_s * 1e3, 1),
        "node_death_total_ms": round(total_s * 1e3, 1),
        "node_death_steps": steps,
        "node_death_blocks": dropped,
    }


TARGET_MATCH_BLOCKS_PER_S = 2_000_000
TARGET_BYTES_PER_BLOCK = 300


def grade(summary: dict[str, Any]) -> dict[str, Any]:
    """The verdict of the summary's own figures: `match_rate_met`, `memory_met` and `target_met` (bool)."""
    checks = {
        "match_rate_met": summary["match_blocks_per_s"] >= TARGET_MATCH_BLOCKS_PER_S,
        "memory_met": summary["bytes_per_block"] <= TARGET_BYTES_PER_BLOCK,
    }
    return checks | {"target_met": all(checks.values())}


def run_index_bench(
    num_blocks: int, chain_len: int, num_matches: int, json_out: Path | None, *, seed: int = 0
) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from kvpool.report import write_report

    for name, value in (
        ("--num-blocks", num_blocks),
        ("--chain-len", chain_len),
        ("--num-matches", num_matches),
    ):
        if value <= 0:
            raise InvalidArgument(f"{name} must be positive, got {value}")
    size_bytes = 512 * 131_072
    chains, locs = _chains(num_blocks, chain_len, seed)
    gc.collect()
    t0 = time.perf_counter()
    index = _build(chains, locs, size_bytes)
    insert_s = time.perf_counter() - t0

    rng = np.random.default_rng(seed + 1)
    picks = [chains[i] for i in rng.integers(0, len(chains), size=num_matches)]
    table_map = {
        h: loc
        for chain, chain_locs in zip(chains, locs, strict=True)
        for h, loc in zip(chain, chain_locs, strict=True)
    }
    # the index and the baseline take turns over the same picks (load on a shared machine hits both)
    matched = base_matched = 0
    match_s = match_cpu_s = base_s = base_cpu_s = 0.0
    for r in range(_ROUNDS):
        part = picks[r::_ROUNDS]
        t0, c0 = time.perf_counter(), time.process_time()
        matched += _match_index(index, part)
        match_s, match_cpu_s = match_s + time.perf_counter() - t0, match_cpu_s + time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        base_matched += _match_dict(table_map, part)
        base_s, base_cpu_s = base_s + time.perf_counter() - t0, base_cpu_s + time.process_time() - c0
    del table_map, index
    gc.collect()

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    chains2, locs2 = _chains(num_blocks, chain_len, seed)
    index = _build(chains2, locs2, size_bytes)
    del chains2, locs2
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_blocks == num_blocks
    lock_held = _lock_held(index, chains)

    summary: dict[str, Any] = {
        "num_blocks": num_blocks,
        "chain_len": chain_len,
        "num_matches": num_matches,
        "match_blocks_per_s": round(matched / match_s),
        "insert_blocks_per_s": round(num_blocks / insert_s),
        "bytes_per_block": round(used / num_blocks, 1),
        "baseline_dict_match_blocks_per_s": round(base_matched / base_s),
        "match_vs_baseline": round((matched / match_s) / (base_matched / base_s), 2),
        "match_cpu_blocks_per_s": round(matched / match_cpu_s),
        "baseline_dict_match_cpu_blocks_per_s": round(base_matched / base_cpu_s),
        **lock_held,
        "target_match_blocks_per_s": TARGET_MATCH_BLOCKS_PER_S,
        "target_bytes_per_block": TARGET_BYTES_PER_BLOCK,
    }
    summary |= grade(summary)
    records = [
        {"op": "insert", "blocks": num_blocks, "elapsed_s": round(insert_s, 3)},
        {"op": "match", "blocks": matched, "elapsed_s": round(match_s, 3)},
        {"op": "baseline_dict_match", "blocks": base_matched, "elapsed_s": round(base_s, 3)},
        {"op": "memory", "blocks": num_blocks, "traced_bytes": used},
    ]
    table = Table(title=f"kvpool bench index: {num_blocks:,} resident blocks, chains of {chain_len}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(
            key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
        )
    console = Console()
    console.print(table)
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    console.print(
        f"target (match_blocks_per_s >= {TARGET_MATCH_BLOCKS_PER_S:,}, bytes_per_block <= "
        f"{TARGET_BYTES_PER_BLOCK}): {verdict}"
    )
    return write_report(json_out, "index", records, summary)
