"""Waiting for UCX without spinning the loop thread when nothing is in flight.

ucxx's blocking progress mode (our default, see `ucx_runtime`) progresses the worker when its event fd
fires but never re-arms it, so the fd stayed readable and the loop called back without pause; and a
coroutine awaiting a request (`UCXRequest.wait`) polls `completed` with `asyncio.sleep(0)`. An idle
connection keeps one active-message receive posted, so every process with a connection spun one core:
on a 2-core host the stores' and the prefill/decode nodes' loop threads competed with one
another and with every transfer (a 32 MiB pull took 40-80 ms inside a cluster, 12-15 ms between two quiet
processes).

`ProgressWaker` keeps two regimes:
- **busy** (a transfer, connect or served request marked with `busy()`): a task progresses the worker on
  every loop iteration, as ucxx did, because some UCX protocols complete only under progress with no fd
  event (e.g. `UCX_RNDV_SCHEME=get_zcopy` over shared memory stalled ~1 s per message when waiting for
  events alone) — until `IDLE_SPINS` rounds in a row move nothing and the worker agrees to arm (UCX
  refuses while it has local work queued, such as the copies of a shared-memory get): then the loop naps
  until an event or a short timer (0.5 ms, doubling to 4 ms). A store waiting for its reader to pull a
  block, or a client waiting on a stalled peer, no longer spins a core that the other side's copy or the
  checksum threads need. Tagged sends and receives (`tag_send`, `tag_recv`) are waited for the same way
  instead of ucxx's `sleep(0)` loop;
- **idle**: the worker is progressed until it arms, and the loop sleeps in epoll until UCX signals an
  event. Every progress (the only place UCX completes a posted request) resolves the futures of `wait`ers,
  which re-check their request; `am_recv` is `ucxx.Endpoint.am_recv` with that wait, for readers that sit
  idle. A tick every `TICK_S` progresses and re-arms anyway, so nothing waits longer than that for an
  event UCX did not signal (or a completion outside progress, such as an endpoint abort).

ucxx's connection handshake (`exchange_peer_info`) is waited for the same way, on both sides: a connection
attempt to a peer that never answers no longer polls for as long as it lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

TICK_S = 0.05
"""The idle worker is progressed (and re-armed) at least this often (seconds)."""
IDLE_SPINS = 32
"""Busy polling: progress rounds in a row that move nothing before the worker is armed and the loop naps."""
BUSY_NAP_MIN_S = 0.0005
BUSY_NAP_MAX_S = 0.004
"""Busy polling: naps while armed start at the first and double to the second (an event wakes earlier)."""
_MAX_PROGRESS = 16
"""Progress rounds before giving up on arming in one call (the fd stays readable: the loop calls again)."""


class _WorkerProxy:
    """Forwards everything to the ucxx worker; `progress()` then wakes the waiters."""

    def __init__(self, worker: Any, on_progress: Any) -> None:
        self._worker = worker
        self._on_progress = on_progress

    def progress(self) -> Any:
        try:
            return self._worker.progress()
        finally:
            self._on_progress()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._worker, name)


class ProgressWaker:
    """Progress regimes of the UCX worker on `loop` and futures resolved after each progress (see above)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.installed = False
        self._waiters: list[asyncio.Future[None]] = []
        self._worker: Any = None
        self._busy = 0
        self._poll_task: asyncio.Task[None] | None = None

    def install(self) -> bool:
        """Take over progress of the worker ucxx runs on `self.loop` (call on the loop, after `ucxx.init()`).

        Returns False (ucxx's own progress and waits stay as they are) when ucxx runs another progress mode
        or its internals changed shape."""
        try:
            from ucxx._lib_async import application_context as app
            from ucxx._lib_async.continuous_ucx_progress import BlockingMode
        except ImportError:
            return False
        task = getattr(app, "ProgressTasks", {}).get(self.loop)
        if not isinstance(task, BlockingMode) or not hasattr(task, "worker"):
            return False
        worker = task.worker
        try:
            epoll_fd = int(worker.epoll_file_descriptor)
        except Exception:  # noqa: BLE001 - no event fd: leave ucxx's progress alone
            return False
        self._worker = worker
        task.worker = _WorkerProxy(worker, self.wake)  # ucxx's own progress calls wake waiters too
        self.loop.add_reader(epoll_fd, self._progress_and_arm)  # replaces ucxx's reader of the fd
        with contextlib.suppress(Exception):
            task.progress_task.cancel()  # its 1 s progress without re-arming; our tick replaces it
        self.installed = True
        _wait_peer_info_with(self)
        self.loop.call_later(TICK_S, self._tick)
        return True

    def _progress_and_arm(self) -> None:
        """Progress until the worker arms (no event left: its fd is reset and the loop may sleep), unless
        a busy period polls; then wake the waiters."""
        worker = self._worker
        for _ in range(_MAX_PROGRESS):
            worker.progress()
            if self._busy or worker.arm():
                break
        self.wake()

    def _tick(self) -> None:
        try:
            self._progress_and_arm()
        except Exception as exc:  # noqa: BLE001 - e.g. a worker torn down at exit: keep ticking quietly
            log.debug("UCX progress tick failed: %s", exc)
        self.loop.call_later(TICK_S, self._tick)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Poll the worker on every loop iteration while the block runs (on the loop thread)."""
        self._busy += 1
        if self.installed and self._poll_task is None:
            self._poll_task = self.loop.create_task(self._poll())
        try:
            yield
        finally:
            self._busy -= 1

    async def _poll(self) -> None:
        idle, nap_s = 0, BUSY_NAP_MIN_S
        try:
            while self._busy:
                moved = self._worker.progress_once()  # did UCX do anything?
                self._worker.progress()  # ucxx's full progress: the rest, and cancellations it scheduled
                if moved:
                    idle, nap_s = 0, BUSY_NAP_MIN_S
                else:
                    idle += 1
                self.wake()
                if idle >= IDLE_SPINS and self._worker.arm():
                    # Nothing moved for a while and UCX has no pending work (else it refuses to arm):
                    # sleep until its event fd fires (`_progress_and_arm` wakes us) or the nap ends;
                    # naps double while nothing moves (a peer that stalls costs no CPU).
                    idle = 0
                    fut = self.loop.create_future()
                    self._waiters.append(fut)
                    nap = self.loop.call_later(nap_s, _resolve, fut)
                    await fut
                    nap.cancel()
                    nap_s = min(2 * nap_s, BUSY_NAP_MAX_S)
                else:
                    await asyncio.sleep(0)
        finally:
            self._poll_task = None
            self._progress_and_arm()

    def wake(self) -> None:
        """Resolve every waiting future (they re-check their requests)."""
        if not self._waiters:
            return
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, req: Any) -> None:
        """Wait until `req` (a ucxx `UCXRequest`) completes; raises its error as `req.wait()` does."""
        if not self.installed:
            await req.wait()
            return
        while not req.completed:
            fut = self.loop.create_future()
            self._waiters.append(fut)
            await fut
        req.check_error()


def _wait_peer_info_with(waker: ProgressWaker) -> None:
    """Make ucxx's connection handshake (`exchange_peer_info`, on both the connecting and the listening side)
    wait for its two stream messages through `waker` instead of `UCXRequest.wait`, which polls: a connection
    attempt to a peer that accepted the TCP connection but never answers (a SIGSTOPped process) kept the
    loop thread polling for as long as the attempt lived (`connect_endpoint` never abandons one midway).
    Same messages, same checks and timeouts as ucxx's own; only the wait differs. No-op if ucxx changed shape."""
    try:
        import struct

        from ucxx._lib.arr import Array
        from ucxx._lib_async import application_context, listener
        from ucxx._lib_async.utils import hash64bits
    except ImportError:
        return
    if not all(hasattr(mod, "exchange_peer_info") for mod in (application_context, listener)):
        return

    async def exchange_peer_info(
        endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0
    ) -> dict[str, int]:
        mine = struct.pack("QQ", msg_tag, hash64bits(msg_tag))
        theirs = bytearray(len(mine))  # referenced by this frame until its receive completes or times out
        mine_arr, theirs_arr = Array(mine), Array(theirs)
        # The listener sends first; an await separates the two stream calls, as in ucxx.
        steps = ("send", "recv") if listener else ("recv", "send")
        for step in steps:
            req = endpoint.stream_send(mine_arr) if step == "send" else endpoint.stream_recv(theirs_arr)
            await asyncio.wait_for(waker.wait(req), timeout=connect_timeout)
        peer_tag, peer_checksum = struct.unpack("QQ", theirs)
        if hash64bits(peer_tag) != peer_checksum:
            raise RuntimeError(f"Checksum invalid! {hex(hash64bits(peer_tag))} != {hex(peer_checksum)}")
        return {"msg_tag": peer_tag, "checksum": peer_checksum}

    application_context.exchange_peer_info = exchange_peer_info
    listener.exchange_peer_info = exchange_peer_info


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def am_recv(ep: Any, waker: ProgressWaker) -> Any:
    """`ep.am_recv()` (a ucxx `Endpoint`) waited for by `waker`. Returns the received buffer.

    Raises as ucxx does: `UCXCloseError` on a closed endpoint, the endpoint's error, or the request's."""
    if not waker.installed:
        return await ep.am_recv()
    raw = ep._ep  # noqa: SLF001 - the request-level API under ucxx's Endpoint.am_recv
    if not raw.am_probe():
        raw.raise_on_error()
        if ep.closed:
            from ucxx.exceptions import UCXCloseError

            raise UCXCloseError("Endpoint closed")
    ep._recv_count += 1  # noqa: SLF001 - the counters ucxx keeps for its own am_recv
    req = raw.am_recv()
    await waker.wait(req)
    ep._finished_recv_count += 1  # noqa: SLF001
    return req.recv_buffer


