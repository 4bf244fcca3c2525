"""A store node's slot free list as numpy columns (no Python object per slot).

Per slot: its state (allocated, free, or ordered freed and waiting for the store's acknowledgement) and
the generation it is free at (or was ordered freed at); the free slots themselves wait in a FIFO ring of
slot numbers (a freed slot is reused last, so a reader's stale (slot, generation) ages out first). About
13 bytes per slot (uint32 ring entry, uint64 generation, uint8 state), against ~150 B per free slot for
a deque of tuples, a set and a dict.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

ALLOCATED = 0
FREE = 1
PENDING = 2  # ordered freed, the store deferred it: free once its acknowledgement arrives


class FreeSlots:
    """The free list of one store node of `num_slots` slots (slot numbers 0..num_slots-1, at most 2**32).

    Starts with every slot allocated (nothing placeable until an inventory was adopted: `release_unused`).
    `len()` is the number of free slots. Not thread-safe: the master's lock guards it."""

    __slots__ = ("_count", "_gen", "_head", "_ring", "_state", "num_slots")

    def __init__(self, num_slots: int = 0) -> None:
        if not 0 <= num_slots <= 1 << 32:
            raise ValueError(f"num_slots must be in [0, 2**32], got {num_slots}")
        self.num_slots = num_slots
        self._ring = np.zeros(num_slots, dtype=np.uint32)  # free slots, FIFO from _head
        self._gen = np.zeros(num_slots, dtype=np.uint64)  # FREE: its generation; PENDING: ordered one
        self._state = np.zeros(num_slots, dtype=np.uint8)
        self._head = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    @property
    def nbytes(self) -> int:
        """Bytes the columns hold (the free list's whole memory, less a constant)."""
        return self._ring.nbytes + self._gen.nbytes + self._state.nbytes

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Allocate the `n` oldest free slots: (slots, generations), (n,) int64 and uint64 arrays.
        Raises ValueError when fewer than `n` are free (nothing taken)."""
        if not 0 <= n <= self._count:
            raise ValueError(f"{n} slots asked, {self._count} free")
        idx = (self._head + np.arange(n, dtype=np.int64)) % max(self.num_slots, 1)
        slots = self._ring[idx].astype(np.int64)
        self._head = (self._head + n) % max(self.num_slots, 1)
        self._count -= n
        self._state[slots] = ALLOCATED
        return slots, self._gen[slots].copy()

    def give_back(self, slot: int, generation: int) -> None:
        """`slot` is free at `generation` (the store acknowledged its free); a slot already free or out of
        range is ignored (never handed out twice)."""
        if not 0 <= slot < self.num_slots or self._state[slot] == FREE:
            return
        self._state[slot] = FREE
        self._gen[slot] = generation
        self._ring[(self._head + self._count) % self.num_slots] = slot
        self._count += 1

    def mark_pending(self, slot: int, generation: int) -> None:
        """The store deferred freeing `slot` (a read holds it): it becomes free at `generation` when the
        store's heartbeat acknowledges it (`is_pending`, then `give_back`)."""
        if 0 <= slot < self.num_slots and self._state[slot] != FREE:
            self._state[slot] = PENDING
            self._gen[slot] = generation

    def is_pending(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._state[slot] == PENDING)

    def is_free(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._state[slot] == FREE)

    def allocate_all(self) -> None:
        """Forget every free and pending slot: all allocated (an inventory's adoption starts here)."""
        self._state[:] = ALLOCATED
        self._head = self._count = 0

    def release_unused(self, used: np.ndarray, generation: int) -> int:
        """End of an inventory's adoption: every allocated slot not marked in `used` ((num_slots,) bool)
        is free at `generation` (slots given back meanwhile keep theirs). Returns how many were freed."""
        if used.shape != (self.num_slots,):
            raise ValueError(f"used must be ({self.num_slots},) bool, got {used.shape}")
        fresh = np.flatnonzero((self._state == ALLOCATED) & ~used)
        self._state[fresh] = FREE
        self._gen[fresh] = generation
        n = len(fresh)
        if n:
            pos = (self._head + self._count + np.arange(n, dtype=np.int64)) % self.num_slots
            self._ring[pos] = fresh
            self._count += n
        return n


class FreeOrders:
    """Free orders queued for one store node, as numpy chunks of (slots, generations): no Python object per
    slot. Iterating yields (slot, generation) pairs (for small callers and tests)."""

    __slots__ = ("_chunks", "_count")

    def __init__(self) -> None:
        self._chunks: list[tuple[np.ndarray, np.ndarray]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def add(self, slots: np.ndarray, generations: np.ndarray) -> None:
        """Queue `slots` ((m,) int) freed from `generations` ((m,) uint64)."""
        if len(slots):
            self._chunks.append((np.asarray(slots, np.int64), np.asarray(generations, np.uint64)))
            self._count += len(slots)

    def add_one(self, slot: int, generation: int) -> None:
        self.add(np.array([slot], np.int64), np.array([generation], np.uint64))

    def extend(self, other: FreeOrders) -> None:
        for slots, gens in other._chunks:
            self.add(slots, gens)

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """All queued (slots (n,) int64, generations (n,) uint64), in queue order."""
        if not self._chunks:
            return np.empty(0, np.int64), np.empty(0, np.uint64)
        if len(self._chunks) > 1:
            self._chunks = [
                (np.concatenate([c[0] for c in self._chunks]), np.concatenate([c[1] for c in self._chunks]))
            ]
        return self._chunks[0]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        slots, gens = self.columns()
        return iter(zip(slots.tolist(), gens.tolist(), strict=True))
