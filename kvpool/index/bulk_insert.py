"""`RadixIndex.insert_bulk`: adopt a batch of one store's blocks (its inventory) in columns.

Parent-first and vectorised: every block is looked up at once (one numpy pass per probe round of the
hash table), so are the parents; blocks whose parent is itself new in the batch are resolved by pointer
jumping over the batch (O(n log depth) numpy work, no Python step per block), which also finds each new
block's depth and the batch block its chain hangs from. The new blocks are then allocated in (chain,
depth) order, so a chain of the batch takes consecutive rows and stays one run for the match path, and
linked to their parents (siblings grouped per parent) with whole-array writes. Python work per block is
left to the eviction-heap entries of the new leaves (one per chain) and to blocks that gain a second
replica. Invariants kept: the tree stays prefix-closed (a block enters only with its parent), heap
entries for new leaves, per-node and per-group accounting, run heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.index.columns import NO_ROW
from kvpool.index.results import BulkInsertResult
from kvpool.index.validate import MAX_GENERATION, MAX_U32
from kvpool.types import Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex


def _hash_rows(value: object, n: int | None, what: str) -> np.ndarray:
    if (
        not isinstance(value, np.ndarray)
        or value.dtype != np.uint8
        or value.ndim != 2
        or value.shape[1] != 16
    ):
        raise InvalidArgument(f"{what} must be an (n, 16) uint8 array")
    if n is not None and len(value) != n:
        raise InvalidArgument(f"{what} has {len(value)} rows for {n} blocks")
    return np.ascontiguousarray(value).view("<u8")


def _column(value: object, n: int, what: str, limit: int) -> np.ndarray:
    if (
        not isinstance(value, np.ndarray)
        or value.ndim != 1
        or len(value) != n
        or value.dtype.kind not in "iu"
    ):
        raise InvalidArgument(f"{what} must be an ({n},) integer array")
    if n and (int(value.min()) < 0 or int(value.max()) > limit):
        raise InvalidArgument(f"{what} must hold ints in [0, {limit}]")
    return value


def insert_bulk(
    index: RadixIndex,
    ns: NamespaceId,
    block_hashes: np.ndarray,
    parent_hashes: np.ndarray,
    has_parent: np.ndarray,
    node_id: str,
    slots: np.ndarray,
    generations: np.ndarray,
    size_bytes: int,
    checksums: np.ndarray,
    target_replicas: int,
) -> BulkInsertResult:
    """Insert n blocks held by `node_id` under the active namespace `ns`.

    `block_hashes`, `parent_hashes`: (n, 16) uint8; `has_parent`: (n,) bool (False: the block hangs
    from the namespace root, its `parent_hashes` row is ignored); `slots`: (n,) integers in [0, 2**32),
    `generations`: (n,) integers in [0, 2**63) (the replica `Location(node_id, slot, generation)`); `size_bytes`: each block's size,
    an int in [1, 2**32); `checksums`: (n,) unsigned integers (uint64); `target_replicas`: int in
    [1, 255]. A new block gets its checksum and target; a present one gets them only if never set.

    Returns a `BulkInsertResult` (each block exactly one of inserted / merged / waiting / refused).
    Raises `InvalidArgument` (nothing changes) for an unregistered namespace, or an argument of the
    wrong shape, dtype or range. O(n log depth) numpy work.
    """
    slot = index._ns_active.get(ns)
    if slot is None:
        raise InvalidArgument(f"namespace {bytes(ns).hex()} is not registered (or was invalidated)")
    if not isinstance(node_id, str) or not node_id:
        raise InvalidArgument("node_id must be a non-empty str")
    keys = _hash_rows(block_hashes, None, "block_hashes")
    n = len(keys)
    pkeys = _hash_rows(parent_hashes, n, "parent_hashes")
    if not isinstance(has_parent, np.ndarray) or has_parent.dtype != np.bool_ or has_parent.shape != (n,):
        raise InvalidArgument(f"has_parent must be an ({n},) bool array")
    slots = _column(slots, n, "slots", MAX_U32)
    generations = _column(generations, n, "generations", MAX_GENERATION)
    checksums = _column(checksums, n, "checksums", 2**64 - 1)
    if not isinstance(size_bytes, int) or isinstance(size_bytes, bool) or not 0 < size_bytes <= MAX_U32:
        raise InvalidArgument(f"size_bytes must be an int in [1, 2**32), got {size_bytes!r}")
    if not isinstance(target_replicas, int) or not 1 <= target_replicas <= 255:
        raise InvalidArgument(f"target_replicas must be an int in [1, 255], got {target_replicas!r}")
    out = BulkInsertResult(*(np.zeros(n, dtype=np.bool_) for _ in range(4)))
    if n == 0:
        return out
    c, table = index._c, index._table

    # repeats within the batch: the first occurrence counts, later ones are refused
    by_key = np.argsort(keys[:, 0], kind="stable")  # equal keys in batch order
    sorted_keys = keys[by_key]
    if (sorted_keys[1:, 0] == sorted_keys[:-1, 0]).any():  # shared low halves: by the high half too
        by_key = np.lexsort((keys[:, 1], keys[:, 0]))
        sorted_keys = keys[by_key]
    same = np.zeros(n, dtype=np.bool_)
    same[1:] = (sorted_keys[1:] == sorted_keys[:-1]).all(axis=1)
    dup = np.zeros(n, dtype=np.bool_)
    dup[by_key[same]] = True

    existing = table.find_many(slot, keys)
    # each parent: a block of the batch (its first occurrence; its row if present), else the table's
    p_at = np.full(n, -1, dtype=np.int64)
    p_at[has_parent] = _in_batch(sorted_keys, by_key, pkeys[has_parent])
    p_row = np.full(n, NO_ROW, dtype=np.int64)
    inside = p_at >= 0
    p_row[inside] = existing[p_at[inside]]
    outside = has_parent & ~inside
    p_row[outside] = table.find_many(slot, pkeys[outside])
    p_known = ~has_parent | (p_row >= 0)  # the root, or a row of the index
    present = (existing >= 0) & ~dup
    same_parent = np.zeros(n, dtype=np.bool_)
    same_parent[present] = c.parent[existing[present]] == p_row[present]
    merged = present & same_parent & p_known
    refused = dup | (present & ~merged)
    cand = ~dup & (existing < 0)

    # a new block's parent: known (anchored), another new block of the batch, or neither (waiting)
    ptr = np.arange(n)  # fixed points are terminals (anchored or dead ends)
    dead = np.zeros(n, dtype=np.bool_)
    lookup = np.flatnonzero(cand & ~p_known)
    if (
        lookup.size
    ):  # a parent absent from the index: a candidate of the batch (its first occurrence), or none
        found = p_at[lookup]
        absent = found < 0
        ptr[lookup] = np.where(absent, lookup, found)
        dead[lookup] = absent
    parent_idx = ptr.copy()
    depth = (ptr != np.arange(n)).astype(np.int64)
    for _ in range(max(1, int(n).bit_length()) + 1):  # pointer jumping: ptr -> the chain's terminal
        nxt = ptr[ptr]
        if np.array_equal(nxt, ptr):
            break
        depth += depth[ptr]
        ptr = nxt
    terminal = ptr  # (in or under a cycle of the batch: a block of the cycle, never anchored)
    ins = cand & ~dead[terminal] & p_known[terminal]
    waiting = cand & ~ins

    new = np.flatnonzero(ins)
    if new.size:
        new = new[np.lexsort((depth[new], terminal[new]))]  # chains in consecutive rows, parents first
        rows = _insert_new(index, slot, new, parent_idx, p_row, keys, node_id, slots, generations, size_bytes)
        c.checksum[rows] = checksums[new]
        c.target_replicas[rows] = target_replicas
    m = np.flatnonzero(merged)
    if m.size:
        _merge(index, existing[m], node_id, slots[m], generations[m])
        rows = existing[m]
        unset = c.target_replicas[rows] == 0
        c.checksum[rows[unset]] = checksums[m][unset]
        c.target_replicas[rows[unset]] = target_replicas
    out.inserted[ins] = True
    out.merged[merged] = True
    out.waiting[waiting] = True
    out.refused[refused] = True
    return out


def _in_batch(sorted_keys: np.ndarray, by_key: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each of `wanted` ((m, 2) uint64 keys): the batch index of the first block with that key, or
    -1. `sorted_keys` is the batch's keys in `by_key` order (sorted by low half, then high, stable)."""
    lo, hi = sorted_keys[:, 0], sorted_keys[:, 1]
    at = np.searchsorted(lo, wanted[:, 0])
    found = np.full(len(wanted), -1, dtype=np.int64)
    # equal low halves are adjacent, sorted by high half: walk each run (random hashes: one step)
    step = 0
    todo = np.flatnonzero(at < len(lo))
    while todo.size:
        i = at[todo] + step
        ok = i < len(lo)
        todo, i = todo[ok], i[ok]
        same_lo = lo[i] == wanted[todo, 0]
        todo, i = todo[same_lo], i[same_lo]
        hit = hi[i] == wanted[todo, 1]
        found[todo[hit]] = by_key[i[hit]]
        todo = todo[~hit]
        step += 1
    return found


