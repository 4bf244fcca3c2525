"""Struct-of-arrays storage for the radix index: one row per resident block.

Numeric per-block fields live in numpy columns indexed by row (vectorised updates on the match path);
the block hash lives in a fixed-width column (`h64`: two little-endian uint64 halves per row; `hash_of`
builds the `bytes` on demand), so no Python object is kept per block. Tree links are first-child /
next-sibling / prev-sibling rows, so a child is unlinked in O(1) and descendants are walked without a
children dict per node. Freed rows are reused; `gen[row]` is bumped on every free so stale references
(leases, heap entries, reclamation work) can tell.

Per row (one 104-byte record: 101 bytes of fields, aligned, plus 16 bytes of hash): parent, first_child, next_sibling,
prev_sibling, num_children, lock_ref, num_leases, ns_slot, run_head (int32: rows and counts stay below
2**31), gen (uint32), hit_count (uint32, saturating: a match never wraps it), last_access_ms (int64),
decayed (float64: hits accumulated as sum of 2**((t - epoch)/half_life), whose exponent reaches 512),
size_bytes (uint32: a block's bytes; `validate` refuses 4 GiB and more), recompute_cost_s (float32),
heap_seq (uint32: the tag of the row's current eviction-heap entry, `seq_tag(seq)`, 0 for none),
stale_key (bool: accessed since that entry was pushed; re-keyed when popped), run_head (the first row of
the run of consecutive rows ending at this one in which each row is the next one's parent; rows leave
only as leaves, so a run stays intact while its last row lives; see `matching.py`), checksum (uint64:
the master's checksum of the block's bytes) and target_replicas (uint8: the replicas the master keeps;
0 while never set).

Replicas are columns too (their methods in `replica_cols.py`): the first replica of a row is (rep_node: index into `node_ids`, int32, -1 for
none; rep_slot: uint32 (a store has at most 2**32 slots, the registry refuses more); rep_gen: uint64
(stores start slot generations high); rep_local: bool); a
row with more replicas has `has_extra` set and the others, in order, as `Location`s in the `extra` dict
(rare: replica_num > 1). No `Location` object is kept per block; `replicas(row)` (or `locations[row]`)
builds the tuple on demand.

Growth: the record and hash arrays are allocated once for `capacity` rows with `np.zeros`, whose pages
the OS commits only when first written, so rows never used cost no memory and reaching a larger
resident count copies nothing (doubling would hold the old and the new array at once: 1.5x the
record bytes at the step). Rows are handed out from the bottom (freed rows first), so the touched part
is `[0, high_water)`. Past `capacity` the arrays are reallocated at twice the size (a copy: the caller
sizes `capacity`, the master from its memory budget, so this is a fallback).
"""

from __future__ import annotations

import os

import numpy as np

from kvpool.index.replica_cols import ReplicaColumnsMixin
from kvpool.types import BlockHash, Location

NO_ROW = -1
"""Parent of a block that hangs from its namespace root; also 'no child' / 'no sibling'."""

NO_SEQ = 0
"""`heap_seq` of a row without a heap entry."""
_TAG_MOD = (1 << 32) - 1


def seq_tag(seq: int) -> int:
    """The uint32 tag `heap_seq` stores for heap sequence number `seq` (never `NO_SEQ`). Tags repeat
    only after 2**32 - 1 pushes; the heap is rebuilt (stale entries dropped) every ~2x live rows pushes,
    so a stale entry never meets its row's tag again."""
    return seq % _TAG_MOD + 1


_COLUMNS: dict[str, type] = {
    # 8-byte fields first, then 4-byte, then 1-byte (aligned at every offset in a 104-byte record)
    "last_access_ms": np.int64,
    "decayed": np.float64,
    "checksum": np.uint64,
    "rep_gen": np.uint64,
    "parent": np.int32,
    "num_children": np.int32,
    "rep_node": np.int32,
    "ns_slot": np.int32,
    "hit_count": np.uint32,
    "rep_slot": np.uint32,
    "gen": np.uint32,
    "first_child": np.int32,
    "next_sibling": np.int32,
    "prev_sibling": np.int32,
    "lock_ref": np.int32,
    "num_leases": np.int32,
    "size_bytes": np.uint32,
    "recompute_cost_s": np.float32,
    "heap_seq": np.uint32,
    "run_head": np.int32,
    "rep_local": np.bool_,
    "has_extra": np.bool_,
    "stale_key": np.bool_,
    "alive": np.bool_,
    "target_replicas": np.uint8,
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
    "heap_seq": NO_SEQ,
    "stale_key": False,
    "has_extra": False,
    "checksum": 0,
    "target_replicas": 0,
}
"""Fields a freshly allocated row starts with (`gen` is kept from its previous life; the rest is set
by the inserter)."""
_ROW = np.dtype({"names": list(_COLUMNS), "formats": list(_COLUMNS.values()), "itemsize": 104})
"""One record per row (row-major), so a match touches two cache lines per block, not one per column;
each column is a strided view of its field. The 101 bytes of fields are padded to 104, a multiple of
8, so every field of every row is aligned: numpy's strided loops over unaligned fields took the
match path's column updates from ~7 to ~12.5 us per 64-block match."""
_RAW = np.dtype((np.void, _ROW.itemsize))
"""The same records as opaque bytes: numpy gathers these ~10x faster than structured records."""
HIT_COUNT_MAX = np.iinfo(np.uint32).max
DEFAULT_CAPACITY = 1 << 20
"""Rows reserved (not committed) when the index is not told its maximum."""
PAGE_BYTES = 4096
MAX_RESERVED_ROWS = 1 << 30
"""The most rows `rows_for_bytes` reserves (rows are int32 in the hash table and the links)."""


