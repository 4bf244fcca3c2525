"""Struct-of-arrays storage for the radix index: one row per resident block.

Numeric per-block fields live in numpy columns indexed by row (vectorised updates on the match path);
the block hash and its replica tuple live in Python lists (returned as-is, no copies). Tree links are
first-child / next-sibling / prev-sibling rows, so a child is unlinked in O(1) and descendants are
walked without a children dict per node. Freed rows are reused; `gen[row]` is bumped on every free so
stale references (leases, heap entries, reclamation work) can tell.

Per row: parent, first_child, next_sibling, prev_sibling (int32), num_children, lock_ref, num_leases,
ns_slot (int32), gen (uint32), hit_count (int64), last_access_ms (int64), decayed (float64: hits
accumulated as sum of 2**((t - epoch)/half_life)), size_bytes (int64), recompute_cost_s (float32),
heap_seq (int64: the sequence number of the row's current eviction-heap entry, -1 for none),
stale_key (bool: accessed since that entry was pushed; re-keyed when popped), run_head (int32: the first
row of the run of consecutive rows ending at this one in which each row is the next one's parent; rows
leave only as leaves, so a run stays intact while its last row lives; see `matching.py`).

Replicas are columns too: the first replica of a row is (rep_node: index into `node_ids`, int32, -1 for
none; rep_slot, rep_gen: int64; rep_local: bool); a row with more replicas has `has_extra` set and the
others, in order, as `Location`s in the `extra` dict (rare: replica_num > 1). No `Location` object is kept
per block; `replicas(row)` (or `locations[row]`) builds the tuple on demand.
"""

from __future__ import annotations

import numpy as np

from kvpool.types import BlockHash, Location

NO_ROW = -1
"""Parent of a block that hangs from its namespace root; also 'no child' / 'no sibling'."""

_COLUMNS: dict[str, type] = {
    # hot: read or written by every match (together in the first 64 bytes of a row's record)
    "parent": np.int32,
    "num_children": np.int32,
    "rep_node": np.int32,
    "ns_slot": np.int32,
    "hit_count": np.int64,
    "last_access_ms": np.int64,
    "decayed": np.float64,
    "rep_slot": np.int64,
    "rep_gen": np.int64,
    "rep_local": np.bool_,
    "has_extra": np.bool_,
    "stale_key": np.bool_,
    "alive": np.bool_,
    "gen": np.uint32,
    # cold: tree edits, eviction, leases and locks
    "first_child": np.int32,
    "next_sibling": np.int32,
    "prev_sibling": np.int32,
    "lock_ref": np.int32,
    "num_leases": np.int32,
    "size_bytes": np.int64,
    "recompute_cost_s": np.float32,
    "heap_seq": np.int64,
    "run_head": np.int32,
}
_RESET: dict[str, object] = {
    "parent": NO_ROW,
    "first_child": NO_ROW,
    "next_sibling": NO_ROW,
    "prev_sibling": NO_ROW,
    "hit_count": 0,
    "num_children": 0,
    "lock_ref": 0,
    "num_leases": 0,
    "decayed": 0.0,
    "heap_seq": -1,
    "stale_key": False,
}
"""Fields a freshly allocated row starts with (`gen` is kept from its previous life; the rest is set
by the inserter)."""
_ROW = np.dtype({"names": list(_COLUMNS), "formats": list(_COLUMNS.values()), "itemsize": 128})
"""One record per row (row-major), so a match touches one cache line per block, not one per column;
each column is a strided view of its field."""
_RAW = np.dtype((np.void, _ROW.itemsize))
"""The same records as opaque bytes: numpy gathers these ~10x faster than structured records."""


class _LocationsView:
    """`columns.locations[row]`: the row's replicas as a tuple of `Location` (built on demand)."""

    __slots__ = ("_c",)

    def __init__(self, columns: Columns) -> None:
        self._c = columns

    def __getitem__(self, row: int) -> tuple[Location, ...]:
        return self._c.replicas(row)