def _insert_new(
    index: RadixIndex,
    slot: int,
    new: np.ndarray,
    parent_idx: np.ndarray,
    p_row: np.ndarray,
    keys: np.ndarray,
    node_id: str,
    slots: np.ndarray,
    generations: np.ndarray,
    size_bytes: int,
) -> np.ndarray:
    """Allocate, fill, link and index the batch blocks `new` (parents before children); their rows."""
    c = index._c
    rows = c.alloc_rows(len(new))
    row_of = np.full(len(keys), NO_ROW, dtype=np.int64)
    row_of[new] = rows
    anchored = parent_idx[new] == new
    parents = np.where(anchored, p_row[new], row_of[parent_idx[new]])
    c.h64[rows] = keys[new]
    c.ns_slot[rows] = slot
    c.parent[rows] = parents
    c.last_access_ms[rows] = index._clock.now_ms()
    c.size_bytes[rows] = size_bytes
    c.recompute_cost_s[rows] = 0.0
    c.rep_node[rows] = c.node_index(node_id)
    c.rep_slot[rows] = slots[new]
    c.rep_gen[rows] = generations[new]
    c.rep_local[rows] = False
    _link(index, rows, parents)
    c.set_run_heads(rows)
    index._table.insert_many(rows)
    index._ns_count[slot] += len(rows)
    index._group_add(slot, len(rows))
    index._space.add_many(node_id, len(rows), len(rows) * size_bytes)
    for leaf in rows[c.num_children[rows] == 0].tolist():
        index._push(leaf)
    return rows


