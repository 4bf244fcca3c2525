"""What a UCX read does when its deadline passes while the store answers: a slow transfer, not a lost peer.

A read's receives are posted into the caller's buffers. At the deadline (`Expiry.fire`) each message of
the read withdraws the receives no message of the store has matched yet (`ucx_wait.cancel_recv`: no byte
lands in the caller's buffer afterwards); the store's messages for them, sent or still to come, are
received into a sink and discarded (`drain_soon`; a read whose store had not answered yet drains once the
answer comes: `drain_reply_soon`), so the store's sends complete and the connection the other transfers
share stays open. A receive already matched moves its bytes to the end (UCX cannot stop it midway) and its
blocks count. Only a peer heard from for none of `stall_s` while a drain waits is lost: the connection is
aborted and `on_stall` told (the transport backs off from the peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transfer.ucx_conn import Conn
from transfer.ucx_wait import ProgressWaker, post_tag_recv

DEFAULT_STALL_S = 1.0
"""Nothing heard from a peer for this long while a transfer waits on it: the peer is lost (seconds)."""


class Expiry:
    """The deadline of one transfer call: fired once (on the loop thread); messages register what to do
    then (a callback registered after it fired runs at once)."""

    def __init__(self) -> None:
        self.fired = False
        self._callbacks: list[Callable[[], None]] = []

    def on_fire(self, callback: Callable[[], None]) -> None:
        if self.fired:
            callback()
        else:
            self._callbacks.append(callback)

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


async def let_land(pending: set[Any], silent: Callable[[], bool], stall_s: float, limit_s: float) -> set[Any]:
    """Wait for the tasks `pending` (transfers whose bytes already move) for at most `limit_s`, stopping
    early once `silent()` (nothing heard from the peer for `stall_s`); returns the ones still running."""
    end = time.monotonic() + limit_s
    while pending and (left := end - time.monotonic()) > 0:
        _, pending = await asyncio.wait(pending, timeout=min(left, stall_s / 4))
        if pending and silent():
            break
    return pending


async def until(fut: asyncio.Future[Any], expiry: Expiry) -> tuple[bool, Any]:
    """(True, `fut`'s result) once it is done, or (False, None) when `expiry` fires first (`fut` is left
    as it is). Raises what `fut` raises."""
    if not fut.done():
        gate = asyncio.get_running_loop().create_future()
        expiry.on_fire(lambda: _resolve(gate))
        await asyncio.wait([fut, gate], return_when=asyncio.FIRST_COMPLETED)
        if not fut.done():
            return False, None
    return True, fut.result()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_sink = np.empty(0, dtype=np.uint8)
_draining: set[asyncio.Task[None]] = set()


def _sink_view(nbytes: int) -> memoryview:
    """`nbytes` of a buffer whose contents nobody reads (drained messages land in it, concurrently)."""
    global _sink
    if _sink.nbytes < nbytes:
        _sink = np.empty(max(nbytes, 2 * _sink.nbytes), dtype=np.uint8)  # a drain in flight keeps its own
    return _sink[:nbytes].data


def _spawn(coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _draining.add(task)
    task.add_done_callback(_draining.discard)


async def _watch(
    conn: Conn, req: Any, waker: ProgressWaker, stall_s: float, on_stall: Callable[[str], None]
) -> None:
    """Wait for drain receive `req`; a peer silent for `stall_s` meanwhile is lost (abort, `on_stall`)."""
    done = asyncio.ensure_future(waker.wait(req))
    try:
        while not done.done():
            await asyncio.wait([done], timeout=stall_s)
            if not done.done() and not conn.dead and time.monotonic() - conn.heard_s >= stall_s:
                conn.abort()  # completes `req` (cancelled): `done` ends
                on_stall(f"nothing heard for {stall_s:.3g} s")
                await asyncio.wait([done])
        if not done.cancelled() and done.exception() is None:
            conn.heard()
    finally:
        with contextlib.suppress(Exception):
            conn.ep._finished_recv_count += 1  # noqa: SLF001


def drain_soon(
    conn: Conn,
    messages: Sequence[tuple[int, int]],
    waker: ProgressWaker,
    stall_s: float,
    on_stall: Callable[[str], None],
) -> None:
    """Receive each (tag, nbytes) of `messages` on `conn` into the sink, in the background."""
    for tag, nbytes in messages:
        if conn.dead:
            return
        try:
            req = post_tag_recv(conn.ep, _sink_view(nbytes), tag)
        except Exception:  # noqa: BLE001 - the connection is gone: nothing will come
            return
        _spawn(_watch(conn, req, waker, stall_s, on_stall))


def drain_reply_soon(
    conn: Conn,
    reply: asyncio.Future[Any],
    messages_of: Callable[[dict[str, Any]], Sequence[tuple[int, int]]],
    waker: ProgressWaker,
    stall_s: float,
    on_stall: Callable[[str], None],
) -> None:
    """Once `reply` (the store's answer to an abandoned read) comes, drain the messages it announces
    (`messages_of(reply)`); a peer silent for `stall_s` meanwhile is lost."""

    async def wait() -> None:
        while not reply.done():
            await asyncio.wait([reply], timeout=stall_s)
            if not reply.done() and not conn.dead and time.monotonic() - conn.heard_s >= stall_s:
                conn.abort()
                on_stall(f"no answer, nothing heard for {stall_s:.3g} s")
                return
        if reply.cancelled() or reply.exception() is not None:
            return
        try:
            messages = messages_of(reply.result())
        except Exception:  # noqa: BLE001 - an answer we cannot follow: the connection cannot be reused
            conn.abort()
            return
        drain_soon(conn, messages, waker, stall_s, on_stall)

    _spawn(wait())