class Columns:
    """Row storage with a free list. `alive[row]` tells whether a row holds a block."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = 0
        self.records = np.zeros(0, _ROW)
        """All columns, one record per row; each column attribute is a view of one field."""
        self.hashes: list[BlockHash | None] = []
        self.extra: dict[int, tuple[Location, ...]] = {}
        self.node_ids: list[str] = []
        """Store node ids by index (append-only: an index stays valid for the life of the index)."""
        self._node_index: dict[str, int] = {}
        self.locations = _LocationsView(self)
        self._free: list[int] = []
        self._next_row = 0
        self.num_alive = 0
        self.num_protected = 0
        """Alive rows with `lock_ref > 0` or `num_leases > 0`, kept on every change of either (and on
        `free`), so counting protected blocks is O(1): change those two columns only through `pin`."""
        self._grow(capacity)

    # numpy columns (set in __init__ from _COLUMNS; declared for type checkers)
    parent: np.ndarray
    first_child: np.ndarray
    next_sibling: np.ndarray
    prev_sibling: np.ndarray
    hit_count: np.ndarray
    last_access_ms: np.ndarray
    num_children: np.ndarray
    lock_ref: np.ndarray
    num_leases: np.ndarray
    ns_slot: np.ndarray
    gen: np.ndarray
    decayed: np.ndarray
    size_bytes: np.ndarray
    recompute_cost_s: np.ndarray
    heap_seq: np.ndarray
    run_head: np.ndarray
    alive: np.ndarray
    stale_key: np.ndarray
    rep_node: np.ndarray
    rep_slot: np.ndarray
    rep_gen: np.ndarray
    rep_local: np.ndarray
    has_extra: np.ndarray

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        grown = np.zeros(capacity, _ROW)
        grown[:old] = self.records
        self.records = grown
        self._raw = grown.view(_RAW)
        for name in _COLUMNS:
            setattr(self, name, grown[name])
        self.rep_node[old:] = -1
        self.hashes.extend([None] * (capacity - old))
        self.capacity = capacity

    def gather(self, rows: np.ndarray | slice) -> np.ndarray:
        """A copy of the records of `rows` (an index array or a slice; structured: index it by column
        name). Copied as opaque bytes: a structured copy goes field by field (~10x slower)."""
        raw = self._raw[rows]
        if isinstance(rows, slice):
            raw = raw.copy()
        return np.ndarray(len(raw), _ROW, raw)  # (cheaper than .view)

    # ---- replicas ---------------------------------------------------------------------------------
    def node_index(self, node_id: str) -> int:
        k = self._node_index.get(node_id)
        if k is None:
            k = self._node_index[node_id] = len(self.node_ids)
            self.node_ids.append(node_id)
        return k

    def replicas(self, row: int) -> tuple[Location, ...]:
        k = int(self.rep_node[row])
        if k < 0:
            return ()
        first = Location(
            self.node_ids[k], int(self.rep_slot[row]), int(self.rep_gen[row]), bool(self.rep_local[row])
        )
        return (first, *self.extra[row]) if self.has_extra[row] else (first,)

    def add_replica(self, row: int, loc: Location) -> bool:
        """Append `loc` to the row's replicas; False (nothing changes) when it is already there."""
        current = self.replicas(row)
        if loc in current:
            return False
        if not current:
            self.rep_node[row] = self.node_index(loc.node_id)
            self.rep_slot[row] = loc.slot
            self.rep_gen[row] = loc.generation
            self.rep_local[row] = loc.local
        else:
            self.extra[row] = (*current[1:], loc)
            self.has_extra[row] = True
        return True

    def set_replicas(self, row: int, locs: tuple[Location, ...]) -> None:
        self.extra.pop(row, None)
        self.has_extra[row] = len(locs) > 1
        if not locs:
            self.rep_node[row] = -1
            return
        first = locs[0]
        self.rep_node[row] = self.node_index(first.node_id)
        self.rep_slot[row] = first.slot
        self.rep_gen[row] = first.generation
        self.rep_local[row] = first.local
        if len(locs) > 1:
            self.extra[row] = locs[1:]

    def rows_with_node(self, node_id: str) -> set[int]:
        """Rows with at least one replica on `node_id` (a scan: for node failures and accounting)."""
        k = self._node_index.get(node_id)
        rows: set[int] = set()
        if k is not None:
            rows.update(np.flatnonzero(self.rep_node[: self._next_row] == k).tolist())
        rows.update(r for r, locs in self.extra.items() if any(x.node_id == node_id for x in locs))
        return rows

    # ---- rows -------------------------------------------------------------------------------------
    def alloc_chain(self, parent: int, n: int) -> np.ndarray:
        """`n` fresh rows (free ones first), reset as by `alloc` and linked as a chain below `parent`
        (NO_ROW: the namespace root), each the only child of the one before. Free rows are taken last
        freed first, in reverse, so a chain evicted leaf by leaf comes back as one run (`run_head`).
        O(n) vectorised work."""
        take = min(n, len(self._free))
        fresh = n - take
        while self._next_row + fresh > self.capacity:
            self._grow(self.capacity * 2)
        reused = self._free[len(self._free) - take :][::-1]
        del self._free[len(self._free) - take :]
        rows = np.array(reused + list(range(self._next_row, self._next_row + fresh)), dtype=np.int64)
        self._next_row += fresh
        for name, value in _RESET.items():
            getattr(self, name)[rows] = value
        self.alive[rows] = True
        self.num_alive += n
        self.link_child(parent, int(rows[0]))
        if n > 1:
            above, below = rows[:-1], rows[1:]
            self.parent[below] = above
            self.first_child[above] = below
            self.num_children[above] = 1
            starts = np.flatnonzero(below != above + 1) + 1  # positions where a new run begins
            pos = np.zeros(n, dtype=np.int64)
            pos[starts] = starts
            heads = rows[np.maximum.accumulate(pos)]
            heads[heads == rows[0]] = self.run_head[rows[0]]
            self.run_head[rows] = heads
        return rows

    def pin(self, rows: np.ndarray, *, locks: int = 0, leases: int = 0) -> None:
        """Add `locks` to `lock_ref` and `leases` to `num_leases` of the distinct alive `rows`,
        keeping `num_protected`. O(len(rows)) vectorised."""
        before = np.count_nonzero((self.lock_ref[rows] > 0) | (self.num_leases[rows] > 0))
        if locks:
            self.lock_ref[rows] += locks
        if leases:
            self.num_leases[rows] += leases
        after = np.count_nonzero((self.lock_ref[rows] > 0) | (self.num_leases[rows] > 0))
        self.num_protected += int(after) - int(before)

    def free(self, row: int) -> None:
        if self.lock_ref[row] > 0 or self.num_leases[row] > 0:
            self.num_protected -= 1
        self.alive[row] = False
        self.gen[row] += 1
        self.hashes[row] = None
        self.rep_node[row] = -1
        if self.has_extra[row]:
            self.has_extra[row] = False
            del self.extra[row]
        self.heap_seq[row] = -1
        self._free.append(row)
        self.num_alive -= 1

    def free_many(self, rows: np.ndarray) -> None:
        """`free` of each of the distinct `rows` in order (hashes left to the caller), vectorised."""
        self.num_protected -= int(np.count_nonzero((self.lock_ref[rows] > 0) | (self.num_leases[rows] > 0)))
        self.alive[rows] = False
        self.gen[rows] += 1
        for row in rows[self.has_extra[rows]].tolist():
            del self.extra[row]
        self.has_extra[rows] = False
        self.rep_node[rows] = -1
        self.heap_seq[rows] = -1
        self._free.extend(rows.tolist())
        self.num_alive -= len(rows)

    def link_child(self, parent: int, child: int) -> None:
        """Make `child` the first child of `parent` (`parent` may be NO_ROW: nothing to link). Sets
        `child`'s run head: its parent's when that is the row just before it, else itself."""
        self.parent[child] = parent
        if parent == NO_ROW:
            self.run_head[child] = child
            return
        self.run_head[child] = self.run_head[parent] if parent == child - 1 else child
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
