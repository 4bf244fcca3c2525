"""A store's disk slots served as its memory slots are: reserved by the master, written over the data plane,
committed, read, freed, with the same generations, capabilities, leases and deferred frees
(`kvpool.store.slots.SlotTable` routes every slot number at or above the tier's `first_slot` here).

Rules:
- The bytes of a disk block never lie in the segment: a write lands in a page-aligned bounce buffer of its
  own (`begin_write`) and goes to disk when the master commits it (`commit`, on a gRPC thread: the write, then
  its record, `kvpool.store.disk_tier`); a read (`begin_reads`) fills a bounce buffer from disk, checked
  against the recorded checksum, and the server sends from it. So disk slots never appear in the same-host
  shared slot state, and the data plane server begins disk reads off its event loop (`blocking_slots_from`).
- Generations are the tier's (they persist: a restart starts every slot above all of the previous boot's),
  so a location from before a restart is refused. A reservation of a free disk slot may name a generation
  above the current one, never one below (as for memory).
- Bounce buffers are bounded (`max_buffer_bytes`): a read or write that would pass the bound is refused
  with `ResourceExhausted` (the reader tries another replica or recomputes).
- A free of a slot with a transfer in flight is deferred until the last one ends, then reported through
  `drain_freed` (as for memory). Tier faults (ENOSPC, EIO, a damaged block) fail the block, never the call.

Per-slot state of committed blocks is the tier's numpy columns; only slots with something in flight
(reserved, being read) have an entry here, bounded by the bounce budget and the reservations outstanding.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpool.capability import Capabilities
from kvpool.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    StaleGeneration,
    Unavailable,
)
from kvpool.store.disk_io import aligned_empty
from kvpool.store.disk_serving_io import DiskDataPlane, Pending, tier_error  # noqa: F401 - API
from kvpool.store.disk_tier import DiskTier
from kvpool.store.fence import EpochFence
from kvpool.store.slot_types import FreeResult, Reservation
from kvpool.types import Clock, DiskTierReport

log = logging.getLogger(__name__)


class DiskSlots(DiskDataPlane):
    """The disk tier `tier` served as slots. Thread-safe (one lock for the in-flight state; the tier has its
    own). `fence` is the slot table's (capabilities of an older leader are refused here too)."""

    def __init__(
        self,
        tier: DiskTier,
        clock: Clock,
        *,
        capabilities: Capabilities | None,
        node_id: str,
        fence: EpochFence,
        max_buffer_bytes: int = 256 << 20,
    ) -> None:
        self.tier = tier
        self.first_slot = tier.first_slot
        self.num_slots = tier.num_slots
        self.block_nbytes = tier.block_nbytes
        self.capabilities = capabilities
        self.node_id = node_id
        self.fence = fence
        self.max_buffer_bytes = max_buffer_bytes
        self.buffer_bytes = 0
        self.num_inflight = 0
        self.refused_reads = 0  # reads refused for damaged bytes or a failed disk (never served)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._readers: dict[int, int] = {}
        self._freeing: set[int] = set()  # committed slots whose free waits for their readers
        self._freed: list[tuple[int, int]] = []
        self._background = ThreadPoolExecutor(1, thread_name_prefix="kvpool-disk-free")

    # ---------------------------------------------------------------- helpers

    def owns(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.num_slots

    def _check_slot(self, slot: int) -> None:
        if type(slot) is not int or not self.owns(slot):
            raise InvalidArgument(
                f"slot {slot} out of range [{self.first_slot}, {self.first_slot + self.num_slots})"
            )

    def generation(self, slot: int) -> int:
        return int(self.tier.gen[slot - self.first_slot])

    def _block_of(self, slot: int) -> tuple[bytes, bytes, bytes]:
        p = self._pending.get(slot)
        if p is not None:
            return p.namespace, p.block_hash, p.parent_hash
        return self.tier.block_of(slot)

    def _check_capability(self, op: str, slot: int, gen: int, capability: bytes, expiry_ms: int) -> None:
        if self.capabilities is None:
            return
        ns, h, _ = self._block_of(slot)
        self.capabilities.check(op, ns, h, self.node_id, slot, gen, expiry_ms, capability, self.fence.highest)

    def _take_buffer(self, n: int) -> np.ndarray:
        nbytes = n * self.tier.slot_nbytes
        if self.buffer_bytes + nbytes > self.max_buffer_bytes:
            raise ResourceExhausted(
                f"disk tier bounce buffers full ({self.buffer_bytes} of {self.max_buffer_bytes} bytes)"
            )
        self.buffer_bytes += nbytes
        return aligned_empty(nbytes).reshape(n, self.tier.slot_nbytes)

    def _give_buffer(self, n: int) -> None:
        self.buffer_bytes -= n * self.tier.slot_nbytes

    def _tier_free(self, slot: int, gen: int) -> int:
        """Free the tier's slot at `gen` (a reserved or committed one); its new generation."""
        self.tier.free(np.array([slot]), np.array([gen], dtype=np.uint64))
        return self.generation(slot)

    def _finish_later(self, slot: int, gen: int) -> None:
        """A deferred free whose last transfer ended: done on a background thread (tier I/O), reported."""

        def run() -> None:
            new = self._tier_free(slot, gen)
            with self._lock:
                self._freed.append((slot, new))

        self._background.submit(run)

    # ---------------------------------------------------------------- control plane (master)

    def check_reserve(self, r: Reservation) -> bool:
        """Whether reservation `r` is new (True) or repeats a live one (False: renew). Raises as
        `SlotTable.reserve` does. Lock held by the caller (`reserve`)."""
        self._check_slot(r.slot)
        current = self.generation(r.slot)
        p = self._pending.get(r.slot)
        if p is not None:
            if p.generation == r.generation and p.block_hash == r.block_hash and not p.internal:
                return False
            raise FailedPrecondition(f"disk slot {r.slot} is reserved at generation {p.generation}")
        if self.tier.is_committed(r.slot) or r.slot in self._freeing:
            raise FailedPrecondition(f"disk slot {r.slot} holds a block at generation {current}")
        if r.generation < current:
            raise StaleGeneration(f"disk slot {r.slot} is at generation {current}, not {r.generation}")
        if self.tier.degraded:
            raise Unavailable(f"disk tier degraded ({self.tier.degraded})")
        return True

    def reserve(self, reservations: Sequence[Reservation], write_lease_ms: int) -> None:
        """Reserve every disk slot or none (the caller checked the fields)."""
        with self._lock:
            fresh = [self.check_reserve(r) for r in reservations]
            expiry = self._clock.now_ms() + write_lease_ms
            up = [r for r, f in zip(reservations, fresh, strict=True) if f]
            if up:
                self.tier.advance(
                    np.array([r.slot for r in up]), np.array([r.generation for r in up], dtype=np.uint64)
                )
            for r, f in zip(reservations, fresh, strict=True):
                if f:
                    self._pending[r.slot] = Pending(
                        r.generation, r.namespace, r.block_hash, r.parent_hash, expiry
                    )
                else:
                    self._pending[r.slot].expiry_ms = expiry

    def claim(self, slot: int, gen: int, namespace: bytes, block_hash: bytes, parent_hash: bytes) -> None:
        """Hold a free disk slot at `gen` (or above its current generation) as a tier move's destination
        (`release_claim` ends it). Raises as `reserve`."""
        r = Reservation(slot, gen, namespace, block_hash, parent_hash)
        with self._lock:
            self.check_reserve(r)
            self.tier.advance(np.array([slot]), np.array([gen], dtype=np.uint64))
            self._pending[slot] = Pending(gen, namespace, block_hash, parent_hash, 0, internal=True)

    def release_claim(self, slot: int) -> bool:
        """End a claim; True when a free order came for it meanwhile (its destination must be discarded)."""
        with self._lock:
            p = self._pending.pop(slot, None)
            return p is not None and p.freeing

    def discard(self, slot: int, gen: int) -> int:
        """Free a tier move's destination at `gen` (written or not) and report it (`drain_freed`); its new
        generation."""
        new = self._tier_free(slot, gen)
        with self._lock:
            self._freed.append((slot, new))
        return new

    def commit(self, refs: Sequence[tuple[int, int]]) -> list[tuple[int, int, str]]:
        """Write the WRITTEN disk slots `refs` to disk (and record them): per slot (slot, generation, error
        or ""). A committed slot at that generation is committed already (idempotent)."""
        errors = [""] * len(refs)
        take: list[tuple[int, Pending]] = []
        with self._lock:
            for i, (slot, gen) in enumerate(refs):
                try:
                    self._check_slot(slot)
                    current = self.generation(slot)
                    if gen != current:
                        raise StaleGeneration(f"disk slot {slot} is at generation {current}, not {gen}")
                    p = self._pending.get(slot)
                    if p is None:
                        if not self.tier.is_committed(slot) or slot in self._freeing:
                            raise FailedPrecondition(f"disk slot {slot} is not written")
                        continue
                    if p.freeing or p.internal or not p.written or p.writing:
                        raise FailedPrecondition(f"disk slot {slot} is not written")
                    del self._pending[slot]  # this commit owns it now
                    take.append((i, p))
                except (InvalidArgument, FailedPrecondition) as exc:
                    errors[i] = f"{type(exc).__name__}: {exc}"
        if take:
            self._write(refs, take, errors)
        return [(s, g, e) for (s, g), e in zip(refs, errors, strict=True)]

    def _write(
        self, refs: Sequence[tuple[int, int]], take: list[tuple[int, Pending]], errors: list[str]
    ) -> None:
        nb = self.block_nbytes
        blocks = np.stack([p.buf[:nb] for _, p in take if p.buf is not None])
        slots = np.array([refs[i][0] for i, _ in take], dtype=np.int64)
        gens = np.array([p.generation for _, p in take], dtype=np.uint64)
        hashes = np.frombuffer(b"".join(p.block_hash for _, p in take), dtype=np.uint8).reshape(-1, 16)
        parents = np.frombuffer(
            b"".join(p.parent_hash or bytes(16) for _, p in take), dtype=np.uint8
        ).reshape(-1, 16)
        has_parent = np.array([bool(p.parent_hash) for _, p in take])
        sums = np.array([p.checksum for _, p in take], dtype=np.uint64)
        got = self.tier.write(
            slots, gens, blocks, [p.namespace for _, p in take], hashes, parents, has_parent, sums
        )
        with self._lock:
            self._give_buffer(len(take))
        for (i, _), err in zip(take, got, strict=True):
            errors[i] = err  # a failed block: nothing recorded, the slot free at its generation

    def free(self, refs: Sequence[tuple[int, int]]) -> list[FreeResult]:
        """Free disk slots (deferred while a transfer is in flight); idempotent as `SlotTable.free`."""
        out = []
        for slot, gen in refs:
            self._check_slot(slot)
            with self._lock:
                current = self.generation(slot)
                p = self._pending.get(slot)
                if gen != current or slot in self._freeing:
                    out.append(FreeResult(slot, current + (slot in self._freeing), slot in self._freeing))
                    continue
                if p is not None:
                    if p.writing or p.internal:
                        p.freeing = True
                        out.append(FreeResult(slot, current + 1, True))
                        continue
                    del self._pending[slot]
                    if p.buf is not None:
                        self._give_buffer(1)
                elif not self.tier.is_committed(slot):
                    out.append(FreeResult(slot, current, False))
                    continue
                elif self._readers.get(slot):
                    self._freeing.add(slot)
                    out.append(FreeResult(slot, current + 1, True))
                    continue
            out.append(FreeResult(slot, self._tier_free(slot, gen), False))
        return out

    def reap_expired(self) -> int:
        """Reclaim disk reservations whose write lease passed (one being written: when the write ends)."""
        now = self._clock.now_ms()
        gone = []
        with self._lock:
            for slot, p in list(self._pending.items()):
                if p.internal or p.expiry_ms > now or p.freeing:
                    continue
                if p.writing:
                    p.freeing = True
                    continue
                del self._pending[slot]
                if p.buf is not None:
                    self._give_buffer(1)
                gone.append((slot, p.generation))
        for slot, gen in gone:
            new = self._tier_free(slot, gen)
            with self._lock:
                self._freed.append((slot, new))
        return len(gone)

    def drain_freed(self) -> list[tuple[int, int]]:
        with self._lock:
            out, self._freed = self._freed, []
        return out

    @property
    def num_reserved(self) -> int:
        return len(self._pending)

    def report(self) -> DiskTierReport:
        """The tier as the store reports it (`GetInfo`, heartbeats)."""
        t = self.tier
        alpha, beta = t.alpha_beta or (float("nan"), float("nan"))
        return DiskTierReport(
            first_slot=t.first_slot,
            num_slots=t.num_slots,
            block_nbytes=t.block_nbytes,
            num_used_slots=t.counters.resident_blocks,
            num_reserved_slots=len(self._pending),
            first_generation=t.first_generation,
            alpha_s=alpha,
            beta_s_per_byte=beta,
            degraded=t.degraded or "",
            direct=t.direct,
            recovered_blocks=t.num_recovered,
        )
