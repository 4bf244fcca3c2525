"""The disk slots' data plane (`transfer.BlockHandler` for disk slots, `kvpool.store.disk_serving`): pins,
reads from disk into bounce buffers, writes into bounce buffers; and the state of a reserved disk slot."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.capability import READ, WRITE
from kvpool.errors import (
    AlreadyExists,
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    ResourceExhausted,
    StaleGeneration,
    Unavailable,
)
from kvpool.types import Clock
from transfer.xxh3 import checksum as block_checksum

if TYPE_CHECKING:
    from kvpool.store.disk_tier import DiskTier

_ERRORS = {
    "StaleGeneration": StaleGeneration,
    "FailedPrecondition": FailedPrecondition,
    "NotFound": InvalidArgument,
    "InvalidArgument": InvalidArgument,
    "ChecksumMismatch": ChecksumMismatch,
}


def tier_error(line: str) -> Exception:
    """The exception for one of the tier's per-slot error lines ("Kind: message")."""
    kind, _, msg = line.partition(": ")
    return _ERRORS.get(kind, Unavailable)(msg or line)


@dataclass(slots=True)
class Pending:
    """A reserved disk slot (or a tier move's destination): the block it will hold, its write lease, and
    once a write began, the bounce buffer its bytes land in."""

    generation: int
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    expiry_ms: int
    buf: np.ndarray | None = None
    writing: bool = False
    written: bool = False
    checksum: int = 0
    freeing: bool = False
    internal: bool = False  # a tier move's destination: no data-plane write, no lease


