"""The reader's side of a same-host read: one copy from the mapped segment, checked against the mapped
slot state (`optimistic_read`) or under the store's pins (`mread` over UCX, the copy, `mdone`).

Wire (extends transfer/ucx.py):
    mread  client -> server, and its reply: packed arrays, see transfer/mread_wire.py (ok blocks are pinned)
    mdone  client -> {op:"mdone", id}   (no reply: the server unpins the blocks of `mread` id)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer.base import BlockRead
from transfer.mread_wire import block_rows, decode_reply, encode_request
from transfer.shared_segment import SegmentMapping, StopFlag
from transfer.slot_state import SlotStateMapping
from transfer.ucx_conn import Conn, PeerRefused
from transfer.ucx_runtime import send_msg
from transfer.xxh3 import HASH_POOL, INLINE_MAX_BYTES, NUM_HASH_THREADS

_MDONE_TIMEOUT_S = 1.0
Part = tuple[memoryview, int, int]  # destination, offset in the segment, checksum the store holds


def _shares(parts: list[Part]) -> list[list[Part]]:
    """`parts` as one share per hashing thread, or one share when small enough to copy in place."""
    if sum(p[0].nbytes for p in parts) <= INLINE_MAX_BYTES:
        return [parts]
    n = min(NUM_HASH_THREADS, len(parts))
    return [parts[len(parts) * k // n : len(parts) * (k + 1) // n] for k in range(n)]


async def _copy(mapping: SegmentMapping, parts: list[Part], stop: StopFlag) -> list[tuple[bool, int, str]]:
    """Copy and verify `parts`, in place when small, else split over `HASH_POOL`. When cancelled, sets
    `stop` (shared by the whole read: its other messages' jobs stop too) and raises only once no job of
    this call can still write into a destination (at most one block's copy per running job)."""
    shares = _shares(parts)
    if len(shares) == 1:
        return mapping.copy_verify(parts, stop)
    jobs = [HASH_POOL.submit(mapping.copy_verify, share, stop) for share in shares]
    try:
        await asyncio.wait([asyncio.wrap_future(j) for j in jobs])
    except BaseException:
        stop.set()
        for j in jobs:
            j.cancel()
        concurrent.futures.wait(jobs)
        raise
    return [r for j in jobs for r in j.result()]


def _copy_here(mapping: SegmentMapping, parts: list[Part], stop: StopFlag) -> list[tuple[bool, int, str]]:
    """`_copy` on the calling thread: it copies the first share itself while `HASH_POOL` threads copy the
    rest (one wake-up fewer than handing every share over); returns once every share is done."""
    first, *rest = _shares(parts)
    jobs = [HASH_POOL.submit(mapping.copy_verify, share, stop) for share in rest]
    try:
        out = mapping.copy_verify(first, stop)
    finally:
        concurrent.futures.wait(jobs)  # no job may still write into a destination once this returns
    return out + [r for j in jobs for r in j.result()]


def optimistic_read(
    mapping: SegmentMapping,
    state: SlotStateMapping,
    reads: Sequence[BlockRead],
    views: Sequence[memoryview],
    results: list[tuple[bool, int, str]],
) -> list[int]:
    """Read `reads` into `views` on the calling thread without asking the store (transfer/slot_state.py):
    `results[j]` is set for each block j that was readable at its generation before and after its verified
    copy. Returns the others' positions, for the pinned `mread` (which says why they fail). Returns only
    once no copy can still write into a view."""
    n = len(reads)
    try:
        rows = block_rows(reads)
    except ValueError:  # not ids a store could hold: the store says so
        return list(range(n))
    slots, gens, sizes = rows[:, 0].astype(np.int64), rows[:, 1], rows[:, 2]
    with state.hold() as live:
        if not live or not state.owner_alive():
            return list(range(n))
        fits = (slots >= 0) & (slots < state.num_slots) & (sizes == state.block_nbytes)
        slots[~fits] = 0
        where = np.flatnonzero(fits & state.readable_at(slots, gens))
        if not len(where):
            return list(range(n))
        tried = slots[where]
        stored = state.checksum[tried]  # read after `readable`: set before it at each commit
        offsets = (tried * state.block_nbytes).tolist()
        parts = list(zip([views[j] for j in where.tolist()], offsets, stored.tolist(), strict=True))
        copied = _copy_here(mapping, parts, StopFlag())
        still = state.readable_at(tried, gens[where]).tolist()  # the copy's kernel fenced its loads
    done = np.zeros(n, dtype=bool)
    for j, res, kept in zip(where.tolist(), copied, still, strict=True):
        if res[0] and kept:
            results[j] = res
            done[j] = True
    return np.flatnonzero(~done).tolist()


async def mapped_read(
    conn: Conn,
    mapping: SegmentMapping,
    rid: int,
    reads: Sequence[BlockRead],
    views: Sequence[memoryview],
    idxs: Sequence[int],
    results: list[tuple[bool, int, str]],
    stop: StopFlag,
) -> None:
    """Read `reads` into `views` through `mapping`; block j's result goes to `results[idxs[j]]`. `stop`:
    one per read call, set when any of its messages is abandoned (no copy starts after that)."""
    try:
        rows = block_rows(reads)
    except ValueError as exc:  # a bad request, not a bad link: the blocks fail, the peer stays up
        raise PeerRefused(str(exc)) from None
    msg: dict[str, Any] = {"op": "mread", "id": rid, "b": encode_request(rows)}
    if any(r.capability for r in reads):
        msg["c"] = [[r.expiry_ms, bytes(r.capability)] for r in reads]
    fut = conn.expect(rid, 0)
    await send_msg(conn.ep, msg)
    try:
        reply = await asyncio.shield(fut)
    except asyncio.CancelledError:  # abandoned (deadline): once the store answers, it unpins at once
        fut.add_done_callback(lambda f: _unpin_late(conn, rid, f))
        raise
    if "error" in reply:
        raise PeerRefused(f"peer refused the request: {reply['error']}")
    try:
        try:
            ok, stored, offsets, errors = decode_reply(reply, len(reads))
        except ValueError as exc:
            raise PeerRefused(f"bad reply: {exc}") from None
        for j, err in errors.items():
            results[idxs[j]] = (False, 0, err)
        where = np.flatnonzero(ok).tolist()
        if where:
            parts = list(
                zip([views[j] for j in where], offsets[where].tolist(), stored[where].tolist(), strict=True)
            )
            for j, res in zip(where, await _copy(mapping, parts, stop), strict=True):
                results[idxs[j]] = res
    finally:
        if not conn.dead:  # unpin now (the store would after its send timeout or on our disconnect)
            _send_soon(conn, {"op": "mdone", "id": rid})


_sending: set[asyncio.Task[None]] = set()


def _unpin_late(conn: Conn, rid: int, reply: asyncio.Future[Any]) -> None:
    """The answer to an abandoned `mread` came: say `mdone` so the store unpins its blocks now."""
    if not reply.cancelled() and reply.exception() is None and not conn.dead:
        _send_soon(conn, {"op": "mdone", "id": rid})


def _send_soon(conn: Conn, msg: dict[str, Any]) -> None:
    """Send `msg` without waiting for its completion (the read's result does not depend on it)."""

    async def send() -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(send_msg(conn.ep, msg), _MDONE_TIMEOUT_S)

    task = asyncio.get_running_loop().create_task(send())
    _sending.add(task)
    task.add_done_callback(_sending.discard)
