"""`RadixIndex.match_prefix`: find the matched run with O(log n) table probes, then update it in bulk.

Chained hashes make presence prefix-closed (a block is resident only if its parent is; eviction is
leaf-only), so the matched length is the largest k with `block_hashes[k-1]` present: a binary search over
the hashes finds it with about log2(n) + 1 hash-table lookups (one when the whole chain is present). The k
matched rows are then found from the last one upwards by whole runs: `run_head[row]` is the first row of
the run of consecutive rows, each the parent of the next, that ends at `row` (a chain inserted in one
call is one run), so a match costs one Python step per run, not per block. The rows found are checked
against the hashes asked for (one comparison of their bytes with the hash column) and the root; inputs
that are not chains, or chains spread over more than `_MAX_RUNS` runs, take the plain path (one
vectorised table lookup of all k hashes, then a vectorised parent-link check). Either way the per-block work is a handful of numpy operations on a
slice (or an index array) of the matched rows: one record copy for the result, recency, hit counts.

Cost per match: O(log n + runs) Python steps and O(k) numpy work, k = matched blocks, n = asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.index.columns import HIT_COUNT_MAX, NO_ROW, Columns
from kvpool.index.results import MatchResult
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex

_MAX_RUNS = 8
"""Runs walked before a match falls back to the plain path (a batch lookup of every block)."""
_MIN_RUN = 4
"""A shorter run (but for the top one) sends the match to the plain path at once."""


def match_prefix(
    index: RadixIndex, ns: NamespaceId, block_hashes: Sequence[BlockHash], count_hit: bool, lease_ttl_ms: int
) -> MatchResult:
    """See `RadixIndex.match_prefix`."""
    if lease_ttl_ms < 0:
        raise InvalidArgument(f"lease_ttl_ms must be >= 0, got {lease_ttl_ms}")
    slot = index._ns_active.get(ns)
    if count_hit:
        index.num_lookup_blocks += len(block_hashes)
    if slot is None or not block_hashes:
        return MatchResult()
    hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
    try:
        all_joined = b"".join(hashes)
    except TypeError:
        all_joined = b""
    if len(all_joined) != 16 * len(hashes):  # a value that is not a block hash is present nowhere
        hashes = hashes[: next(i for i, h in enumerate(hashes) if not isinstance(h, bytes) or len(h) != 16)]
        all_joined = b"".join(hashes)
        if not hashes:
            return MatchResult()
    find = index._table.find
    n = len(hashes)
    last = find(slot, hashes[-1])
    k = n
    if last < 0:  # binary search: the largest k with hashes[k-1] present (k >= the true match)
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) >> 1
            row = find(slot, hashes[mid])
            if row < 0:
                hi = mid
            else:
                lo, last = mid + 1, row
        k = lo
        if last < 0:
            return MatchResult()
    c = index._c
    joined = all_joined[: 16 * k]
    sel = _runs(c, joined, k, last)
    if sel is not None:
        rec = c.gather(sel)  # a snapshot of the matched rows (one record each)
    else:  # not a chain of the tree, or too fragmented: one batch lookup of every block
        sel, rec = _walk(index, slot, joined, k)
        if sel is None:
            return MatchResult()
        last = int(sel[-1])
    k = len(rec)
    live: dict[int, tuple[Location, ...]] = {}
    if index._dying:  # a node removal runs: offer none of its replicas, stop before what it drops
        rows_of = range(sel.start, sel.stop) if isinstance(sel, slice) else sel.tolist()
        cut, live = _skip_dying(index, rec, rows_of)
        if cut == 0:
            return MatchResult()
        if cut < k:
            sel = slice(sel.start, sel.start + cut) if isinstance(sel, slice) else sel[:cut]
            rec, k = rec[:cut], cut
            last = int(rows_of[cut - 1])
        for i, locs in live.items():
            first = locs[0]
            rec["rep_node"][i], rec["rep_slot"][i] = c.node_index(first.node_id), first.slot
            rec["rep_gen"][i], rec["rep_local"][i] = first.generation, first.local
            rec["has_extra"][i] = len(locs) > 1
    lease_id, expiry_ms = None, 0
    if count_hit or lease_ttl_ms > 0:
        now = index._clock.now_ms()
        c.last_access_ms[sel] = now
        if count_hit:
            index.num_hit_blocks += k
            # a counted match hits every ancestor of what it hits, so the top row's count is the
            # largest: below the limit there, a plain increment cannot wrap (uint32 saturates)
            if c.hit_count[sel.start if type(sel) is slice else sel[0]] < HIT_COUNT_MAX:
                c.hit_count[sel] += 1
            else:
                hits = c.hit_count[sel]
                c.hit_count[sel] = np.where(hits < HIT_COUNT_MAX, hits + 1, hits)
            if index.policy.half_life_ms is not None:
                c.decayed[sel] += index._hit_weight(now)
        if lease_ttl_ms > 0:
            index.expire_leases()
            rows = np.arange(sel.start, sel.stop) if isinstance(sel, slice) else sel
            c.pin(rows, leases=1)
            expiry_ms = now + lease_ttl_ms
            lease_id = index._leases.grant(expiry_ms, rows, rec["gen"].copy())
        elif c.num_children[last] == 0:
            if index.policy.keys_rise_on_access:
                c.stale_key[last] = True  # re-keyed lazily when popped
            else:
                index._push(last)
    extra = None
    if c.extra:
        rows_of = range(sel.start, sel.stop) if isinstance(sel, slice) else sel.tolist()
        extra = {
            i: live[i][1:] if i in live else c.extra[rows_of[i]]
            for i in np.flatnonzero(rec["has_extra"]).tolist()
        }
    return MatchResult(k, lease_id, expiry_ms, node_ids=c.node_ids, records=rec, extra=extra)


def _skip_dying(
    index: RadixIndex, rec: np.ndarray, rows_of: Sequence[int]
) -> tuple[int, dict[int, tuple[Location, ...]]]:
    """(how many leading rows keep a replica off the dying nodes, {i: those replicas} for the leading
    multi-replica rows that lost one there). O(k) numpy plus Python per multi-replica row."""
    mask = index.dying_mask()
    multi = rec["has_extra"]
    bad = np.flatnonzero(mask[rec["rep_node"]] & ~multi)
    cut = int(bad[0]) if bad.size else len(rec)
    live: dict[int, tuple[Location, ...]] = {}
    for i in np.flatnonzero(multi[:cut]).tolist():
        locs = index._c.replicas(int(rows_of[i]))
        kept = tuple(x for x in locs if not index.is_dying(x.node_id))
        if not kept:
            return i, live
        if len(kept) != len(locs):
            live[i] = kept
    return cut, live


def _runs(c: Columns, joined: bytes, k: int, last: int) -> slice | np.ndarray | None:
    """The rows of the k hashes `joined` (their bytes, concatenated) found upwards from `last` (the row
    of the k-th) by runs: a slice when they are one run, else an index array; None when they do not
    match `joined` from the root, or span more than `_MAX_RUNS` runs or one shorter than `_MIN_RUN`
    (cheaper block by block)."""
    run_head, parent, stored = c.run_head, c.parent, c.h64
    runs: list[range] = []
    remaining, bottom = k, last
    while True:
        head = int(run_head[bottom])
        length = bottom - head + 1
        if length >= remaining:  # the top run (maybe cut: then the root check fails)
            top = bottom - remaining + 1
            if parent[top] != NO_ROW:
                return None
            if not runs:
                return slice(top, last + 1) if stored[top : last + 1].tobytes() == joined else None
            runs.append(range(top, bottom + 1))
            rows = np.array([r for run in reversed(runs) for r in run], dtype=np.int64)
            return rows if stored[rows].tobytes() == joined else None
        if length < _MIN_RUN or len(runs) == _MAX_RUNS - 1:
            return None
        runs.append(range(head, bottom + 1))
        remaining -= length
        bottom = int(parent[head])
        if bottom == NO_ROW:
            return None


def _walk(index: RadixIndex, slot: int, joined: bytes, k: int) -> tuple[np.ndarray | None, np.ndarray]:
    """The plain path: the rows of the leading k hashes (`joined`) that form a chain from the root (an
    index array, None when there are none) and their records."""
    c = index._c
    keys = np.frombuffer(joined, "<u8").reshape(-1, 2)
    found = index._table.find_many(slot, keys)
    missing = np.flatnonzero(found < 0)
    idx = (found if not missing.size else found[: missing[0]]).astype(np.int32)
    rec = c.gather(idx)
    parents = rec["parent"]  # int32, like idx: the chain check compares raw bytes
    if not len(idx) or parents[0] != NO_ROW:
        return None, rec
    if len(idx) > 1 and parents[1:].tobytes() != idx[:-1].tobytes():
        n = int((parents[1:] != idx[:-1]).argmax()) + 1
        idx, rec = idx[:n], rec[:n]
    return idx, rec
