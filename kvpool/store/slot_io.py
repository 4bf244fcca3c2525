"""The slot table's data plane: the reads and writes of block bytes (`transfer.BlockHandler`).

A read begins on a COMMITTED slot of the generation it names (with its capability when the store checks
them) and pins the slot until it ends; a write begins on a RESERVED slot within its write lease and, when
it ends, the bytes that landed must hash to the writer's checksum (the slot becomes WRITTEN). A free order
for a slot in flight waits for the last transfer (`SlotTable`, kvpool/store/slots.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.capability import READ, WRITE, Capabilities
from kvpool.errors import (
    AlreadyExists,
    ChecksumMismatch,
    FailedPrecondition,
    LeaseExpired,
    StaleGeneration,
)
from kvpool.store.disk_serving import DiskSlots
from kvpool.store.segment import Segment
from kvpool.store.slot_types import _COMMITTED, _FREEING, _RESERVED, _WRITING, _WRITTEN, SlotState
from kvpool.types import Clock
from transfer.xxh3 import checksum as block_checksum


class SlotDataPlane:
    """`SlotTable`'s `transfer.BlockHandler` methods (a mixin over the table's arrays, under its lock)."""

    segment: Segment
    capabilities: Capabilities | None
    num_slots: int
    block_nbytes: int
    num_inflight: int
    metadata_only: bool
    _clock: Clock
    _lock: threading.Lock
    _gen: np.ndarray
    _checksum: np.ndarray
    _state: np.ndarray
    _readers: np.ndarray
    _flags: np.ndarray
    _flag_bytes: bytearray
    disk: DiskSlots | None

    if TYPE_CHECKING:  # the table's checks (lock held)

        def _check_slot(self, slot: int) -> None: ...

        def _check_gen(self, slot: int, generation: int) -> None: ...

        def _check_nbytes(self, nbytes: int) -> None: ...

        def _check_capability(
            self, op: str, slot: int, generation: int, capability: bytes, expiry_ms: int
        ) -> None: ...

        def _maybe_finish_free(self, slot: int) -> None: ...

        def _freeing(self, slot: int) -> bool: ...

        def _lease_expiry_ms(self, slot: int) -> int: ...

    def _refuse_bytes(self) -> None:
        if self.metadata_only:
            raise FailedPrecondition(
                "this store is metadata-only (kvpool store --metadata-only, for benchmarks): it holds no "
                "block bytes and refuses every read and write"
            )

    def begin_read(
        self, slot: int, generation: int, nbytes: int, capability: bytes = b"", expiry_ms: int = 0
    ) -> tuple[memoryview, int]:
        self._refuse_bytes()
        if self.disk is not None and type(slot) is int and slot >= self.disk.first_slot:
            got = self.disk.begin_reads([(slot, generation, nbytes, capability, expiry_ms)])[0]
            if isinstance(got, Exception):
                raise got
            return got
        with self._lock:
            return self._begin_read(slot, generation, nbytes, capability, expiry_ms)

    def begin_reads(
        self, reads: Sequence[tuple[int, int, int, bytes, int]]
    ) -> list[tuple[memoryview, int] | Exception]:
        """`begin_read` of each (slot, generation, nbytes, capability, expiry_ms) under one lock: per read,
        its (bytes, stored checksum) or the exception `begin_read` would raise. Each success needs its
        `end_read` (or one `end_reads`). Disk slots are read from disk (blocking: `blocking_slots_from`)."""
        if self.disk is not None and any(r[0] >= self.disk.first_slot for r in reads if type(r[0]) is int):
            first = self.disk.first_slot
            on_disk = [i for i, r in enumerate(reads) if type(r[0]) is int and r[0] >= first]
            disk = dict(zip(on_disk, self.disk.begin_reads([reads[i] for i in on_disk]), strict=True))
            mem = iter(self.begin_reads([r for i, r in enumerate(reads) if i not in disk]))
            return [disk[i] if i in disk else next(mem) for i in range(len(reads))]
        out: list[tuple[memoryview, int] | Exception] = []
        if self.metadata_only:
            try:
                self._refuse_bytes()
            except FailedPrecondition as exc:
                return [exc for _ in reads]
        with self._lock:
            if (fast := self._begin_reads_at_once(reads)) is not None:
                return fast
            for slot, generation, nbytes, capability, expiry_ms in reads:
                try:
                    out.append(self._begin_read(slot, generation, nbytes, capability, expiry_ms))
                except Exception as exc:  # noqa: BLE001 - a per-read result, as from begin_read
                    out.append(exc)
        return out

    def begin_reads_array(self, reads: np.ndarray) -> tuple[memoryview, np.ndarray, np.ndarray] | None:
        """`begin_reads` of a batch as one integer array (n, 3) of (slot, generation, nbytes), without
        capabilities (the same-host `mread` path, transfer/mread_wire.py): when every read passes every
        check, all are begun and returned as (the segment's buffer, each block's start in it in bytes,
        stored checksums), both uint64 (n,); else None and nothing is begun (`begin_reads` then names each
        failure). A few array operations instead of ~1.5 us of Python a block."""
        with self._lock:
            return self._begin_reads_array(reads)

    def _begin_reads_at_once(
        self, reads: Sequence[tuple[int, int, int, bytes, int]]
    ) -> list[tuple[memoryview, int] | Exception] | None:
        """`begin_reads` through `_begin_reads_array` when capabilities are off and there are enough reads
        to gain from it; None when it does not apply or any read would fail. Lock held."""
        if self.capabilities is not None or len(reads) < 8 or not all(type(r[0]) is int for r in reads):
            return None
        try:
            req = np.array([r[:3] for r in reads])
        except (ValueError, OverflowError):  # ragged or huge: the per-read path says what is wrong
            return None
        if (got := self._begin_reads_array(req)) is None:
            return None
        buf, nb = got[0], self.block_nbytes
        return [(buf[s : s + nb], c) for s, c in zip(got[1].tolist(), got[2].tolist(), strict=True)]

    def _begin_reads_array(self, req: np.ndarray) -> tuple[memoryview, np.ndarray, np.ndarray] | None:
        if (
            self.metadata_only
            or self.capabilities is not None
            or req.dtype.kind not in "iu"
            or req.ndim != 2
            or req.shape[1] != 3
        ):
            return None
        if not len(req) or req.min() < 0:
            return None
        slots = req[:, 0]
        if slots.max() >= self.num_slots or (req[:, 2] != self.block_nbytes).any():
            return None
        if (self._gen[slots] != req[:, 1].astype(np.uint64)).any() or (
            self._state[slots] != _COMMITTED
        ).any():
            return None
        if (self._flags[slots] & _FREEING).any():
            return None
        np.add.at(self._readers, slots, 1)
        self.num_inflight += len(slots)
        starts = slots.astype(np.uint64) * np.uint64(self.block_nbytes)
        return self.segment.buffer, starts, self._checksum[slots]

    def _begin_read(
        self, slot: int, generation: int, nbytes: int, capability: bytes, expiry_ms: int
    ) -> tuple[memoryview, int]:
        self._check_slot(slot)
        self._check_nbytes(nbytes)
        # the capability before the generation: a caller without one learns nothing of the slot's state
        self._check_capability(READ, slot, generation, capability, expiry_ms)
        self._check_gen(slot, generation)
        if self._freeing(slot):
            raise StaleGeneration(f"slot {slot} generation {generation} is being freed")
        if int(self._state[slot]) != _COMMITTED:
            raise FailedPrecondition(
                f"slot {slot} is {SlotState(int(self._state[slot])).name}, not committed"
            )
        self._readers[slot] += 1
        self.num_inflight += 1
        return self.segment.slot_view(slot), int(self._checksum[slot])

    def end_read(self, slot: int) -> None:
        self.end_reads((slot,))

    def end_reads(self, slots: Iterable[int]) -> None:
        """`end_read` of each slot, under one lock."""
        if self.disk is not None:
            first = self.disk.first_slot
            slots = list(slots)
            if any(s >= first for s in slots):
                self.disk.end_reads([s for s in slots if s >= first])
                slots = [s for s in slots if s < first]
        with self._lock:
            for slot in slots:
                if self._readers[slot] <= 0:
                    continue
                self._readers[slot] -= 1
                self.num_inflight -= 1
                self._maybe_finish_free(slot)

    def begin_write(
        self, slot: int, generation: int, nbytes: int, capability: bytes = b"", expiry_ms: int = 0
    ) -> memoryview:
        return self._begin_write(slot, generation, nbytes, (capability, expiry_ms))

    def begin_copy_write(self, slot: int, generation: int, nbytes: int) -> memoryview:
        """`begin_write` for this store's own copy of a block it pulls on a master's `CopyBlocks` order
        (re-replication): the order came over the control plane, so no data-plane capability applies."""
        return self._begin_write(slot, generation, nbytes, None)

    def _begin_write(
        self, slot: int, generation: int, nbytes: int, grant: tuple[bytes, int] | None
    ) -> memoryview:
        self._refuse_bytes()
        if self.disk is not None and type(slot) is int and slot >= self.disk.first_slot:
            return self.disk.begin_write(slot, generation, nbytes, grant)
        with self._lock:
            self._check_slot(slot)
            self._check_nbytes(nbytes)
            if grant is not None:  # before the generation: no slot state to a caller without one
                self._check_capability(WRITE, slot, generation, *grant)
            self._check_gen(slot, generation)
            state = int(self._state[slot])
            if state in (_WRITTEN, _COMMITTED):
                raise AlreadyExists(
                    f"slot {slot} generation {generation} is {SlotState(int(state)).name} already"
                )
            if state != _RESERVED or self._freeing(slot):
                raise FailedPrecondition(f"slot {slot} is not reserved")
            if self._flag_bytes[slot] & _WRITING:
                raise FailedPrecondition(f"slot {slot} is being written by another transfer")
            if self._lease_expiry_ms(slot) <= self._clock.now_ms():
                raise LeaseExpired(f"the write lease of slot {slot} expired")
            self._flag_bytes[slot] |= _WRITING
            self.num_inflight += 1
            return self.segment.slot_view(slot)

    def end_write(
        self, slot: int, generation: int, checksum: int, ok: bool, landed_checksum: int | None = None
    ) -> None:
        if self.disk is not None and slot >= self.disk.first_slot:
            self.disk.end_write(slot, generation, checksum, ok, landed_checksum)
            return
        if not ok:
            got = 0
        elif landed_checksum is not None:  # hashed by the transport once the bytes landed
            got = landed_checksum
        else:
            got = block_checksum(self.segment.slot_view(slot))
        with self._lock:
            if not self._flag_bytes[slot] & _WRITING:
                return
            self._flag_bytes[slot] &= 0xFF ^ _WRITING
            self.num_inflight -= 1
            try:
                if self._freeing(slot) or int(self._gen[slot]) != generation:
                    raise StaleGeneration(f"slot {slot} was freed during the write")
                if not ok:
                    return  # stays RESERVED: the writer may retry within its lease
                if got != checksum:
                    raise ChecksumMismatch(f"slot {slot}: bytes hash to {got:#x}, writer said {checksum:#x}")
                self._state[slot] = _WRITTEN
                self._checksum[slot] = checksum
            finally:
                self._maybe_finish_free(slot)
