"""Struct-of-arrays storage for the radix index: one row per resident block.

Numeric per-block fields live in numpy columns indexed by row (vectorised updates on the match path);
the block hash and its replica tuple live in Python lists (returned as-is, no copies). Tree links are
first-child / next-sibling / prev-sibling rows, so a child is unlinked in O(1) and descendants are
walked without a children dict per node. Freed rows are reused; `gen[row]` is bumped on every free so
stale references (leases, heap entries, reclamation work) can tell.

Per row: parent, first_child, next_sibling, prev_sibling (int64), num_children, lock_ref, num_leases,
ns_slot (int32), gen (uint32), hit_count (int64), last_access_ms (int64), decayed (float64: hits
accumulated as sum of 2**((t - epoch)/half_life)), size_bytes (int64), recompute_cost_s (float32),
heap_seq (int64: the sequence number of the row's current eviction-heap entry, -1 for none),
stale_key (bool: accessed since that entry was pushed; re-keyed when popped).
"""

from __future__ import annotations

import numpy as np

from kvpool.types import BlockHash, Location

NO_ROW = -1
"""Parent of a block that hangs from its namespace root; also 'no child' / 'no sibling'."""

_INT_COLUMNS = ("parent", "first_child", "next_sibling", "prev_sibling", "hit_count", "last_access_ms")
_I32_COLUMNS = ("num_children", "lock_ref", "num_leases", "ns_slot")


class Columns:
    """Row storage with a free list. `alive[row]` tells whether a row holds a block."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = 0
        self.parent = np.empty(0, np.int64)
        self.first_child = np.empty(0, np.int64)
        self.next_sibling = np.empty(0, np.int64)
        self.prev_sibling = np.empty(0, np.int64)
        self.hit_count = np.empty(0, np.int64)
        self.last_access_ms = np.empty(0, np.int64)
        self.num_children = np.empty(0, np.int32)
        self.lock_ref = np.empty(0, np.int32)
        self.num_leases = np.empty(0, np.int32)
        self.ns_slot = np.empty(0, np.int32)
        self.gen = np.empty(0, np.uint32)
        self.decayed = np.empty(0, np.float64)
        self.size_bytes = np.empty(0, np.int64)
        self.recompute_cost_s = np.empty(0, np.float32)
        self.heap_seq = np.empty(0, np.int64)
        self.alive = np.empty(0, np.bool_)
        self.stale_key = np.empty(0, np.bool_)
        self.hashes: list[BlockHash | None] = []
        self.locations: list[tuple[Location, ...]] = []
        self._free: list[int] = []
        self._next_row = 0
        self.num_alive = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name in (
            *_INT_COLUMNS,
            *_I32_COLUMNS,
            "gen",
            "decayed",
            "size_bytes",
            "recompute_cost_s",
            "heap_seq",
            "alive",
            "stale_key",
        ):
            column = getattr(self, name)
            grown = np.zeros(capacity, column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        self.hashes.extend([None] * (capacity - old))
        self.locations.extend([()] * (capacity - old))
        self.capacity = capacity

    def alloc(self) -> int:
        """A fresh row, with every field reset; its `gen` is kept from its previous life."""
        if self._free:
            row = self._free.pop()
        else:
            if self._next_row == self.capacity:
                self._grow(self.capacity * 2)
            row = self._next_row
            self._next_row += 1
        self.parent[row] = NO_ROW
        self.first_child[row] = NO_ROW
        self.next_sibling[row] = NO_ROW
        self.prev_sibling[row] = NO_ROW
        self.hit_count[row] = 0
        self.num_children[row] = 0
        self.lock_ref[row] = 0
        self.num_leases[row] = 0
        self.decayed[row] = 0.0
        self.heap_seq[row] = -1
        self.stale_key[row] = False
        self.alive[row] = True
        self.num_alive += 1
        return row

    def free(self, row: int) -> None:
        self.alive[row] = False
        self.gen[row] += 1
        self.hashes[row] = None
        self.locations[row] = ()
        self.heap_seq[row] = -1
        self._free.append(row)
        self.num_alive -= 1

    def link_child(self, parent: int, child: int) -> None:
        """Make `child` the first child of `parent` (`parent` may be NO_ROW: nothing to link)."""
        self.parent[child] = parent
        if parent == NO_ROW:
            return
        head = int(self.first_child[parent])
        self.next_sibling[child] = head
        self.prev_sibling[child] = NO_ROW
        if head != NO_ROW:
            self.prev_sibling[head] = child
        self.first_child[parent] = child
        self.num_children[parent] += 1

    def unlink_child(self, child: int) -> None:
        parent = int(self.parent[child])
        if parent == NO_ROW:
            return
        prev, nxt = int(self.prev_sibling[child]), int(self.next_sibling[child])
        if prev == NO_ROW:
            self.first_child[parent] = nxt
        else:
            self.next_sibling[prev] = nxt
        if nxt != NO_ROW:
            self.prev_sibling[nxt] = prev
        self.num_children[parent] -= 1

    def children(self, row: int) -> list[int]:
        out: list[int] = []
        child = int(self.first_child[row])
        while child != NO_ROW:
            out.append(child)
            child = int(self.next_sibling[child])
        return out

    def subtree_postorder(self, row: int) -> list[int]:
        """`row` and all its descendants, children before parents (safe order to drop)."""
        order: list[int] = []
        stack = [row]
        while stack:
            r = stack.pop()
            order.append(r)
            stack.extend(self.children(r))
        order.reverse()
        return order

    def alive_rows(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self._next_row])
