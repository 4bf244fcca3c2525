"""Dropping many subtrees of `RadixIndex` at once (a dead store's orphans), with vectorised row work.

`drop_subtrees(index, roots, reason)` returns exactly what calling `_drop_subtree(root, reason)` for each
still-alive root in turn returned (the same `DroppedBlock`s, in the same order) and leaves the same rows,
maps, accounting and free list. What it skips is the per-row work those calls wasted: re-pushing into
the eviction heap a parent that is itself about to be dropped, and clearing fields one row at a time.
Python work per dropped row is left to the walk of the tree and the `DroppedBlock` itself (the hash
table entries go in one vectorised pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool.index.columns import NO_ROW
from kvpool.index.results import DroppedBlock

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex


def _postorder(index: RadixIndex, root: int, doomed: np.ndarray) -> list[int]:
    """`root` and its descendants not yet `doomed`, children before parents, siblings in the order
    `Columns.subtree_postorder` gives them; marks them doomed."""
    c = index._c
    first_child, next_sibling = c.first_child, c.next_sibling
    order: list[int] = []
    stack = [root]
    while stack:
        r = stack.pop()
        order.append(r)
        child = int(first_child[r])
        while child != NO_ROW:
            if not doomed[child]:
                stack.append(child)
            child = int(next_sibling[child])
    order.reverse()
    doomed[order] = True
    return order


def drop_subtrees(index: RadixIndex, roots: list[int], reason: str) -> list[DroppedBlock]:
    """Drop each alive row of `roots` (in order) with its descendants; see the module docstring."""
    c = index._c
    doomed = np.zeros(c._next_row, dtype=np.bool_)
    tops: list[int] = []  # roots still alive when their turn comes (not below an earlier root)
    order: list[int] = []
    for root in roots:
        if c.alive[root] and not doomed[root]:
            tops.append(root)
            order.extend(_postorder(index, root, doomed))
    if not order:
        return []
    rows = np.array(order, dtype=np.int64)
    slots = c.ns_slot[rows].tolist()
    ns_ids, hashes = index._ns_ids, c.hashes_of(rows)
    reps = c.rep_node[rows].tolist()  # -1: no replica left (the orphans themselves)
    dropped: list[DroppedBlock] = []
    for row, slot, rep, block_hash in zip(order, slots, reps, hashes, strict=True):
        dropped.append(DroppedBlock(ns_ids[slot], block_hash, c.replicas(row) if rep >= 0 else (), reason))
    index._table.delete_many(rows)
    _release_space(index, rows)
    for slot, n in zip(*np.unique(c.ns_slot[rows], return_counts=True), strict=True):
        index._ns_count[int(slot)] -= int(n)
        if index._ns_valid[int(slot)]:
            index._group_add(int(slot), -int(n))
    c.free_many(rows)
    for top in tops:  # as each subtree's last drop did: its parent may become an evictable leaf
        parent = int(c.parent[top])
        c.unlink_child(top)
        if parent != NO_ROW and c.alive[parent]:
            index._push(parent)
    return dropped


def _release_space(index: RadixIndex, rows: np.ndarray) -> None:
    """Take the replicas of `rows` off their nodes' slot and byte counts."""
    c, space = index._c, index._space
    first = rows[c.rep_node[rows] >= 0]
    nodes, inverse = np.unique(c.rep_node[first], return_inverse=True)
    sizes = np.bincount(inverse, weights=c.size_bytes[first], minlength=len(nodes))
    counts = np.bincount(inverse, minlength=len(nodes))
    for k, n, nbytes in zip(nodes.tolist(), counts.tolist(), sizes.tolist(), strict=True):
        space.remove_many(c.node_ids[k], n, int(nbytes))
    for row in rows[c.has_extra[rows]].tolist():
        for loc in c.extra[row]:
            space.remove(loc.node_id, int(c.size_bytes[row]))


def remove_node(index: RadixIndex, node_id: str) -> list[DroppedBlock]:
    """See `RadixIndex.remove_node`."""
    c, space = index._c, index._space
    if not space.has(node_id):
        return []
    k = c.node_index(node_id)
    first_here = c.rep_node[: c._next_row] == k
    single = np.flatnonzero(first_here & ~c.has_extra[: c._next_row])
    c.rep_node[single] = -1  # their only replica was there: orphans
    orphans = [single]
    multi = [r for r, locs in c.extra.items() if first_here[r] or any(x.node_id == node_id for x in locs)]
    for row in multi:  # replica_num > 1: keep the others, in order
        c.set_replicas(row, tuple(x for x in c.replicas(row) if x.node_id != node_id))
        if not c.locations[row]:
            orphans.append(np.array([row], dtype=np.int64))
    space.forget(node_id)  # (its slots and bytes: every replica counted there is gone)
    return drop_subtrees(index, np.sort(np.concatenate(orphans)).tolist(), "orphan")