async def am_send(ep: Any, buf: Any, waker: ProgressWaker) -> None:
    """`ep.am_send(buf)` (a ucxx `Endpoint`; `buf` bytes-like, kept referenced until sent) waited for by
    `waker`: ucxx's own wait polls, which spun the loop thread while a send waited on a peer that had
    stopped reading. Raises as ucxx does (`UCXCloseError`, the endpoint's or the request's error; a send
    cancelled while its endpoint is still open ends quietly, as in ucxx)."""
    if not waker.installed:
        await ep.am_send(buf)
        return
    from ucxx._lib.arr import Array
    from ucxx.exceptions import UCXCanceled

    _check_open(ep)
    ep._send_count += 1  # noqa: SLF001 - the counters ucxx keeps for its own am_send
    req = ep._ep.am_send(Array(buf))  # noqa: SLF001
    try:
        await waker.wait(req)
    except UCXCanceled:
        if getattr(ep, "_ep", None) is None:
            raise


def _ucxx_tag(ep: Any, key: str, tag: int) -> Any:
    """The wire tag ucxx's `Endpoint.send`/`recv` use for user tag `tag` (hashed with the endpoint's own
    tag, agreed at connection time, so that receives posted on the worker match this endpoint only)."""
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag

    return Tag(hash64bits(ep._tags[key], hash(tag)))  # noqa: SLF001 - ucxx's per-endpoint tags


