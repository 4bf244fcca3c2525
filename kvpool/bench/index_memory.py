"""The radix index's resident memory and rates at N blocks, measured as the process's RSS (`scripts/index_memory.py`).

The index is filled through `RadixIndex.insert_bulk` (a store's inventory adopted in batches of
`batch` blocks) with chains of `chain_len` blocks under one namespace, one replica per block on one of
4 store nodes (whole chains per node). Block hashes are generated per batch from the block number
(splitmix64), so no input is held beside the index while it is measured.

Measured: `bytes_per_block` = (RSS after the fill, after gc - RSS before) / N; `trimmed_bytes_per_block`
the same after glibc's `malloc_trim(0)` (the allocator keeps freed batch temporaries otherwise: ~15 B a
block at 1 M); `peak_bytes_per_block` =
(the process's peak RSS - RSS before) / N (the inputs of one batch included); `accounted_bytes_per_block`
= `RadixIndex.memory_bytes() / N` and `accounted_vs_rss`, `accounted_vs_trimmed_rss` (its ratios to the
RSS growths);
`bulk_insert_blocks_per_s`; `lookup_blocks_per_s` (batch lookups of 64 random resident hashes through
the hash table); `match_blocks_per_s` (full 64-block matches of random resident chains, hits counted).
"""

from __future__ import annotations

import ctypes
import gc
import resource
import time
from typing import Any

import numpy as np
import psutil

from kvpool.index import RadixIndex
from kvpool.types import BlockHash, MonotonicClock, NamespaceId

NS = NamespaceId(b"index-memory-ns\x00")
_NODES = 4


def block_hashes(ids: np.ndarray) -> np.ndarray:
    """(n, 16) uint8 hashes of block numbers `ids` (splitmix64 of 2i and 2i+1: uniformly random bits)."""

    def mix(z: np.ndarray) -> np.ndarray:
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    ids = ids.astype(np.uint64)
    out = np.empty((len(ids), 2), np.uint64)
    out[:, 0] = mix(ids * np.uint64(2))
    out[:, 1] = mix(ids * np.uint64(2) + np.uint64(1))
    return out.view(np.uint8).reshape(len(ids), 16)


def fill(index: RadixIndex, num_blocks: int, chain_len: int, batch: int) -> None:
    """Adopt blocks 0..num_blocks-1 (block i's parent is i-1 within its chain) in batches."""
    index.register_namespace(NS)
    for start in range(0, num_blocks, batch):
        ids = np.arange(start, min(num_blocks, start + batch), dtype=np.int64)
        pos = ids % chain_len
        has_parent = pos != 0
        chain = ids // chain_len
        for node in range(_NODES):  # a store's inventory: its own chains
            sel = chain % _NODES == node
            index.insert_bulk(
                NS,
                block_hashes(ids[sel]),
                block_hashes(np.maximum(ids[sel] - 1, 0)),
                has_parent[sel],
                f"store-{node}",
                ids[sel].astype(np.uint64),
                np.ones(int(sel.sum()), np.uint64),
                65_536,
                ids[sel].astype(np.uint64),
                1,
            )


def measure(
    num_blocks: int, chain_len: int = 64, batch: int = 65_536, num_matches: int = 20_000
) -> dict[str, Any]:
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    index = RadixIndex(clock=MonotonicClock(), policy="fwlru", max_blocks=num_blocks)
    fill(index, num_blocks, chain_len, batch)
    insert_s = time.perf_counter() - t0
    gc.collect()
    rss1 = proc.memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_trimmed = proc.memory_info().rss
    accounted = index.memory_bytes()
    assert index.num_blocks == num_blocks

    rng = np.random.default_rng(1)
    slot = index._ns_active[NS]
    queries = [block_hashes(rng.integers(0, num_blocks, 64)).view("<u8").reshape(-1, 2) for _ in range(500)]
    t0 = time.perf_counter()
    for q in queries:
        index._table.find_many(slot, q)
    lookup_s = time.perf_counter() - t0
    num_chains = num_blocks // chain_len
    picks = rng.integers(0, num_chains, num_matches)
    prompts = []
    for c in picks.tolist():
        raw = block_hashes(np.arange(c * chain_len, (c + 1) * chain_len)).tobytes()
        prompts.append([BlockHash(raw[i : i + 16]) for i in range(0, len(raw), 16)])
    matched = 0
    t0 = time.perf_counter()
    for prompt in prompts:
        matched += index.match_prefix(NS, prompt, count_hit=True, lease_ttl_ms=0).num_matched
    match_s = time.perf_counter() - t0
    assert matched == num_matches * chain_len
    grown = rss1 - rss0
    return {
        "num_blocks": num_blocks,
        "chain_len": chain_len,
        "bytes_per_block": round(grown / num_blocks, 1),
        "peak_bytes_per_block": round((peak - rss0) / num_blocks, 1),
        "trimmed_bytes_per_block": round((rss_trimmed - rss0) / num_blocks, 1),
        "accounted_bytes_per_block": round(accounted / num_blocks, 1),
        "accounted_vs_rss": round(accounted / grown, 3),
        "accounted_vs_trimmed_rss": round(accounted / (rss_trimmed - rss0), 3),
        "bulk_insert_blocks_per_s": round(num_blocks / insert_s),
        "lookup_blocks_per_s": round(500 * 64 / lookup_s),
        "match_blocks_per_s": round(matched / match_s),
        "hash_table_capacity": index._table.capacity,
    }
