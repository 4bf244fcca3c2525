"""The slot table's side of a move between tiers (`kvpool.store.tier_moves`): pin a committed memory block as
a move's source, and hold a free memory slot as a promotion's destination until its bytes landed.

A move's source is pinned like a read (a free order waits for it); when the pin ends, the move learns whether
a free came meanwhile (the block left the index: the move is discarded). A destination is held RESERVED with
a write in flight, so no reservation or data-plane write can take it, and is committed only when its bytes
match the source's checksum and no free came for it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument
from kvpool.store.slot_columns import MAX_WRITE_LEASE_MS, SlotColumns
from kvpool.store.slot_types import _COMMITTED, _FREE, _FREEING, _HAS_PARENT, _RESERVED, _WRITING, SlotState
from kvpool.types import Clock

if TYPE_CHECKING:
    from kvpool.store.segment import Segment


class MoveSlots:
    """`SlotTable`'s tier-move methods (a mixin over the table's arrays, under its lock)."""

    segment: Segment
    num_inflight: int
    _clock: Clock
    _lock: threading.Lock
    _gen: np.ndarray
    _checksum: np.ndarray
    _state: np.ndarray
    _readable: np.ndarray
    _readers: np.ndarray
    _flag_bytes: bytearray
    _flags: np.ndarray
    _cols: SlotColumns
    _num_used: int
    _next_expiry_ms: int

    if TYPE_CHECKING:

        def _check_slot(self, slot: int) -> None: ...

        def _maybe_finish_free(self, slot: int) -> None: ...

        def _release(self, slot: int) -> int: ...

    def pin_sources(
        self, refs: list[tuple[int, int]]
    ) -> list[tuple[memoryview, int, bytes, bytes, bytes] | str]:
        """Pin each committed memory block (slot, generation) as a move's source: (its bytes, checksum,
        namespace, hash, parent hash or b"") or the error line. Each success needs `unpin_sources`."""
        out: list[tuple[memoryview, int, bytes, bytes, bytes] | str] = []
        with self._lock:
            for slot, gen in refs:
                try:
                    self._check_slot(slot)
                    current = int(self._gen[slot])
                    if gen != current or self._flag_bytes[slot] & _FREEING:
                        raise FailedPrecondition(f"slot {slot} is at generation {current}, not {gen}")
                    if int(self._state[slot]) != _COMMITTED:
                        raise FailedPrecondition(f"slot {slot} holds no committed block")
                except (InvalidArgument, FailedPrecondition) as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
                    continue
                self._readers[slot] += 1
                self.num_inflight += 1
                ns, h = self._cols.block_of(slot)
                parent = (
                    self._cols.parent_hash[slot].tobytes() if self._flag_bytes[slot] & _HAS_PARENT else b""
                )
                out.append((self.segment.slot_view(slot), int(self._checksum[slot]), ns, h, parent))
        return out

    def unpin_sources(self, slots: list[int]) -> list[bool]:
        """End the pins of `pin_sources`; per slot whether a free came for it meanwhile (the move is stale)."""
        out = []
        with self._lock:
            for slot in slots:
                out.append(bool(self._flag_bytes[slot] & _FREEING))
                if self._readers[slot] > 0:
                    self._readers[slot] -= 1
                    self.num_inflight -= 1
                    self._maybe_finish_free(slot)
        return out

    def claim_destination(
        self, slot: int, gen: int, namespace: bytes, block_hash: bytes, parent_hash: bytes
    ) -> memoryview:
        """Hold free memory slot `slot` at `gen` (or above its generation, never below) for a promotion: its
        bytes to fill, then `finish_destination`. Raises `InvalidArgument`, `FailedPrecondition`."""
        with self._lock:
            self._check_slot(slot)
            current = int(self._gen[slot])
            if int(self._state[slot]) != _FREE:
                raise FailedPrecondition(f"slot {slot} is {SlotState(int(self._state[slot])).name}, not free")
            if gen < current:
                raise FailedPrecondition(f"slot {slot} is at generation {current}, not {gen}")
            self._gen[slot] = gen
            self._state[slot] = _RESERVED
            self._num_used += 1
            self._cols.set_blocks(np.array([slot]), [namespace], [block_hash], [parent_hash], self._flags)
            now = self._clock.now_ms()
            self._cols.lease[slot] = self._cols.lease_until(now, MAX_WRITE_LEASE_MS)
            self._flag_bytes[slot] |= _WRITING
            self.num_inflight += 1
            return self.segment.slot_view(slot)

    def finish_destination(self, slot: int, gen: int, checksum: int | None) -> str:
        """End a promotion's destination: committed with `checksum` when it is not None and no free came for
        it, else freed (its generation raised). "" when committed, else why not."""
        with self._lock:
            self._flag_bytes[slot] &= 0xFF ^ _WRITING
            self.num_inflight -= 1
            if self._flag_bytes[slot] & _FREEING or int(self._gen[slot]) != gen:
                self._maybe_finish_free(slot)
                return "stale: the destination was freed during the move"
            if checksum is None:
                self._release(slot)
                return "failed"
            self._state[slot] = _COMMITTED
            self._checksum[slot] = checksum
            self._readable[slot] = 1
            return ""
