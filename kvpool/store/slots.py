"""The slot table: per-slot state, generation, write lease, checksum and in-flight transfers.

A slot is FREE -> RESERVED (by the master, under a write lease) -> WRITTEN (bytes landed, checksum
verified) -> COMMITTED (visible to reads) -> FREE again, and every return to FREE bumps its generation.
Every read and write names the generation it expects; a mismatch raises `StaleGeneration`, so nobody ever
sees another block's bytes. A free order for a slot with a transfer in flight is deferred until the last
transfer ends; deferred frees and reclaimed (expired) reservations are reported through `drain_freed()`.

Slots start at generation 1. A reservation of a FREE slot may name a generation above the current one
(the slot jumps forward: a master that lost track after a restart stays safe); never one below.
With `capabilities` (see kvpool/capability.py), every read and write must carry a capability the master
signed for this node, the slot, its generation and the block the slot records (namespace and hash), for
that operation, not yet expired; without one the block is refused with `PermissionDenied` and no bytes move.
The capability is checked before the generation and the slot's state, so a caller without one learns
nothing of the slot (FREE, its generation, its state): every such request gets the same refusal.
With a shared segment and without capabilities, each slot's generation, checksum and readable flag
(COMMITTED, no free pending) live in `shared_state`, which same-host readers map to copy without asking
first (transfer/slot_state.py): a release clears the flag and bumps the generation before the slot can be
written again. Implements `transfer.BlockHandler` (its reads and writes: kvpool/store/slot_io.py). Thread-safe (one lock; the checksum of a write is
computed outside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from kvpool.capability import Capabilities
from kvpool.errors import (
    FailedPrecondition,
    InvalidArgument,
    StaleGeneration,
)
from kvpool.store.fence import EpochFence
from kvpool.store.segment import Segment
from kvpool.store.slot_io import SlotDataPlane
from kvpool.store.slot_types import (  # noqa: F401 - FIRST_GENERATION, Reservation: this module's API
    _COMMITTED,
    _FREE,
    _RESERVED,
    _WRITTEN,
    FIRST_GENERATION,
    FreeResult,
    Reservation,
    SlotState,
    _Meta,
)
from kvpool.types import HASH_NBYTES, Clock, InventoryItem, MonotonicClock
from transfer.slot_state import SharedSlotState

log = logging.getLogger(__name__)

_NO_BLOCK = _Meta(b"", b"", b"", 0)
"""What a never-used slot's capability is checked against: no block, so no capability matches."""


def _shared_state(segment: Segment, capabilities: Capabilities | None) -> SharedSlotState | None:
    """The slot state same-host readers may map (transfer/slot_state.py): with a shared segment, and only
    when the store checks no capabilities (with them, every read shows its capability to the store)."""
    if segment.shared is None or capabilities is not None:
        return None
    try:
        return SharedSlotState(segment.num_slots, segment.block_nbytes)
    except OSError as exc:
        log.warning("slot state not shared with same-host readers: %s", exc)
        return None


