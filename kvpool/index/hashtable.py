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
capacity the table is rebuilt from the live rows (vectorised), doubling only when the live entries
alone pass `_GROW_LOAD`: so the table's load stays in (0.3, 0.7] once it is larger than the minimum,
4 / load bytes per block (6 to 13 B). A rebuild is O(entries) numpy work (about 1 s per 10 M entries on
this machine's cores), paid once per doubling or per `capacity * (_MAX_LOAD - _GROW_LOAD)` deletions.

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


class HashTable:
    """Maps (slot, hash) to a row; reads keys through `h64` ((rows, 2) uint64: each hash's two
    little-endian halves) and `ns_slot` ((rows,) int32), the index's columns (rebound by `bind`)."""

    def __init__(self, h64: np.ndarray, ns_slot: np.ndarray, capacity: int = _MIN_CAPACITY) -> None:
        self.bind(h64, ns_slot)
        self.count = 0
        """Live entries."""
        self.tombs = 0
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

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_qmv", "_tmv", "_nmv", "_probe")}

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
        return int(self.table.nbytes)

    # ---- positions ---------------------------------------------------------------------------------
    def _homes(self, slots: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Home positions ((n,) int64) of `keys` ((n, 2) uint64) under `slots` ((n,) ints)."""
        x = keys[:, 0] ^ keys[:, 1]
        x ^= slots.astype(np.uint64) * np.uint64(_MIX)
        x *= np.uint64(_FIB)
        return (x >> np.uint64(self.shift)).astype(np.int64)

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

    def find_many(self, slots: np.ndarray | int, keys: np.ndarray) -> np.ndarray:
        """Rows ((n,) int64, -1 where absent) of the keys `keys` ((n, 2) uint64 hash halves) under
        `slots` ((n,) ints, or one int for all)."""
        n = len(keys)
        out = np.full(n, -1, dtype=np.int64)
        if n == 0:
            return out
        one_slot = not isinstance(slots, np.ndarray)
        slots_arr = np.broadcast_to(np.asarray(slots, dtype=np.int64), (n,))
        if n <= _SCALAR_TAIL:
            raw = np.ascontiguousarray(keys).tobytes()
            for i in range(n):
                out[i] = self.find(int(slots_arr[i]), raw[16 * i : 16 * i + 16])
            return out
        pos = self._homes(slots_arr, keys)
        todo = np.arange(n)
        k0, k1 = keys[:, 0].copy(), keys[:, 1].copy()
        want = None if one_slot else slots_arr.copy()
        table, h0, h1, ns, mask = self.table, self._h64[:, 0], self._h64[:, 1], self._ns, self.mask
        while todo.size:
            if todo.size <= _SCALAR_TAIL:  # a few keys left (the long probes): one by one is cheaper
                for i in todo.tolist():
                    out[i] = self.find(int(slots_arr[i]), keys[i].tobytes())
                break
            rows = table[pos]
            live = np.flatnonzero(rows >= 0)
            r = rows[live]
            match = (h0[r] == k0[live]) & (h1[r] == k1[live])
            match &= ns[r] == (int(slots_arr[0]) if want is None else want[live])
            hit = live[match]
            out[todo[hit]] = r[match]
            cont = rows != EMPTY
            cont[hit] = False
            todo, pos, k0, k1 = todo[cont], (pos[cont] + 1) & mask, k0[cont], k1[cont]
            if want is not None:
                want = want[cont]
        return out

    def positions_of(self, rows: np.ndarray) -> np.ndarray:
        """Table positions holding the (present) `rows` ((n,) ints), one numpy pass per probe round."""
        n = len(rows)
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        rows = np.asarray(rows, dtype=np.int64)
        pos = self._homes(self._ns[rows], self._h64[rows])
        todo = np.arange(n)
        table, mask = self.table, self.mask
        guard = 0
        while todo.size:
            hit = table[pos] == rows[todo]
            out[todo[hit]] = pos[hit]
            todo, pos = todo[~hit], (pos[~hit] + 1) & mask
            guard += 1
            if guard > self.capacity:
                raise RuntimeError("hash table: a row to delete is not in the table")
        return out

    # ---- changes -----------------------------------------------------------------------------------
    def insert_many(self, rows: np.ndarray) -> None:
        """Enter `rows` ((n,) ints) whose keys (read from the columns) are absent and distinct."""
        n = len(rows)
        if n == 0:
            return
        if self.count + self.tombs + n > _MAX_LOAD * self.capacity:
            self._rebuild(self.count + n)
        self._place(np.asarray(rows, dtype=np.int64))

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
        """Remove the (present, distinct) `rows` ((n,) ints); their keys are still in the columns."""
        n = len(rows)
        if n == 0:
            return
        if n <= _SCALAR_TAIL:
            tmv, mask = self._tmv, self.mask
            for row in rows.tolist():
                pos = self._home(self._slot_of(row), self._key_of(row))
                while tmv[pos] != row:
                    if tmv[pos] == EMPTY:
                        raise RuntimeError("hash table: a row to delete is not in the table")
                    pos = (pos + 1) & mask
                tmv[pos] = TOMB
        else:
            self.table[self.positions_of(rows)] = TOMB
        self.count -= n
        self.tombs += n

    def _rebuild(self, need: int) -> None:
        """Re-enter the live rows into a clean table sized for `need` entries."""
        live = self.table[self.table >= 0].astype(np.int64)
        capacity = self.capacity
        while need > _GROW_LOAD * capacity:
            capacity *= 2
        self._alloc(capacity)
        self.count = self.tombs = 0
        self._place(live)