def _check_open(ep: Any) -> None:
    """Raise `UCXCloseError` on an endpoint closed or aborted (ucxx drops its handle then: reading it would
    raise AttributeError), else the endpoint's own error if it has one."""
    from ucxx.exceptions import UCXCloseError

    raw = getattr(ep, "_ep", None)
    if raw is None:
        raise UCXCloseError("Endpoint closed")
    raw.raise_on_error()
    if ep.closed:
        raise UCXCloseError("Endpoint closed")


async def tag_send(ep: Any, buf: Any, tag: int, waker: ProgressWaker) -> None:
    """`ep.send(buf, tag=tag)` (a ucxx `Endpoint`, same wire tag) waited for by `waker` instead of a
    `sleep(0)` loop: while a transfer waits on its peer the loop thread may nap (see `busy`).

    Raises as ucxx does: `UCXCloseError` on a closed endpoint, the endpoint's or the request's error
    (a send cancelled by an abort raises `UCXCanceled`)."""
    if not waker.installed:
        await ep.send(buf, tag=tag)
        return
    from ucxx._lib.arr import Array

    _check_open(ep)
    req = ep._ep.tag_send(Array(buf), _ucxx_tag(ep, "msg_send", tag))  # noqa: SLF001
    ep._send_count += 1  # noqa: SLF001 - the counters ucxx keeps for its own send
    await waker.wait(req)


async def tag_recv(ep: Any, buf: Any, tag: int, waker: ProgressWaker) -> None:
    """`ep.recv(buf, tag=tag)` waited for by `waker` (see `tag_send`). Raises as ucxx does."""
    if not waker.installed:
        await ep.recv(buf, tag=tag)
        return
    req = post_tag_recv(ep, buf, tag)
    try:
        await waker.wait(req)
    finally:
        ep._finished_recv_count += 1  # noqa: SLF001


def post_tag_recv(ep: Any, buf: Any, tag: int) -> Any:
    """Post `ep.recv(buf, tag=tag)` (same wire tag) and return its ucxx request: wait for it with
    `ProgressWaker.wait`, withdraw it with `cancel_recv`; count its end in `ep._finished_recv_count`.
    Only where the waker is installed. Raises `UCXCloseError` on a closed endpoint."""
    from ucxx._lib.arr import Array
    from ucxx.types import TagMaskFull

    _check_open(ep)
    req = ep._ep.tag_recv(Array(buf), _ucxx_tag(ep, "msg_recv", tag), TagMaskFull)  # noqa: SLF001
    ep._recv_count += 1  # noqa: SLF001
    return req


UCS_ERR_CANCELED = -16
_cancel_fn: Any = None


def _request_cancel() -> Any:
    """ucxx's `Request::cancel` (C++, not exposed to Python) from the loaded libucxx; None if not found."""
    global _cancel_fn
    if _cancel_fn is None:
        _cancel_fn = False
        try:
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps if "libucxx.so" in line}
            for path in sorted(paths):
                fn = getattr(ctypes.CDLL(path), "_ZN4ucxx7Request6cancelEv", None)
                if fn is not None:
                    fn.argtypes, fn.restype = [ctypes.c_void_p], None
                    _cancel_fn = fn
                    break
        except OSError as exc:
            log.info("UCX receives cannot be withdrawn (%s): a late read's connection is aborted", exc)
    return _cancel_fn or None


def cancel_recv(req: Any) -> bool:
    """Withdraw a tag receive (from `post_tag_recv`) that no message has matched yet: True when withdrawn
    (it completed as cancelled; no byte will land in its buffer, and the message it was for stays queued
    at this worker until another receive takes it). False when it already completed or a message matched
    it (UCX then moves the bytes to the end: `ucp_request_cancel` withdraws only unmatched receives), or
    withdrawing is unavailable. Call on the loop thread."""
    fn = _request_cancel()
    if fn is None or req.completed:
        return False
    fn(req.ucxx_ptr)
    return bool(req.completed) and int(req.status) == UCS_ERR_CANCELED