class SlotTable(SlotDataPlane):
    """The store's slots over one `Segment`; `clock` decides write-lease expiry; `capabilities` (None:
    off) check the capability of every read and write for store node `node_id`."""

    def __init__(
        self,
        segment: Segment,
        clock: Clock | None = None,
        *,
        capabilities: Capabilities | None = None,
        node_id: str = "",
    ) -> None:
        self.segment = segment
        self.capabilities = capabilities
        self.fence = EpochFence(capabilities)
        """The newest master leader epoch seen (`kvpool.store.fence`): older orders and capabilities fail."""
        self.node_id = node_id
        self.block_nbytes = segment.block_nbytes
        self.num_slots = segment.num_slots
        self._clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        n = self.num_slots
        self.shared_state = _shared_state(segment, capabilities)
        if self.shared_state is not None:  # same-host readers see these three (transfer/slot_state.py)
            st = self.shared_state
            self._gen, self._checksum, self._readable = st.generation, st.checksum, st.readable
            self._gen[:] = FIRST_GENERATION
        else:
            self._gen = np.full(n, FIRST_GENERATION, dtype=np.uint64)
            self._checksum = np.zeros(n, dtype=np.uint64)
            self._readable = np.zeros(n, dtype=np.uint8)  # 1: COMMITTED and no free pending
        self._state = np.zeros(n, dtype=np.uint8)
        self._readers = np.zeros(n, dtype=np.int32)
        self._writing = np.zeros(n, dtype=np.bool_)
        self._meta: dict[int, _Meta] = {}  # non-FREE slots only
        # FREE slots' last block, so a capability for an older generation is checked (then refused as
        # stale), and a caller without one learns nothing of the slot (`_check_capability`)
        self._retired: dict[int, _Meta] = {}
        self._free_pending: set[int] = set()
        self._freed: list[tuple[int, int]] = []  # (slot, new generation) not yet reported
        self._num_used = 0
        self.num_inflight = 0

    # ---------------------------------------------------------------- helpers (lock held)

    def _check_slot(self, slot: int) -> None:
        if type(slot) is not int or not 0 <= slot < self.num_slots:  # not a bool, not a numpy scalar
            raise InvalidArgument(f"slot {slot} out of range [0, {self.num_slots})")

    def _check_gen(self, slot: int, generation: int) -> None:
        current = int(self._gen[slot])
        if generation != current:
            raise StaleGeneration(f"slot {slot} is at generation {current}, not {generation}")

    def _check_nbytes(self, nbytes: int) -> None:
        if nbytes != self.block_nbytes:
            raise InvalidArgument(
                f"block size {nbytes} B does not match this store's layout ({self.block_nbytes} B)"
            )

    def _check_capability(
        self, op: str, slot: int, generation: int, capability: bytes, expiry_ms: int
    ) -> None:
        if self.capabilities is None:
            return
        # a slot that never held a block: checked against no block, which no capability names, so the
        # refusal reads exactly like any other's
        meta = self._meta.get(slot) or self._retired.get(slot) or _NO_BLOCK
        self.capabilities.check(
            op,
            meta.namespace,
            meta.block_hash,
            self.node_id,
            slot,
            generation,
            expiry_ms,
            capability,
            self.fence.highest,
        )

    def _in_flight(self, slot: int) -> bool:
        return bool(self._readers[slot] > 0 or self._writing[slot])

    def _release(self, slot: int) -> int:
        """Free `slot` now: bump its generation. Returns the new generation."""
        self._readable[slot] = 0
        if int(self._state[slot]) != _FREE:
            self._num_used -= 1
        self._state[slot] = _FREE
        if (meta := self._meta.pop(slot, None)) is not None:
            self._retired[slot] = meta
        self._free_pending.discard(slot)
        self._gen[slot] += 1
        return int(self._gen[slot])

    def _maybe_finish_free(self, slot: int) -> None:
        if slot in self._free_pending and not self._in_flight(slot):
            self._freed.append((slot, self._release(slot)))

    # ---------------------------------------------------------------- control plane (master)

    def reserve(self, reservations: Sequence[Reservation], write_lease_ms: int) -> None:
        """Reserve every slot or none (raises naming the first bad one)."""
        if write_lease_ms <= 0:
            raise InvalidArgument("write_lease_ms must be positive")
        seen: set[int] = set()
        for r in reservations:
            self._check_slot(r.slot)
            if r.slot in seen:
                raise InvalidArgument(f"slot {r.slot} named twice")
            seen.add(r.slot)
            if len(r.namespace) != HASH_NBYTES or len(r.block_hash) != HASH_NBYTES:
                raise InvalidArgument(f"namespace and block hash must be {HASH_NBYTES} bytes (slot {r.slot})")
            if len(r.parent_hash) not in (0, HASH_NBYTES):
                raise InvalidArgument(f"parent hash must be empty or {HASH_NBYTES} bytes (slot {r.slot})")
        with self._lock:
            expiry = self._clock.now_ms() + write_lease_ms
            for r in reservations:
                state, current = int(self._state[r.slot]), int(self._gen[r.slot])
                if state == _FREE and r.slot not in self._free_pending:
                    if r.generation < current:
                        raise StaleGeneration(f"slot {r.slot} is at generation {current}, not {r.generation}")
                    continue
                meta = self._meta.get(r.slot)
                same = meta is not None and r.generation == current and meta.block_hash == r.block_hash
                if not (same and state == _RESERVED):  # a repeated order renews the lease
                    raise FailedPrecondition(
                        f"slot {r.slot} is {SlotState(state).name} at generation {current}, cannot reserve"
                    )
            for r in reservations:
                if int(self._state[r.slot]) == _FREE:
                    self._gen[r.slot] = r.generation
                    self._state[r.slot] = _RESERVED
                    self._num_used += 1
                self._meta[r.slot] = _Meta(r.namespace, r.block_hash, r.parent_hash, expiry)
                self._retired.pop(r.slot, None)

    def commit(self, refs: Iterable[tuple[int, int]]) -> list[tuple[int, int, str]]:
        """Make WRITTEN slots COMMITTED. Per slot: (slot, generation, error or "")."""
        out = []
        with self._lock:
            for slot, gen in refs:
                try:
                    self._check_slot(slot)
                    self._check_gen(slot, gen)
                    state = int(self._state[slot])
                    if slot in self._free_pending:
                        raise FailedPrecondition(f"slot {slot} is being freed")
                    if state == _WRITTEN:
                        self._state[slot] = _COMMITTED
                        self._readable[slot] = 1
                    elif state != _COMMITTED:  # committed already: idempotent
                        raise FailedPrecondition(f"slot {slot} is {SlotState(state).name}, not written")
                    out.append((slot, gen, ""))
                except (InvalidArgument, FailedPrecondition) as exc:
                    out.append((slot, gen, f"{type(exc).__name__}: {exc}"))
        return out

    def free(self, refs: Iterable[tuple[int, int]]) -> list[FreeResult]:
        """Free slots (deferred while a transfer is in flight). Idempotent: a slot no longer at the named
        generation is left alone and its current generation returned."""
        out = []
        with self._lock:
            for slot, gen in refs:
                self._check_slot(slot)
                current = int(self._gen[slot])
                if gen != current or int(self._state[slot]) == _FREE:
                    out.append(FreeResult(slot, current, False))
                elif self._in_flight(slot):
                    self._free_pending.add(slot)
                    self._readable[slot] = 0
                    out.append(FreeResult(slot, current + 1, True))
                else:
                    out.append(FreeResult(slot, self._release(slot), False))
        return out

    def reap_expired(self) -> int:
        """Reclaim reservations (RESERVED or WRITTEN) whose write lease passed. Returns how many."""
        n = 0
        with self._lock:
            now = self._clock.now_ms()
            for slot, meta in list(self._meta.items()):
                state = int(self._state[slot])
                if state in (_RESERVED, _WRITTEN) and meta.lease_expiry_ms <= now:
                    if self._in_flight(slot):
                        self._free_pending.add(slot)
                    else:
                        self._freed.append((slot, self._release(slot)))
                        n += 1
        return n

    def drain_freed(self) -> list[tuple[int, int]]:
        """(slot, new generation) of deferred frees and reclaimed reservations since the last call."""
        with self._lock:
            out, self._freed = self._freed, []
        return out

    def requeue_freed(self, freed: Sequence[tuple[int, int]]) -> None:
        """Put back what `drain_freed` returned when it could not be reported."""
        with self._lock:
            self._freed[:0] = list(freed)

    def inventory(self) -> list[InventoryItem]:
        with self._lock:
            return [
                InventoryItem(
                    m.namespace,
                    m.block_hash,
                    m.parent_hash,
                    s,
                    int(self._gen[s]),
                    int(self._checksum[s]),
                    self.block_nbytes,
                )
                for s, m in sorted(self._meta.items())
                if int(self._state[s]) == _COMMITTED and s not in self._free_pending
            ]

    @property
    def num_used(self) -> int:
        return self._num_used

    def state(self, slot: int) -> tuple[SlotState, int]:
        """(state, generation) of one slot (tests, admin)."""
        with self._lock:
            self._check_slot(slot)
            return SlotState(int(self._state[slot])), int(self._gen[slot])
