"""Moves of blocks between a store's tiers on the master's orders: `DemoteBlocks` (a committed memory block
into a free disk slot) and `PromoteBlocks` (a committed disk block into a free memory slot).

Rules:
- The master picks both ends: the source at the generation it indexes, the destination a slot of the other
  medium at the generation it believes current (or above it, never below). The store copies the bytes with
  the block's record (namespace, hash, parent, checksum) and answers per move: `OK` (the destination holds
  the block at the generation answered), `STALE` (the source's generation moved, or a free order came for
  either end during the move: the destination is freed, its new generation answered and reported in a
  heartbeat), or `FAILED` (the destination could not be taken or written, the disk failed, the bytes did not
  match their checksum: the destination is left free at the generation answered).
- The source is pinned as a read is, so its free waits for the copy, and is never freed by the move: after
  `OK` the master switches the block's replica (or adds one) and frees the source itself.
- Orders run on one worker thread, off the gRPC threads' hot path and off the data plane's loop, in batches;
  the queue is bounded in blocks: an order that would pass the bound is refused at once with
  `ResourceExhausted` (the master drops or retries it). An order whose deadline passed before it began is
  answered `FAILED` without touching either end.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from kvpool.store.disk_io import aligned_empty
from kvpool.store.disk_serving import DiskSlots
from kvpool.store.slots import SlotTable

log = logging.getLogger(__name__)

BATCH_BLOCKS = 64
"""Moves done per disk call (one batched write or read)."""


class MoveStatus(enum.IntEnum):
    """A move's outcome (the values of proto `TierMoveStatus`)."""

    OK = 1
    FAILED = 2
    STALE = 3


@dataclass(frozen=True, slots=True)
class MoveResult:
    """One move's answer: the source, the destination and its generation now, the outcome, why not OK."""

    src_slot: int
    src_generation: int
    dst_slot: int
    dst_generation: int
    status: MoveStatus
    error: str = ""


Move = tuple[int, int, int, int]
"""(source slot, source generation, destination slot, destination generation)."""


@dataclass
class _Order:
    demote: bool
    moves: list[Move]
    deadline_s: float | None
    future: Future[list[MoveResult]]


@dataclass
class MoveCounters:
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    stale_moves: int = 0
    failed_moves: int = 0
    refused_orders: int = 0  # orders refused because the queue was full


