"""The radix index's one hash table: (namespace slot, block hash) -> row, open addressing in numpy.

Layout: `table` is an int32 array of power-of-two length `capacity`; an entry holds a row of the
index's columns, `EMPTY` (-1, never used) or `TOMB` (-2, deleted). The key itself is not stored: an
entry's key is read from the row's hash and `ns_slot` columns (`Columns.h64`, `Columns.ns_slot`), so a
table entry costs 4 bytes. Block hashes are uniformly random 128-bit values, so the home position of a
key XORs the hash's two 64-bit halves and the namespace slot times a 64-bit odd constant (one hash in
two namespaces lands in two places) and takes the top bits of that times another, mod 2**64
(Fibonacci hashing: keys that are not random, tests' small integers, still spread); collisions probe
linearly. Only the low 64 bits of the scalar path's Python ints matter, so it needs no masking but one.

Deletion leaves a tombstone (vectorised: a batch of rows is deleted in one pass per probe round);
inserts reuse tombstones on their probe path. When entries plus tombstones pass `_MAX_LOAD` of the
capacity a clean table takes over, twice as large when the live entries alone pass `_GROW_LOAD`: so the
table's load stays in (0.3, 0.7] once it is larger than the minimum, 4 / load bytes per block (6 to 13 B).

Growth is incremental (no O(entries) pass in one call): the old table stays readable while its entries
move to the new one, `migrate_positions` old positions per step at least (each `insert_many` takes one,
sized so the old table is empty before the inserts left until the next growth run out: about 1.3
positions per entry inserted after a doubling, up to 10 after a clean-up of tombstones at the same
capacity; `step` takes one more, e.g. from a maintenance tick). A step
moves whole probe runs: it ends at an `EMPTY` position of the old table, so every entry left in the old
table sits past the moved prefix, which is `EMPTY`, and its probe path never crosses it (a path never
crosses an `EMPTY` position). Lookups and deletes ask the new table, then the old one while it lasts;
inserts go to the new one. The old table is gone before the new one can need to grow again (if it ever
did, the rest would be moved first).

Lookups: `find(slot, hash)` is a scalar Python probe (the match path's binary search asks one hash at a
time: a memoryview read per probe, no numpy call); `find_many(slots, hashes)` resolves a batch with one
numpy pass per probe round over the keys still unresolved.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
TOMB = -2
_MIX = 0x9E3779B97F4A7C15
"""Odd 64-bit constant (2**64 / golden ratio): spreads namespace slots over the home positions."""
_FIB = 0xBF58476D1CE4E5B9
"""Odd 64-bit multiplier whose top bits pick the home position."""
_M64 = (1 << 64) - 1
_MIN_CAPACITY = 1024
_SCALAR_TAIL = 24
"""`find_many` finishes this many or fewer keys with scalar probes (numpy calls cost more per round)."""
_MAX_LOAD = 0.7
_GROW_LOAD = 0.6
MIGRATE_POSITIONS = 16384
"""Old-table positions moved per migration step by default (about 1 ms of numpy work)."""


def _probe_one(
    tmv: memoryview,
    mask: int,
    shift: int,
    qmv: memoryview,
    nmv: memoryview,
    step: int,
    off: int,
    slot: int,
    x: int,
) -> int:
    """The row of (`slot`, hash int `x`) in the table `tmv`, or -1 (`HashTable.find`'s loop)."""
    pos = (((x ^ (x >> 64) ^ (slot * _MIX)) * _FIB) & _M64) >> shift
    lo, hi = x & _M64, x >> 64
    while True:
        row = tmv[pos]
        if row == EMPTY:
            return -1
        if row >= 0 and qmv[2 * row] == lo and qmv[2 * row + 1] == hi and nmv[row * step + off] == slot:
            return row
        pos = (pos + 1) & mask


class HashTable:
    """Maps (slot, hash) to a row; reads keys through `h64` ((rows, 2) uint64: each hash's two
    little-endian halves) and `ns_slot` ((rows,) int32), the index's columns (rebound by `bind`).
    `migrate_positions`: old-table positions moved per migration step (tests use small ones)."""

    def __init__(
        self,
        h64: np.ndarray,
        ns_slot: np.ndarray,
        capacity: int = _MIN_CAPACITY,
        migrate_positions: int = MIGRATE_POSITIONS,
    ) -> None:
        self._old: np.ndarray | None = None
        """The table being emptied into `table` (None: no migration); positions < `_moved` are moved."""
        self._moved = 0
        self.migrate_positions = migrate_positions
        self.bind(h64, ns_slot)
        self.count = 0
        """Live entries (in both tables while migrating)."""
        self.tombs = 0
        """Tombstones in `table` (the old table's are dropped as it is moved)."""
        self._alloc(max(_MIN_CAPACITY, 1 << (max(1, capacity) - 1).bit_length()))

    def bind(self, h64: np.ndarray, ns_slot: np.ndarray) -> None:
        self._h64 = h64
        self._ns = ns_slot
        self._qmv = h64.data.cast("B").cast("Q")  # hash halves as Python ints (row r: 2r, 2r + 1)
        # the slot column as Python ints too: an int32 view of the buffer it is a strided field of
        base = ns_slot if ns_slot.base is None or ns_slot.strides[0] == 4 else ns_slot.base
        offset = ns_slot.ctypes.data - base.ctypes.data
        assert offset % 4 == 0 and ns_slot.strides[0] % 4 == 0 and base.flags.c_contiguous
        self._nmv = base.data.cast("B").cast("i")
        self._ns_step, self._ns_off = ns_slot.strides[0] // 4, offset // 4
        self._set_probe()

    def _set_probe(self) -> None:
        """The values `find` reads, in one tuple (one attribute load on the match path)."""
        if hasattr(self, "_tmv"):
            self._probe = (
                self.mask,
                self._tmv,
                self._qmv,
                self._nmv,
                self.shift,
                self._ns_step,
                self._ns_off,
            )
            if self._old is None:
                self.__dict__.pop("find", None)  # the class's `find`: the match path's probe, unchanged
            else:
                self.find = self._find_both  # type: ignore[method-assign]

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_qmv", "_tmv", "_nmv", "_probe", "find")}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._tmv = self.table.data
        self.bind(self._h64, self._ns)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.mask = capacity - 1
        self.shift = 64 - (capacity.bit_length() - 1)
        self.table = np.full(capacity, EMPTY, dtype=np.int32)
        self._tmv = self.table.data
        self._set_probe()

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes) + (0 if self._old is None else int(self._old.nbytes))

    @property
    def migrating(self) -> bool:
        """True while an old table is being moved into `table`."""
        return self._old is not None

    def rows(self) -> np.ndarray:
        """Every live row ((count,) int32, in no useful order), from both tables while migrating."""
        live = self.table[self.table >= 0]
        if self._old is not None:
            live = np.concatenate([live, self._old[self._old >= 0]])
        return live

    # ---- positions ---------------------------------------------------------------------------------
    def _homes(self, slots: np.ndarray, keys: np.ndarray, shift: int | None = None) -> np.ndarray:
        """Home positions ((n,) int64) of `keys` ((n, 2) uint64) under `slots` ((n,) ints), in the
        table of `shift` (default: the current one)."""
        x = keys[:, 0] ^ keys[:, 1]
        x ^= slots.astype(np.uint64) * np.uint64(_MIX)
        x *= np.uint64(_FIB)
        return (x >> np.uint64(self.shift if shift is None else shift)).astype(np.int64)

    def _old_params(self) -> tuple[np.ndarray, int, int]:
        old = self._old
        assert old is not None
        return old, len(old) - 1, 64 - (len(old).bit_length() - 1)

    # ---- lookups -----------------------------------------------------------------------------------
    def find(self, slot: int, block_hash: bytes) -> int:
        """The row of (`slot`, `block_hash`) (16 bytes), or -1. Pure Python probing (no numpy call)."""
        mask, tmv, qmv, nmv, shift, step, off = self._probe
        x = int.from_bytes(block_hash, "little")  # (`_home`, inlined: the match path's hot call)
        pos = (((x ^ (x >> 64) ^ (slot * _MIX)) * _FIB) & _M64) >> shift
        row = tmv[pos]
        if row == EMPTY:
            return -1
        lo = x & _M64
        while True:
            if (
                row >= 0
                and qmv[2 * row] == lo
                and qmv[2 * row + 1] == x >> 64
                and nmv[row * step + off] == slot
            ):
                return row
            pos = (pos + 1) & mask
            row = tmv[pos]
            if row == EMPTY:
                return -1

    def _find_both(self, slot: int, block_hash: bytes) -> int:
        """`find` while growing (bound over it as an instance attribute): the new table, then the old."""
        row = HashTable.find(self, slot, block_hash)
        if row >= 0:
            return row
        old, mask, shift = self._old_params()
        x = int.from_bytes(block_hash, "little")
        return _probe_one(old.data, mask, shift, self._qmv, self._nmv, self._ns_step, self._ns_off, slot, x)

    def _find_one(self, table: np.ndarray, slot: int, key: bytes) -> int:
        mask, shift = len(table) - 1, 64 - (len(table).bit_length() - 1)
        x = int.from_bytes(key, "little")
        return _probe_one(table.data, mask, shift, self._qmv, self._nmv, self._ns_step, self._ns_off, slot, x)

    def find_many(self, slots: np.ndarray | int, keys: np.ndarray) -> np.ndarray:
        """Rows ((n,) int64, -1 where absent) of the keys `keys` ((n, 2) uint64 hash halves) under
        `slots` ((n,) ints, or one int for all)."""
        n = len(keys)
        if n == 0:
            return np.full(0, -1, dtype=np.int64)
        one_slot = not isinstance(slots, np.ndarray)
        slots_arr = np.broadcast_to(np.asarray(slots, dtype=np.int64), (n,))
        out = self._find_many_in(self.table, slots_arr, keys, one_slot)
        if self._old is not None:
            miss = np.flatnonzero(out < 0)
            if miss.size:
                out[miss] = self._find_many_in(self._old, slots_arr[miss], keys[miss], one_slot)
        return out

    def _find_many_in(
        self, table: np.ndarray, slots_arr: np.ndarray, keys: np.ndarray, one_slot: bool
    ) -> np.ndarray:
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if n <= _SCALAR_TAIL:
            raw = np.ascontiguousarray(keys).tobytes()
            for i in range(n):
                out[i] = self._find_one(table, int(slots_arr[i]), raw[16 * i : 16 * i + 16])
            return out
        mask, shift = len(table) - 1, 64 - (len(table).bit_length() - 1)
        pos = self._homes(slots_arr, keys, shift)
        todo = np.arange(n)
        k0, k1 = keys[:, 0].copy(), keys[:, 1].copy()
        want = None if one_slot else slots_arr.copy()
        h0, h1, ns = self._h64[:, 0], self._h64[:, 1], self._ns
        while todo.size:
            if todo.size <= _SCALAR_TAIL:  # a few keys left (the long probes): one by one is cheaper
                for i in todo.tolist():
                    out[i] = self._find_one(table, int(slots_arr[i]), keys[i].tobytes())
                break
            rows = table[pos]
            live = np.flatnonzero(rows >= 0)
            r = rows[live]
            first = h0[r] == k0[live]  # the low half first: the other columns only for its matches
            live, r = live[first], r[first]
            match = h1[r] == k1[live]
            match &= ns[r] == (int(slots_arr[0]) if want is None else want[live])
            hit = live[match]
            out[todo[hit]] = r[match]
            cont = rows != EMPTY
            cont[hit] = False
            todo, pos, k0, k1 = todo[cont], (pos[cont] + 1) & mask, k0[cont], k1[cont]
            if want is not None:
                want = want[cont]
        return out

    def positions_of(self, rows: np.ndarray, table: np.ndarray | None = None) -> np.ndarray:
        """Positions in `table` (default: the current one) of `rows` ((n,) ints; -1 for a row not in
        it), one numpy pass per probe round."""
        table = self.table if table is None else table
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(len(rows), -1, dtype=np.int64)
        if not len(rows):
            return out
        mask, shift = len(table) - 1, 64 - (len(table).bit_length() - 1)
        pos = self._homes(self._ns[rows], self._h64[rows], shift)
        todo = np.arange(len(rows))
        while todo.size:
            at = table[pos]
            hit = at == rows[todo]
            out[todo[hit]] = pos[hit]
            more = ~hit & (at != EMPTY)
            todo, pos = todo[more], (pos[more] + 1) & mask
        return out

    # ---- changes -----------------------------------------------------------------------------------
    def insert_many(self, rows: np.ndarray) -> None:
        """Enter `rows` ((n,) ints) whose keys (read from the columns) are absent and distinct. Takes a
        migration step first while one is under way (O(n) positions, `migrate_positions` at least)."""
        n = len(rows)
        if n == 0:
            return
        if self._old is not None:  # in step with the inserts left before the next growth can be needed
            left = len(self._old) - self._moved
            room = max(_MAX_LOAD * self.capacity - self.count - self.tombs, n)
            self.step(max(self.migrate_positions, int(left * n / room) + 1))
        if self.count + self.tombs + n > _MAX_LOAD * self.capacity:
            if self._old is not None:  # (not reached with the budget above; kept for safety)
                self.step(len(self._old))
            self._start_migration(self.count + n)
        self._place(np.asarray(rows, dtype=np.int64))

    def _start_migration(self, need: int) -> None:
        """A clean table sized for `need` entries takes over; the current one becomes the old one."""
        capacity = self.capacity
        while need > _GROW_LOAD * capacity:
            capacity *= 2
        self._old, self._moved = self.table, 0
        self.tombs = 0
        self._alloc(capacity)
        self.step(self.migrate_positions)

    def step(self, positions: int = MIGRATE_POSITIONS) -> bool:
        """Move the entries of the next `positions` old positions (extended to the end of a probe run)
        into the current table; True while some are left. O(positions) numpy work."""
        old = self._old
        if old is None:
            return False
        start, size = self._moved, len(old)
        end = min(start + max(1, positions), size)
        while end < size and old[end] != EMPTY:  # to the end of the probe run (an EMPTY position)
            ahead = old[end : end + 1024]
            gap = np.flatnonzero(ahead == EMPTY)
            end = end + int(gap[0]) if gap.size else min(end + len(ahead), size)
        seg = old[start:end]
        moving = seg[seg >= 0].astype(np.int64)
        seg[:] = EMPTY
        self._moved = end
        self.count -= len(moving)  # (`_place` counts them again)
        self._place(moving)
        if end >= size:
            self._old, self._moved = None, 0
            self._set_probe()
            return False
        return True

    def _slot_of(self, row: int) -> int:
        return int(self._nmv[row * self._ns_step + self._ns_off])

    def _key_of(self, row: int) -> int:
        return int(self._qmv[2 * row]) | int(self._qmv[2 * row + 1]) << 64

    def _home(self, slot: int, x: int) -> int:
        """The home position of one key (`x`: the hash as a little-endian int; `_homes`'s twin)."""
        return (((x ^ (x >> 64) ^ (slot * _MIX)) * _FIB) & _M64) >> self.shift

    def _place(self, rows: np.ndarray) -> None:
        if len(rows) <= _SCALAR_TAIL:
            self._place_scalar(rows.tolist())
            return
        table, mask = self.table, self.mask
        pos = self._homes(self._ns[rows], self._h64[rows])
        todo = rows
        while todo.size:
            if todo.size <= _SCALAR_TAIL:
                self._place_scalar(todo.tolist())
                return
            was = table[pos]
            free = was < 0
            cand_pos, cand_rows = pos[free], todo[free]
            # one key per free position per round: of those asking for one, the last write wins
            table[cand_pos] = cand_rows
            won = table[cand_pos] == cand_rows
            self.tombs -= int(np.count_nonzero(was[free][won] == TOMB))
            self.count += int(np.count_nonzero(won))
            placed = np.zeros(len(todo), dtype=np.bool_)
            placed[np.flatnonzero(free)[won]] = True
            todo, pos = todo[~placed], (pos[~placed] + 1) & mask

    def _place_scalar(self, rows: list[int]) -> None:
        tmv, mask = self._tmv, self.mask
        for row in rows:
            pos = self._home(self._slot_of(row), self._key_of(row))
            while tmv[pos] >= 0:
                pos = (pos + 1) & mask
            if tmv[pos] == TOMB:
                self.tombs -= 1
            tmv[pos] = row
            self.count += 1

    def delete_many(self, rows: np.ndarray) -> None:
        """Remove the (present, distinct) `rows` ((n,) ints); their keys are still in the columns.
        Raises `RuntimeError` (nothing changes) if one is in neither table."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if n == 0:
            return
        if n <= _SCALAR_TAIL:
            pos = np.array(
                [self._position_scalar(self._tmv, self.mask, self.shift, r) for r in rows.tolist()]
            )
        else:
            pos = self.positions_of(rows)
        old_pos = np.full(0, -1, dtype=np.int64)
        missing = np.flatnonzero(pos < 0)
        if missing.size:
            if self._old is None:
                raise RuntimeError("hash table: a row to delete is not in the table")
            old_pos = self.positions_of(rows[missing], self._old)
            if (old_pos < 0).any():
                raise RuntimeError("hash table: a row to delete is not in the table")
            self._old[old_pos] = TOMB
        here = pos[pos >= 0]
        self.table[here] = TOMB
        self.count -= n
        self.tombs += len(here)

    def _position_scalar(self, tmv: memoryview, mask: int, shift: int, row: int) -> int:
        x = self._key_of(row)
        pos = (((x ^ (x >> 64) ^ (self._slot_of(row) * _MIX)) * _FIB) & _M64) >> shift
        while tmv[pos] != row:
            if tmv[pos] == EMPTY:
                return -1
            pos = (pos + 1) & mask
        return pos
