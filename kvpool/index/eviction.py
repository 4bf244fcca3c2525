"""Leaf-only eviction for `RadixIndex` (SGLang's heap over evictable leaves, with lazy invalidation).

A heap entry `(key, last_access_ms, seq, row)` is valid while `heap_seq[row] == seq_tag(seq)` and the row is still an evictable
leaf (alive, no children, no lock, no live lease, namespace active). For policies whose key can only
rise on access (`keys_rise_on_access`), a match marks the accessed leaf `stale_key` instead of pushing
(one flag write on the hot path); a stale entry is re-pushed with its current key when popped. Evicting a leaf may turn its parent
into one, which is pushed then, so the tree stays prefix-closed: after every eviction each resident
block's parent is resident.

Per node (`node_id` given; the master's watermarks): first drop that node's replica of unprotected
blocks of active namespaces that keep a pool replica on another node (not an eviction, no leaf
needed; least recently used first), then evict leaves holding a replica there, in policy order. A leaf
with several replicas on the node frees them all, so `num_freed_on_node` may pass the request. With
`group_budgets` (the master's pool-full eviction, `kvpool.master.quotas`), only leaves whose namespace
group still has budget there are evicted (key None: namespaces without a group), each spending one.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from kvpool.index import validate as v
from kvpool.index.columns import NO_SEQ, seq_tag
from kvpool.index.results import DroppedBlock, EvictResult

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex
    from kvpool.types import NamespaceId


def evict(
    index: RadixIndex,
    num_blocks: int,
    node_id: str | None,
    namespaces: Collection[NamespaceId] = (),
    group: str | None = None,
    group_budgets: dict[str | None, int] | None = None,
) -> EvictResult:
    """Raises `InvalidArgument` on a negative `num_blocks`. Expired leases are dropped first.
    `namespaces` (non-empty): only leaves of those namespaces, on any node (`node_id` is ignored);
    `group`: likewise, only leaves of the active namespaces registered with that group;
    `group_budgets` (with `node_id`): at most that many leaves of each group (updated in place)."""
    v.check_count(num_blocks, "num_blocks")
    index.expire_leases()
    if group is not None:
        dropped = _evict_leaves(index, num_blocks, None, group=group)
        return EvictResult(dropped, len(dropped), num_blocks - len(dropped))
    if namespaces:
        slots = {index._ns_active[ns] for ns in namespaces if ns in index._ns_active}
        dropped = _evict_leaves(index, num_blocks, None, slots) if slots else []
        return EvictResult(dropped, len(dropped), num_blocks - len(dropped))
    if node_id is None:
        dropped = _evict_leaves(index, num_blocks, None)
        return EvictResult(dropped, len(dropped), num_blocks - len(dropped))
    dropped = _drop_spare_replicas(index, num_blocks, node_id)
    freed = len(dropped)
    if freed < num_blocks:
        evicted = _evict_leaves(index, num_blocks - freed, node_id, budgets=group_budgets)
        dropped.extend(evicted)
        freed += sum(1 for d in evicted for loc in d.locations if loc.node_id == node_id)
    return EvictResult(dropped, freed, max(0, num_blocks - freed))


def _evict_leaves(
    index: RadixIndex,
    budget: int,
    node_id: str | None,
    ns_slots: set[int] | None = None,
    *,
    group: str | None = None,
    budgets: dict[str | None, int] | None = None,
) -> list[DroppedBlock]:
    """Pop evictable leaves in key order; with `node_id`, only those with a replica on that node count
    (`budget` then counts that node's slots); with `ns_slots` (or `group`), only leaves of those
    namespace slots (of that group; `budget` counts blocks); the others go back into the heap unchanged."""
    c, heap, dropped = index._c, index._heap, []
    skipped: list[tuple[float, int, int, int]] = []
    freed = 0
    while heap and freed < budget:
        entry = heapq.heappop(heap)
        key, _, seq, row = entry
        if c.heap_seq[row] != seq_tag(seq) or not index._evictable(row):
            continue
        if c.stale_key[row]:  # accessed since pushed: its key only rose; push it again with the new key
            index._push(row)
            continue
        if group is not None:
            if index._ns_group[int(c.ns_slot[row])] != group:
                skipped.append(entry)
                continue
            freed += 1
        elif ns_slots is not None:
            if int(c.ns_slot[row]) not in ns_slots:
                skipped.append(entry)
                continue
            freed += 1
        elif node_id is not None:
            on_node = sum(1 for loc in c.locations[row] if loc.node_id == node_id)
            row_group = index._ns_group[int(c.ns_slot[row])] if budgets is not None else None
            if not on_node or (budgets is not None and budgets.get(row_group, 0) <= 0):
                skipped.append(entry)
                continue
            if budgets is not None:
                budgets[row_group] -= 1
            freed += on_node
        else:
            freed += 1
        c.heap_seq[row] = NO_SEQ
        index.policy.on_evict(key)
        index.num_evictions += 1
        dropped.append(index._drop_row(row, "evict"))
    for entry in skipped:
        heapq.heappush(heap, entry)
    return dropped


def _drop_spare_replicas(index: RadixIndex, budget: int, node_id: str) -> list[DroppedBlock]:
    """Drop up to `budget` of `node_id`'s replicas of unprotected blocks of active namespaces that
    keep a pool replica on another node, least recently used first (then by row). Only rows with
    several replicas can qualify: they are the keys of the `extra` map (the work grows with the blocks
    that have a second replica, never with the index), filtered and sorted in numpy, then checked one
    by one in that order until the budget is spent."""
    c = index._c
    if budget <= 0 or not c.extra or not index._space.has(node_id):
        return []  # (no row has a second replica: nothing to scan)
    valid = np.array(index._ns_valid, dtype=np.bool_)
    rows = np.fromiter(c.extra.keys(), dtype=np.int64, count=len(c.extra))
    rows = rows[(c.lock_ref[rows] == 0) & (c.num_leases[rows] == 0)]
    rows = rows[valid[c.ns_slot[rows]]]
    if not rows.size:
        return []
    order = rows[np.lexsort((rows, c.last_access_ms[rows]))]
    dropped: list[DroppedBlock] = []
    for row in order.tolist():
        if len(dropped) >= budget:
            break
        locs = c.locations[row]
        if not any(x.node_id == node_id for x in locs) or not any(
            x.node_id != node_id and not x.local for x in locs
        ):
            continue
        block_hash = c.hash_of(row)
        for loc in locs:
            if loc.node_id == node_id and len(dropped) < budget:
                index._remove_location_row(row, loc)
                ns = index._ns_ids[int(c.ns_slot[row])]
                dropped.append(DroppedBlock(ns, block_hash, (loc,), "replica"))
    return dropped