class TierMoves:
    """The store's tier moves over `table` (which has a disk tier). `max_queued_blocks`: the queue's bound."""

    def __init__(self, table: SlotTable, *, max_queued_blocks: int = 8192) -> None:
        if table.disk is None:
            raise InvalidArgument("tier moves need a disk tier")
        self.table = table
        self.disk: DiskSlots = table.disk
        self.max_queued_blocks = max_queued_blocks
        self.queued_blocks = 0
        self.counters = MoveCounters()
        self._orders: deque[_Order] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kvpool-tier-moves", daemon=True)
        self._worker.start()

    def submit(
        self, *, demote: bool, moves: list[Move], deadline_s: float | None
    ) -> Future[list[MoveResult]]:
        """Queue an order (`deadline_s`: `time.monotonic()` after which it is not begun). Raises
        `ResourceExhausted` when the queue cannot take it, `Unavailable` once closed."""
        fut: Future[list[MoveResult]] = Future()
        with self._cv:
            if self._closed:
                raise Unavailable("the store is stopping")
            if self.queued_blocks + len(moves) > self.max_queued_blocks:
                self.counters.refused_orders += 1
                raise ResourceExhausted(
                    f"tier move queue full: {self.queued_blocks} blocks queued, at most "
                    f"{self.max_queued_blocks}; order of {len(moves)} refused"
                )
            self.queued_blocks += len(moves)
            self._orders.append(_Order(demote, moves, deadline_s, fut))
            self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join(10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._orders and not self._closed:
                    self._cv.wait()
                if not self._orders:
                    return
                order = self._orders.popleft()
            try:
                if order.deadline_s is not None and time.monotonic() > order.deadline_s:
                    out = [
                        MoveResult(
                            s, g, d, dg, MoveStatus.FAILED, "the order's deadline passed before it began"
                        )
                        for s, g, d, dg in order.moves
                    ]
                else:
                    run = self._demote if order.demote else self._promote
                    out = []
                    for a in range(0, len(order.moves), BATCH_BLOCKS):
                        out.extend(run(order.moves[a : a + BATCH_BLOCKS]))
                self._count(out, order.demote)
                order.future.set_result(out)
            except Exception as exc:  # noqa: BLE001 - the worker never dies; the order hears why
                log.exception("tier move failed")
                order.future.set_exception(exc)
            finally:
                with self._cv:
                    self.queued_blocks -= len(order.moves)

    def _count(self, out: list[MoveResult], demote: bool) -> None:
        c = self.counters
        ok = sum(r.status == MoveStatus.OK for r in out)
        if demote:
            c.demoted_blocks += ok
        else:
            c.promoted_blocks += ok
        c.stale_moves += sum(r.status == MoveStatus.STALE for r in out)
        c.failed_moves += sum(r.status == MoveStatus.FAILED for r in out)

    # ---------------------------------------------------------------- memory -> disk

    def _demote(self, moves: list[Move]) -> list[MoveResult]:
        disk, table = self.disk, self.table
        res: list[MoveResult | None] = [None] * len(moves)
        pins = table.pin_sources([(s, g) for s, g, _, _ in moves])
        pinned = [i for i, p in enumerate(pins) if not isinstance(p, str)]
        claimed = []
        for i, p in enumerate(pins):
            s, g, d, dg = moves[i]
            if isinstance(p, str):
                status = MoveStatus.FAILED if p.startswith("InvalidArgument") else MoveStatus.STALE
                res[i] = MoveResult(s, g, d, dg, status, f"source: {p}")
                continue
            try:
                disk.claim(d, dg, p[2], p[3], p[4])
                claimed.append(i)
            except (InvalidArgument, FailedPrecondition, Unavailable) as exc:
                cur = disk.generation(d) if disk.owns(d) else dg
                res[i] = MoveResult(
                    s, g, d, cur, MoveStatus.FAILED, f"destination: {type(exc).__name__}: {exc}"
                )
        errors = [""] * len(claimed)
        if claimed:
            src = [pins[i] for i in claimed]
            blocks = np.stack([np.frombuffer(p[0], dtype=np.uint8) for p in src if not isinstance(p, str)])
            meta = [p for p in src if not isinstance(p, str)]
            errors = disk.tier.write(
                np.array([moves[i][2] for i in claimed], dtype=np.int64),
                np.array([moves[i][3] for i in claimed], dtype=np.uint64),
                blocks,
                [m[2] for m in meta],
                _hashes([m[3] for m in meta]),
                _hashes([m[4] or bytes(16) for m in meta]),
                np.array([bool(m[4]) for m in meta]),
                np.array([m[1] for m in meta], dtype=np.uint64),
            )
        moved = table.unpin_sources([moves[i][0] for i in pinned])
        stale_src = dict(zip(pinned, moved, strict=True))
        for i, err in zip(claimed, errors, strict=True):
            s, g, d, dg = moves[i]
            freed = disk.release_claim(d)
            if err:
                new = disk.discard(d, dg) if freed else disk.generation(d)
                res[i] = MoveResult(s, g, d, new, MoveStatus.FAILED, err)
            elif stale_src[i] or freed:
                why = "the source was freed" if stale_src[i] else "the destination was freed"
                res[i] = MoveResult(s, g, d, disk.discard(d, dg), MoveStatus.STALE, f"{why} during the move")
            else:
                res[i] = MoveResult(s, g, d, dg, MoveStatus.OK)
        return [r for r in res if r is not None]

    # ---------------------------------------------------------------- disk -> memory

    def _promote(self, moves: list[Move]) -> list[MoveResult]:
        disk, table, tier = self.disk, self.table, self.disk.tier
        res: list[MoveResult | None] = [None] * len(moves)
        pins = disk.pin_many([(s, g) for s, g, _, _ in moves])
        pinned = [i for i, e in enumerate(pins) if not e]
        claimed: list[tuple[int, memoryview, int]] = []
        for i, err in enumerate(pins):
            s, g, d, dg = moves[i]
            if err:
                status = MoveStatus.FAILED if err.startswith("InvalidArgument") else MoveStatus.STALE
                res[i] = MoveResult(s, g, d, dg, status, f"source: {err}")
                continue
            ns, h, parent = tier.block_of(s)
            try:
                view = table.claim_destination(d, dg, ns, h, parent)
            except (InvalidArgument, FailedPrecondition) as exc:
                res[i] = MoveResult(
                    s, g, d, dg, MoveStatus.FAILED, f"destination: {type(exc).__name__}: {exc}"
                )
                continue
            claimed.append((i, view, int(tier.checksum[s - tier.first_slot])))
        if claimed:
            buf = aligned_empty(len(claimed) * tier.slot_nbytes).reshape(len(claimed), tier.slot_nbytes)
            rows = buf[:, : tier.block_nbytes]
            errors = tier.read(
                np.array([moves[i][0] for i, _, _ in claimed], dtype=np.int64),
                np.array([moves[i][1] for i, _, _ in claimed], dtype=np.uint64),
                rows,
            )
            for j, (i, view, checksum) in enumerate(claimed):
                s, g, d, dg = moves[i]
                if errors[j]:
                    why = table.finish_destination(d, dg, None)
                    res[i] = MoveResult(s, g, d, table.state(d)[1], MoveStatus.FAILED, f"{errors[j]} ({why})")
                    continue
                np.frombuffer(view, dtype=np.uint8)[:] = rows[j]
                why = table.finish_destination(d, dg, checksum)
                res[i] = (
                    MoveResult(s, g, d, dg, MoveStatus.OK)
                    if not why
                    else MoveResult(s, g, d, dg + 1, MoveStatus.STALE, why)
                )
        moved = disk.unpin_many([moves[i][0] for i in pinned])
        for i, gone in zip(pinned, moved, strict=True):
            r = res[i]
            if gone and r is not None and r.status == MoveStatus.OK:  # the source left: so does the copy
                new = table.free([(r.dst_slot, r.dst_generation)])[0].new_generation
                res[i] = MoveResult(
                    r.src_slot,
                    r.src_generation,
                    r.dst_slot,
                    new,
                    MoveStatus.STALE,
                    "the source was freed during the move",
                )
        return [r for r in res if r is not None]


def _hashes(rows: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(-1, 16)
