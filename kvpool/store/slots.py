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

Per-slot state lives in numpy columns sized to the segment, with no Python object per slot (about 60
bytes a slot: state, flags, readers, generation, checksum, readable here; namespace, hashes and write lease
in kvpool/store/slot_columns.py); `reap_expired` and `inventory_batch` are array operations.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from kvpool.capability import CAPABILITY_NBYTES, Capabilities, capability_epoch
from kvpool.errors import (
    FailedPrecondition,
    InvalidArgument,
    StaleGeneration,
)
from kvpool.store.disk_serving import DiskSlots
from kvpool.store.disk_tier import DiskTier
from kvpool.store.fence import EpochFence
from kvpool.store.segment import Segment
from kvpool.store.slot_columns import MAX_WRITE_LEASE_MS, SlotColumns
from kvpool.store.slot_io import SlotDataPlane
from kvpool.store.slot_moves import MoveSlots
from kvpool.store.slot_types import (  # noqa: F401 - FIRST_GENERATION, Reservation: this module's API
    _COMMITTED,
    _FREE,
    _FREEING,
    _RESERVED,
    _WRITING,
    _WRITTEN,
    FIRST_GENERATION,
    FreeResult,
    Reservation,
    SlotState,
)
from kvpool.types import (
    HASH_NBYTES,
    MEDIUM_DISK,
    MEDIUM_MEMORY,
    Clock,
    InventoryBatch,
    InventoryItem,
    MonotonicClock,
    with_medium,
)
from transfer.slot_state import SharedSlotState

log = logging.getLogger(__name__)

_NEVER_MS = 1 << 63
_NOT_FREEING = 0xFF ^ _FREEING
_INVENTORY_ALL = 1 << 62


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


