"""Dropping many rows of `RadixIndex` at once, in columns (a dead node's orphans: `node_removal.py`).

`drop_rows(index, rows, reason)` takes a set of alive rows closed under descendants (every alive child of
a row in the set is in the set) and removes them from every structure with vectorised passes: the hash
table, the per-node and per-namespace counts, the row free list. A row of the set whose parent stays is
unlinked from it (Python work per such row; its parent may become an evictable leaf and is pushed), unless
the parent is itself doomed (`doomed_parents`) and loses all its children here: then its child list is
cleared in one pass and it gets no heap entry (it is dropped by a later step). What left comes back as a
`DroppedRows` (columns), never one Python object per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvpool.index.columns import NO_ROW
from kvpool.index.results import DroppedBlock, DroppedRows

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex


def drop_rows(
    index: RadixIndex,
    rows: np.ndarray,
    reason: str,
    *,
    doomed_parents: Callable[[np.ndarray], np.ndarray] | None = None,
) -> DroppedRows:
    """Drop `rows` ((n,) int64, distinct, alive, closed under descendants); see the module docstring."""
    c = index._c
    rows = np.asarray(rows, np.int64)
    rec = c.gather(rows)
    extra = {i: c.extra[r] for i, r in enumerate(rows.tolist()) if rec["has_extra"][i]} if c.extra else {}
    out = DroppedRows(
        ns_ids=tuple(index._ns_ids),
        ns_slot=rec["ns_slot"].copy(),
        hashes=c.h64[rows].copy(),
        node_ids=c.node_ids,
        rep_node=rec["rep_node"].copy(),
        rep_slot=rec["rep_slot"].astype(np.int64),
        rep_gen=rec["rep_gen"].copy(),
        rep_local=rec["rep_local"].copy(),
        extra=extra,
        reason=reason,
    )
    index._table.delete_many(rows)
    _release_space(index, rows)
    for slot, n in zip(*np.unique(rec["ns_slot"], return_counts=True), strict=True):
        index._ns_count[int(slot)] -= int(n)
        if index._ns_valid[int(slot)]:
            index._group_add(int(slot), -int(n))
    parents = rec["parent"].astype(np.int64)
    dropping = np.zeros(len(rows), np.bool_)
    outer = parents != NO_ROW
    if outer.any():  # parents outside the set
        sorted_rows = np.sort(rows)
        at = np.minimum(np.searchsorted(sorted_rows, parents[outer]), len(rows) - 1)
        dropping[outer] = sorted_rows[at] == parents[outer]
    outer &= ~dropping
    tops = rows[outer]
    top_parents = parents[outer]
    if doomed_parents is not None and tops.size:
        doomed = doomed_parents(top_parents)
        cleared = np.unique(top_parents[doomed])
        c.first_child[cleared] = NO_ROW
        c.num_children[cleared] = 0
        tops = tops[~doomed]
    c.free_many(rows)
    for top in tops.tolist():
        parent = int(c.parent[top])
        c.unlink_child(top)
        if c.alive[parent]:
            index._push(parent)
    return out


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
    """See `RadixIndex.remove_node`: every step of a node removal at once."""
    removal = index.begin_remove_node(node_id)
    if removal is None:
        return []
    dropped: list[DroppedBlock] = []
    while not removal.done:  # (earlier removals first, one at a time: their drops are returned too)
        rows, _ = index.remove_node_step()
        if rows is not None:  # (a dying node's replicas are gone with it: no slot to free there)
            gone = set(index.node_removals_ids()) | {node_id}
            dropped.extend(
                DroppedBlock(
                    d.ns, d.block_hash, tuple(x for x in d.locations if x.node_id not in gone), d.reason
                )
                for d in rows.blocks()
            )
    return dropped