class DiskDataPlane:
    """`DiskSlots`' data-plane methods (a mixin over its state, under its lock)."""

    tier: DiskTier
    first_slot: int
    block_nbytes: int
    num_inflight: int
    refused_reads: int
    _clock: Clock
    _lock: threading.Lock
    _pending: dict[int, Pending]
    _readers: dict[int, int]
    _freeing: set[int]

    if TYPE_CHECKING:

        def _check_slot(self, slot: int) -> None: ...

        def generation(self, slot: int) -> int: ...

        def _check_capability(
            self, op: str, slot: int, gen: int, capability: bytes, expiry_ms: int
        ) -> None: ...

        def _take_buffer(self, n: int) -> np.ndarray: ...

        def _give_buffer(self, n: int) -> None: ...

        def _finish_later(self, slot: int, gen: int) -> None: ...

    # ---------------------------------------------------------------- data plane

    def pin(self, slot: int, gen: int, capability: bytes | None, expiry_ms: int = 0) -> None:
        """Mark a committed disk slot in flight (a free waits); `capability` None: an internal move.
        Lock held."""
        self._check_slot(slot)
        if capability is not None:
            self._check_capability(READ, slot, gen, capability, expiry_ms)
        current = self.generation(slot)
        if gen != current:
            raise StaleGeneration(f"disk slot {slot} is at generation {current}, not {gen}")
        if slot in self._freeing:
            raise StaleGeneration(f"disk slot {slot} generation {gen} is being freed")
        if not self.tier.is_committed(slot) or slot in self._pending:
            raise FailedPrecondition(f"disk slot {slot} holds no committed block")
        self._readers[slot] = self._readers.get(slot, 0) + 1
        self.num_inflight += 1

    def unpin(self, slot: int) -> bool:
        """End one pin; True when the slot's free was waiting for it (and is now under way). Lock held."""
        n = self._readers.get(slot, 0)
        if n <= 0:
            return False
        self.num_inflight -= 1
        if n > 1:
            self._readers[slot] = n - 1
            return False
        del self._readers[slot]
        if slot in self._freeing:
            self._freeing.discard(slot)
            self._finish_later(slot, self.generation(slot))
            return True
        return False

    def pin_many(self, refs: Sequence[tuple[int, int]]) -> list[str]:
        """`pin` of each (slot, generation) without a capability (a tier move); per slot "" or the error."""
        out = []
        with self._lock:
            for slot, gen in refs:
                try:
                    self.pin(slot, gen, None)
                    out.append("")
                except (InvalidArgument, FailedPrecondition) as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
        return out

    def unpin_many(self, slots: Sequence[int]) -> list[bool]:
        """`unpin` of each slot; per slot whether a free was waiting on it (the move's source moved)."""
        with self._lock:
            return [self.unpin(s) for s in slots]

    def begin_reads(
        self, reads: Sequence[tuple[int, int, int, bytes, int]]
    ) -> list[tuple[memoryview, int] | Exception]:
        """`transfer.BlockHandler.begin_reads` of disk slots: each checked (capability first), pinned, read
        from disk into a bounce buffer and verified against its recorded checksum; a block whose bytes do not
        match is refused (and dropped by the tier), never served. Blocks on disk I/O: call off the loop."""
        out: list[tuple[memoryview, int] | Exception] = [ValueError()] * len(reads)
        began: list[int] = []
        with self._lock:
            for i, (slot, gen, nbytes, cap, exp) in enumerate(reads):
                try:
                    if nbytes != self.block_nbytes:
                        raise InvalidArgument(
                            f"block size {nbytes} B does not match this store's layout ({self.block_nbytes} B)"
                        )
                    self.pin(slot, gen, cap, exp)
                    began.append(i)
                except Exception as exc:  # noqa: BLE001 - a per-read result
                    out[i] = exc
            try:
                buf = self._take_buffer(len(began)) if began else None
            except ResourceExhausted as exc:
                for i in began:
                    self.unpin(reads[i][0])
                    out[i] = exc
                return out
        if buf is None:
            return out
        rows = buf[:, : self.block_nbytes]  # staged by the tier when a block is not whole pages
        slots = np.array([reads[i][0] for i in began], dtype=np.int64)
        gens = np.array([reads[i][1] for i in began], dtype=np.uint64)
        errors = self.tier.read(slots, gens, rows)
        stored = self.tier.checksum[slots - self.first_slot]
        failed = []
        for j, i in enumerate(began):
            if errors[j]:
                out[i] = tier_error(errors[j])
                failed.append(reads[i][0])
            else:
                out[i] = (rows[j].data, int(stored[j]))
        if failed:
            with self._lock:
                self.refused_reads += len(failed)
                for s in failed:
                    self.unpin(s)
                self._give_buffer(len(failed))
        return out

    def end_reads(self, slots: Sequence[int]) -> None:
        with self._lock:
            for s in slots:
                if self._readers.get(s, 0) > 0:
                    self._give_buffer(1)
                self.unpin(s)

    def begin_write(self, slot: int, gen: int, nbytes: int, grant: tuple[bytes, int] | None) -> memoryview:
        """A bounce buffer for the bytes of reserved disk slot `slot` (`grant`: its write capability; None:
        the store's own copy)."""
        with self._lock:
            self._check_slot(slot)
            if nbytes != self.block_nbytes:
                raise InvalidArgument(
                    f"block size {nbytes} B does not match this store's layout ({self.block_nbytes} B)"
                )
            if grant is not None:
                self._check_capability(WRITE, slot, gen, *grant)
            current = self.generation(slot)
            if gen != current:
                raise StaleGeneration(f"disk slot {slot} is at generation {current}, not {gen}")
            p = self._pending.get(slot)
            if p is None and self.tier.is_committed(slot):
                raise AlreadyExists(f"disk slot {slot} generation {gen} is COMMITTED already")
            if p is None or p.internal or p.freeing:
                raise FailedPrecondition(f"disk slot {slot} is not reserved")
            if p.written:
                raise AlreadyExists(f"disk slot {slot} generation {gen} is WRITTEN already")
            if p.writing:
                raise FailedPrecondition(f"disk slot {slot} is being written by another transfer")
            if p.expiry_ms <= self._clock.now_ms():
                raise LeaseExpired(f"the write lease of disk slot {slot} expired")
            if p.buf is None:
                p.buf = self._take_buffer(1)[0]
            p.writing = True
            self.num_inflight += 1
            return p.buf[: self.block_nbytes].data

    def end_write(self, slot: int, gen: int, checksum: int, ok: bool, landed: int | None) -> None:
        """The write into `slot`'s bounce buffer ended: verify `checksum` (raises on a mismatch)."""
        with self._lock:
            p = self._pending.get(slot)
            if p is None or not p.writing:
                return
            buf = p.buf
        got = 0
        if ok and buf is not None:
            got = landed if landed is not None else block_checksum(buf[: self.block_nbytes].data)
        with self._lock:
            p.writing = False
            self.num_inflight -= 1
            if p.freeing or p.generation != gen or self._pending.get(slot) is not p:
                self._drop_pending(slot, p)
                raise StaleGeneration(f"disk slot {slot} was freed during the write")
            if not ok:
                return
            if got != checksum:
                raise ChecksumMismatch(f"disk slot {slot}: bytes hash to {got:#x}, writer said {checksum:#x}")
            p.written, p.checksum = True, checksum

    def _drop_pending(self, slot: int, p: Pending) -> None:
        """A reservation freed while it was written: free it now (lock held; tier I/O in the background)."""
        if self._pending.get(slot) is p:
            del self._pending[slot]
        if p.buf is not None:
            self._give_buffer(1)
            p.buf = None
        if p.freeing:
            self._finish_later(slot, p.generation)