def _link(index: RadixIndex, rows: np.ndarray, parents: np.ndarray) -> None:
    """Make each new row a child of its parent (NO_ROW: none), the new children of one parent first
    among its children, in `rows` order, then its older ones."""
    c = index._c
    has = parents != NO_ROW
    ch, ps = rows[has], parents[has]
    if not ch.size:
        return
    o = np.argsort(ps, kind="stable")
    ch, ps = ch[o], ps[o]
    start = np.ones(len(ps), dtype=np.bool_)
    start[1:] = ps[1:] != ps[:-1]
    end = np.ones(len(ps), dtype=np.bool_)
    end[:-1] = start[1:]
    heads = ps[start]
    old_first = c.first_child[heads].astype(np.int64)
    nxt = np.empty_like(ch)
    nxt[:-1] = ch[1:]
    nxt[end] = old_first
    prv = np.empty_like(ch)
    prv[1:] = ch[:-1]
    prv[start] = NO_ROW
    c.next_sibling[ch] = nxt
    c.prev_sibling[ch] = prv
    older = old_first != NO_ROW
    c.prev_sibling[old_first[older]] = ch[end][older]
    c.first_child[heads] = ch[start]
    c.num_children[heads] += np.diff(np.append(np.flatnonzero(start), len(ps))).astype(np.int32)


def _merge(
    index: RadixIndex, rows: np.ndarray, node_id: str, slots: np.ndarray, generations: np.ndarray
) -> None:
    """Add the replica (node_id, slot, generation) to each present row that lacks it (vectorised check
    of the first replica; a Python step only for rows that gain one or hold several)."""
    c = index._c
    k = c._node_index.get(node_id, -2)
    same = (
        (c.rep_node[rows] == k)
        & (c.rep_slot[rows] == slots)
        & (c.rep_gen[rows] == generations)
        & ~c.rep_local[rows]
        & ~c.has_extra[rows]
    )
    todo = ~same
    for row, s, g in zip(rows[todo].tolist(), slots[todo].tolist(), generations[todo].tolist(), strict=True):
        index._add_location_row(row, Location(node_id, int(s), int(g)))