class SlotTable(SlotDataPlane, MoveSlots):
    """The store's slots over one `Segment`; `clock` decides write-lease expiry; `capabilities` (None:
    off) check the capability of every read and write for store node `node_id`."""

    def __init__(
        self,
        segment: Segment,
        clock: Clock | None = None,
        *,
        capabilities: Capabilities | None = None,
        node_id: str = "",
        metadata_only: bool = False,
        disk: DiskTier | None = None,
        disk_buffer_bytes: int = 256 << 20,
    ) -> None:
        self.segment = segment
        self.metadata_only = metadata_only
        """A benchmark's table (`kvpool store --metadata-only`): a commit needs no write, and every read and
        write of bytes is refused (`FailedPrecondition`), so no reader ever gets bytes nobody wrote."""
        self.capabilities = capabilities
        self.fence = EpochFence(capabilities)
        """The newest master leader epoch seen (`kvpool.store.fence`): older orders and capabilities fail."""
        self.node_id = node_id
        self.block_nbytes = segment.block_nbytes
        self.num_slots = segment.num_slots
        self._clock = clock or MonotonicClock()
        self._lock = threading.Lock()
        n = self.num_slots
        self.shared_state = None if metadata_only else _shared_state(segment, capabilities)
        if self.shared_state is not None:  # same-host readers see these three (transfer/slot_state.py)
            st = self.shared_state
            self._gen, self._checksum, self._readable = st.generation, st.checksum, st.readable
            self._gen[:] = FIRST_GENERATION
        else:
            self._gen = np.full(n, FIRST_GENERATION, dtype=np.uint64)
            self._checksum = np.zeros(n, dtype=np.uint64)
            self._readable = np.zeros(n, dtype=np.uint8)  # 1: COMMITTED and no free pending
        self._state = np.zeros(n, dtype=np.uint8)
        # _WRITING | _FREEING | _HAS_PARENT (slot_types.py): one slot's through the bytearray (a tenth of a
        # microsecond a bit, a quarter of a numpy scalar's), many at once through its array view
        self._flag_bytes = bytearray(n)
        self._flags = np.frombuffer(self._flag_bytes, dtype=np.uint8)
        self._readers = np.zeros(n, dtype=np.int32)
        # the block each slot holds, or held last when FREE (so a capability for an older generation is
        # checked, then refused as stale, and a caller without one learns nothing of the slot), its lease
        self._cols = SlotColumns(n, self._clock.now_ms())
        self._next_expiry_ms = _NEVER_MS  # no write lease ends before this (`reap_expired` skips till then)
        self._freed: list[tuple[int, int]] = []  # (slot, new generation) not yet reported
        self._num_used = 0
        self.num_inflight = 0
        self.disk: DiskSlots | None = None
        """The disk tier's slots (`kvpool.store.disk_serving`): every slot number from its `first_slot` on."""
        self.blocking_slots_from: int | None = None
        """Reads of slots from this one on block on disk I/O (`transfer.BlockHandler`): begun off the loop."""
        if disk is not None:
            self.disk = DiskSlots(
                disk,
                self._clock,
                capabilities=capabilities,
                node_id=node_id,
                fence=self.fence,
                max_buffer_bytes=disk_buffer_bytes,
            )
            self.blocking_slots_from = disk.first_slot

    # ---------------------------------------------------------------- helpers (lock held)

    def _on_disk(self, slot: int) -> bool:
        return self.disk is not None and type(slot) is int and slot >= self.disk.first_slot

    def _split(self, refs: Iterable[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[int]]:
        """`refs` as a list and the positions of its disk slots."""
        refs = list(refs)
        if self.disk is None:
            return refs, []
        first = self.disk.first_slot
        return refs, [i for i, (s, _) in enumerate(refs) if type(s) is int and s >= first]

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
        # a slot that never held a block: checked against no block (b""), which no capability names, so
        # the refusal reads exactly like any other's
        namespace, block_hash = self._cols.block_of(slot)
        self.capabilities.check(
            op,
            namespace,
            block_hash,
            self.node_id,
            slot,
            generation,
            expiry_ms,
            capability,
            self.fence.highest,
        )
        if len(capability) > CAPABILITY_NBYTES:  # valid, so minted by a leader at its epoch: a proof of it
            self.fence.observe(capability_epoch(capability), proven=True)

    def _in_flight(self, slot: int) -> bool:
        return bool(self._flag_bytes[slot] & _WRITING or self._readers[slot] > 0)

    def _freeing(self, slot: int) -> bool:
        return bool(self._flag_bytes[slot] & _FREEING)

    def _lease_expiry_ms(self, slot: int) -> int:
        return self._cols.lease_base_ms + int(self._cols.lease[slot])

    def _release(self, slot: int) -> int:
        """Free `slot` now: bump its generation. Returns the new generation."""
        self._readable[slot] = 0
        if int(self._state[slot]) != _FREE:
            self._num_used -= 1
        self._state[slot] = _FREE
        self._flag_bytes[slot] &= _NOT_FREEING
        self._gen[slot] += 1
        return int(self._gen[slot])

    def _release_all(self, slots: np.ndarray) -> np.ndarray:
        """`_release` of distinct `slots` at once. Returns their new generations (uint64)."""
        self._readable[slots] = 0
        self._num_used -= int(np.count_nonzero(self._state[slots] != _FREE))
        self._state[slots] = _FREE
        self._flags[slots] &= np.uint8(_NOT_FREEING)
        self._gen[slots] += np.uint64(1)
        return self._gen[slots]

    def _maybe_finish_free(self, slot: int) -> None:
        if self._freeing(slot) and not self._in_flight(slot):
            self._freed.append((slot, self._release(slot)))

    # ---------------------------------------------------------------- control plane (master)

    def reserve(self, reservations: Sequence[Reservation], write_lease_ms: int) -> None:
        """Reserve every slot or none (raises naming the first bad one)."""
        if not 0 < write_lease_ms <= MAX_WRITE_LEASE_MS:
            raise InvalidArgument(f"write_lease_ms must be in (0, {MAX_WRITE_LEASE_MS}]")
        seen: set[int] = set()
        on_disk: list[Reservation] = []
        for r in reservations:
            if self._on_disk(r.slot):
                on_disk.append(r)
            else:
                self._check_slot(r.slot)
            if r.slot in seen:
                raise InvalidArgument(f"slot {r.slot} named twice")
            seen.add(r.slot)
            if type(r.generation) is not int or not 0 <= r.generation < 1 << 64:
                raise InvalidArgument(f"generation {r.generation} of slot {r.slot} is not a uint64")
            if len(r.namespace) != HASH_NBYTES or len(r.block_hash) != HASH_NBYTES:
                raise InvalidArgument(f"namespace and block hash must be {HASH_NBYTES} bytes (slot {r.slot})")
            if len(r.parent_hash) not in (0, HASH_NBYTES):
                raise InvalidArgument(f"parent hash must be empty or {HASH_NBYTES} bytes (slot {r.slot})")
        if on_disk:  # all-or-none per medium: the disk's first (a master orders one medium per call)
            assert self.disk is not None
            self.disk.reserve(on_disk, write_lease_ms)
            reservations = [r for r in reservations if not self._on_disk(r.slot)]
        if not reservations:
            return
        with self._lock:
            for r in reservations:
                state, current = int(self._state[r.slot]), int(self._gen[r.slot])
                if state == _FREE:  # a slot with a free pending is never FREE
                    if r.generation < current:
                        raise StaleGeneration(f"slot {r.slot} is at generation {current}, not {r.generation}")
                    continue
                same = r.generation == current and self._cols.block_of(r.slot)[1] == r.block_hash
                if not (same and state == _RESERVED):  # a repeated order renews the lease
                    raise FailedPrecondition(
                        f"slot {r.slot} is {SlotState(state).name} at generation {current}, cannot reserve"
                    )
            now = self._clock.now_ms()
            slots = np.fromiter((r.slot for r in reservations), dtype=np.int64, count=len(reservations))
            fresh = self._state[slots] == _FREE
            self._gen[slots[fresh]] = np.array(
                [r.generation for r, f in zip(reservations, fresh.tolist(), strict=True) if f],
                dtype=np.uint64,
            )
            self._state[slots[fresh]] = _RESERVED
            self._num_used += int(np.count_nonzero(fresh))
            cols = self._cols
            cols.set_blocks(
                slots,
                [r.namespace for r in reservations],
                [r.block_hash for r in reservations],
                [r.parent_hash for r in reservations],
                self._flags,
            )
            cols.lease[slots] = cols.lease_until(now, write_lease_ms)
            self._next_expiry_ms = min(self._next_expiry_ms, now + write_lease_ms)

    def commit(self, refs: Iterable[tuple[int, int]]) -> list[tuple[int, int, str]]:
        """Make WRITTEN slots COMMITTED (disk slots: written to disk and recorded first; metadata-only:
        RESERVED ones too, with no bytes). Per slot: (slot, generation, error or "")."""
        refs, on_disk = self._split(refs)
        if on_disk:
            assert self.disk is not None
            disk = self.disk.commit([refs[i] for i in on_disk])
            mem = self.commit([r for i, r in enumerate(refs) if i not in set(on_disk)])
            merged = dict(zip(on_disk, disk, strict=True))
            it = iter(mem)
            return [merged[i] if i in merged else next(it) for i in range(len(refs))]
        out = []
        with self._lock:
            for slot, gen in refs:
                try:
                    self._check_slot(slot)
                    self._check_gen(slot, gen)
                    state = int(self._state[slot])
                    if self._freeing(slot):
                        raise FailedPrecondition(f"slot {slot} is being freed")
                    if state == _WRITTEN or (
                        self.metadata_only and state == _RESERVED and not self._flag_bytes[slot] & _WRITING
                    ):
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
        refs, on_disk = self._split(refs)
        if on_disk:
            assert self.disk is not None
            disk_out = self.disk.free([refs[i] for i in on_disk])
            mem_out = self.free([r for i, r in enumerate(refs) if i not in set(on_disk)])
            merged = dict(zip(on_disk, disk_out, strict=True))
            it = iter(mem_out)
            return [merged[i] if i in merged else next(it) for i in range(len(refs))]
        out = []
        with self._lock:
            for slot, gen in refs:
                self._check_slot(slot)
                current = int(self._gen[slot])
                if gen != current or int(self._state[slot]) == _FREE:
                    out.append(FreeResult(slot, current, False))
                elif self._in_flight(slot):
                    self._flag_bytes[slot] |= _FREEING
                    self._readable[slot] = 0
                    out.append(FreeResult(slot, current + 1, True))
                else:
                    out.append(FreeResult(slot, self._release(slot), False))
        return out

    def reap_expired(self) -> int:
        """Reclaim reservations (RESERVED or WRITTEN) whose write lease passed; one with a transfer in flight
        is freed when the transfer ends. Returns how many were reclaimed now. Array operations over all
        slots, and only once a lease may have ended (the earliest expiry is kept); then the disk slots'."""
        return self._reap_memory() + (self.disk.reap_expired() if self.disk is not None else 0)

    def _reap_memory(self) -> int:
        with self._lock:
            now = self._clock.now_ms()
            if now < self._next_expiry_ms:
                return 0
            # RESERVED or WRITTEN: state - RESERVED is 0 or 1 (FREE wraps round to 255)
            leased = np.flatnonzero((self._state - np.uint8(_RESERVED)) <= _WRITTEN - _RESERVED)
            ended = self._cols.expired(leased, now)
            live = self._cols.lease[leased[~ended]]
            self._next_expiry_ms = self._cols.lease_base_ms + int(live.min()) if len(live) else _NEVER_MS
            ended_slots = leased[ended]
            busy = (self._readers[ended_slots] > 0) | ((self._flags[ended_slots] & _WRITING) != 0)
            self._flags[ended_slots[busy]] |= np.uint8(_FREEING)
            gone = ended_slots[~busy]
            if len(gone):
                self._freed.extend(zip(gone.tolist(), self._release_all(gone).tolist(), strict=True))
        return len(gone)

    def drain_freed(self) -> list[tuple[int, int]]:
        """(slot, new generation) of deferred frees and reclaimed reservations since the last call."""
        with self._lock:
            out, self._freed = self._freed, []
        return out + (self.disk.drain_freed() if self.disk is not None else [])

    def requeue_freed(self, freed: Sequence[tuple[int, int]]) -> None:
        """Put back what `drain_freed` returned when it could not be reported."""
        with self._lock:
            self._freed[:0] = list(freed)

    def inventory_batch(self, after_slot: int, limit: int) -> InventoryBatch:
        """The committed blocks (no free pending) in slots ≥ `after_slot`, in slot order, at most `limit`
        (> 0) of them, as columns; `next_slot` is the slot after the last one returned, or -1 when no
        committed block follows. With a disk tier, memory slots come first, then (from the tier's
        `first_slot`, a batch never mixing the two) its committed, verified blocks; `medium` says which. Raises `InvalidArgument` on a negative `after_slot` or a `limit` < 1."""
        if type(after_slot) is not int or after_slot < 0:
            raise InvalidArgument(f"after_slot must be a non-negative int, not {after_slot!r}")
        if type(limit) is not int or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, not {limit!r}")
        disk = self.disk
        if disk is not None and after_slot >= disk.first_slot:
            return with_medium(disk.tier.inventory_batch(after_slot, limit), MEDIUM_DISK)
        with self._lock:
            batch = self._inventory_batch(after_slot, limit)
        if disk is not None and batch.next_slot < 0:  # the disk's blocks follow
            batch = dataclasses.replace(batch, next_slot=disk.first_slot)
        return with_medium(batch, MEDIUM_MEMORY)

    def _inventory_batch(self, after_slot: int, limit: int) -> InventoryBatch:
        # readable == COMMITTED with no free pending (`commit` sets it, a free or release clears it)
        idx, next_slot = SlotColumns.find(self._readable, after_slot, limit)
        return self._cols.batch(idx, next_slot, self._gen, self._checksum, self._flags, self.block_nbytes)

    def inventory(self) -> list[InventoryItem]:
        """Every committed block, in slot order (one snapshot; `inventory_batch` streams them as columns)."""
        with self._lock:
            b = self._inventory_batch(0, _INVENTORY_ALL)
        hashes, parents, nb = b.block_hashes.tobytes(), b.parent_hashes.tobytes(), HASH_NBYTES
        return [
            InventoryItem(
                b.namespaces[k],
                hashes[i * nb : i * nb + nb],
                parents[i * nb : i * nb + nb] if has else b"",
                s,
                g,
                c,
                self.block_nbytes,
            )
            for i, (k, has, s, g, c) in enumerate(
                zip(
                    b.ns_index.tolist(),
                    b.has_parent.tolist(),
                    b.slots.tolist(),
                    b.generations.tolist(),
                    b.checksums.tolist(),
                    strict=True,
                )
            )
        ]

    @property
    def num_used(self) -> int:
        return self._num_used

    def state(self, slot: int) -> tuple[SlotState, int]:
        """(state, generation) of one slot (tests, admin)."""
        with self._lock:
            self._check_slot(slot)
            return SlotState(int(self._state[slot])), int(self._gen[slot])