def rows_for_bytes(limit_bytes: int) -> int:
    """Rows to reserve for an index limited to `limit_bytes` of its own accounting (at least
    `DEFAULT_CAPACITY`): the arrays are reserved, not committed (pages are touched as rows are handed
    out), so an index that stays within its limit never grows its arrays (an O(rows) copy)."""
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2  # (one reservation under RAM)
    rows = min(int(limit_bytes), host) // (_ROW.itemsize + 16)
    return max(DEFAULT_CAPACITY, min(rows, MAX_RESERVED_ROWS))


class _LocationsView:
    """`columns.locations[row]`: the row's replicas as a tuple of `Location` (built on demand)."""

    __slots__ = ("_c",)

    def __init__(self, columns: Columns) -> None:
        self._c = columns

    def __getitem__(self, row: int) -> tuple[Location, ...]:
        return self._c.replicas(row)


class Columns(ReplicaColumnsMixin):
    """Row storage with a free list. `alive[row]` tells whether a row holds a block."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = 0
        self.records = np.zeros(0, _ROW)
        """All columns, one record per row; each column attribute is a view of one field."""
        self.h64 = np.zeros((0, 2), np.uint64)
        """Block hashes: row i is the 16 bytes of its hash as two little-endian uint64."""
        self.extra: dict[int, tuple[Location, ...]] = {}
        self.node_ids: list[str] = []
        """Store node ids by index (append-only: an index stays valid for the life of the index)."""
        self._node_index: dict[str, int] = {}
        self.locations = _LocationsView(self)
        self._free = np.empty(0, np.int32)
        """Freed rows, a stack (last freed on top): `_free[:_num_free]`."""
        self._num_free = 0
        self._next_row = 0
        self.num_alive = 0
        self.num_protected = 0
        """Alive rows with `lock_ref > 0` or `num_leases > 0`, kept on every change of either (and on
        `free`), so counting protected blocks is O(1): change those two columns only through `pin`."""
        self.on_grow: list[object] = []
        """Callbacks run after the arrays were reallocated (the hash table rebinds its views)."""
        self._grow(max(1, capacity))

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
    checksum: np.ndarray
    target_replicas: np.ndarray

    def _grow(self, capacity: int) -> None:
        old = self._next_row
        grown = np.zeros(capacity, _ROW)
        grown[:old] = self.records[:old]
        h64 = np.zeros((capacity, 2), np.uint64)
        h64[:old] = self.h64[:old]
        self.records, self.h64 = grown, h64
        self._raw = grown.view(_RAW)
        for name in _COLUMNS:
            setattr(self, name, grown[name])
        self.capacity = capacity
        for callback in self.on_grow:
            callback()  # type: ignore[operator]

    @property
    def high_water(self) -> int:
        """Rows ever handed out: the touched prefix of the arrays."""
        return self._next_row

    def memory_bytes(self) -> int:
        """Committed bytes of the row arrays (the touched prefix, whole pages) and the free list."""
        touched = self._next_row * (_ROW.itemsize + 16)
        pages = -(-touched // PAGE_BYTES) * PAGE_BYTES
        return pages + int(self._free.nbytes)

    def hash_of(self, row: int) -> BlockHash:
        """The row's block hash as `bytes` (built on demand)."""
        return BlockHash(self.h64[row].tobytes())

    def hashes_of(self, rows: np.ndarray | list[int]) -> list[BlockHash]:
        """The block hashes of `rows`, in order, as `bytes`."""
        raw = self.h64[rows].tobytes()
        return [BlockHash(raw[i : i + 16]) for i in range(0, len(raw), 16)]

    def gather(self, rows: np.ndarray | slice) -> np.ndarray:
        """A copy of the records of `rows` (an index array or a slice; structured: index it by column
        name). Copied as opaque bytes: a structured copy goes field by field (~10x slower)."""
        raw = self._raw[rows]
        if isinstance(rows, slice):
            raw = raw.copy()
        return np.ndarray(len(raw), _ROW, raw)  # (cheaper than .view)

    # ---- rows -------------------------------------------------------------------------------------
    def alloc_rows(self, n: int) -> np.ndarray:
        """`n` fresh rows ((n,) int64: free ones first, last freed first, in reverse, then new ones from
        the high-water mark), reset as `_RESET` says and marked alive; the caller links them."""
        take = min(n, self._num_free)
        fresh = n - take
        if self._next_row + fresh > self.capacity:
            capacity = self.capacity
            while self._next_row + fresh > capacity:
                capacity *= 2
            self._grow(capacity)
        reused = self._free[self._num_free - take : self._num_free][::-1].astype(np.int64)
        self._num_free -= take
        rows = np.concatenate([reused, np.arange(self._next_row, self._next_row + fresh, dtype=np.int64)])
        self._next_row += fresh
        rec = self.records
        if len(rows) and rows[-1] - rows[0] == n - 1 and (n == 1 or bool((np.diff(rows) == 1).all())):
            rows_sel: slice | np.ndarray = slice(int(rows[0]), int(rows[0]) + n)
        else:
            rows_sel = rows
        for name, value in _RESET.items():
            rec[name][rows_sel] = value
        rec["alive"][rows_sel] = True
        self.num_alive += n
        return rows

    def alloc_chain(self, parent: int, n: int) -> np.ndarray:
        """`n` fresh rows (free ones first), reset as by `alloc_rows` and linked as a chain below
        `parent` (NO_ROW: the namespace root), each the only child of the one before. Free rows are taken
        last freed first, in reverse, so a chain evicted leaf by leaf comes back as one run (`run_head`).
        O(n) vectorised work."""
        rows = self.alloc_rows(n)
        self.link_child(parent, int(rows[0]))
        if n > 1:
            above, below = rows[:-1], rows[1:]
            self.parent[below] = above
            self.first_child[above] = below
            self.num_children[above] = 1
            self.set_run_heads(rows)
        return rows

    def set_run_heads(self, rows: np.ndarray) -> None:
        """Set `run_head` of the new `rows` ((n,) int64, distinct) from their `parent` links and the run
        heads of older rows: a row continues its parent's run when the parent is the row just before it.
        Vectorised: a parent among `rows` is followed by pointer jumping (O(n log depth))."""
        parents = self.parent[rows].astype(np.int64)
        cont = (parents == rows - 1) & (parents != NO_ROW)
        order = np.argsort(rows)
        sorted_rows = rows[order]
        at = np.searchsorted(sorted_rows, parents)
        at_c = np.minimum(at, len(rows) - 1)
        inside = cont & (sorted_rows[at_c] == parents)
        ptr = np.where(inside, order[at_c], -1)
        heads = rows.copy()
        outer = cont & ~inside  # continues the run of an older row: that row's head
        heads[outer] = self.run_head[parents[outer]]
        while True:
            follow = np.flatnonzero(ptr >= 0)
            if not follow.size:
                break
            nxt = ptr[follow]
            heads[follow] = heads[nxt]
            ptr[follow] = ptr[nxt]
        self.run_head[rows] = heads

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

    def _push_free(self, rows: np.ndarray) -> None:
        end = self._num_free + len(rows)
        if end > len(self._free):
            grown = np.empty(max(1024, 2 * end), np.int32)
            grown[: self._num_free] = self._free[: self._num_free]
            self._free = grown
        self._free[self._num_free : end] = rows
        self._num_free = end

    def free(self, row: int) -> None:
        """Free one row (its hash-table entry is the caller's)."""
        if self.lock_ref[row] > 0 or self.num_leases[row] > 0:
            self.num_protected -= 1
        self.alive[row] = False
        self.gen[row] += 1
        self.rep_node[row] = -1
        if self.has_extra[row]:
            self.has_extra[row] = False
            del self.extra[row]
        self.heap_seq[row] = NO_SEQ
        self._push_free(np.array([row], dtype=np.int32))
        self.num_alive -= 1

    def free_many(self, rows: np.ndarray) -> None:
        """`free` of each of the distinct `rows` in order (table entries left to the caller), vectorised."""
        self.num_protected -= int(np.count_nonzero((self.lock_ref[rows] > 0) | (self.num_leases[rows] > 0)))
        self.alive[rows] = False
        self.gen[rows] += 1
        for row in rows[self.has_extra[rows]].tolist():
            del self.extra[row]
        self.has_extra[rows] = False
        self.rep_node[rows] = -1
        self.heap_seq[rows] = NO_SEQ
        self._push_free(rows)
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
