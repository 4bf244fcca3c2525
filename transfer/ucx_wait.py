"""Waiting for a UCX request without spinning the loop thread.

ucxx's blocking progress mode (our default, see `ucx_runtime`) progresses the worker when its epoll file
descriptor fires, but a coroutine awaiting a request (`UCXRequest.wait`) polls `completed` with
`asyncio.sleep(0)` until it is done. An idle connection keeps one active-message receive posted, so every
process with a connection spun one core at 100 % (nice 19): on a 2-core host, the stores' and the
prefill/decode nodes' loop threads competed with one another and with every transfer (a 32 MiB pull took
40-80 ms inside a cluster, 12-15 ms between two quiet processes).

`ProgressWaker` wraps the worker ucxx's blocking-mode progress task calls, so each `progress()` (the only
place UCX completes a posted request) resolves the futures of the waiters; a waiter rechecks its request
and waits again. A completion outside progress (an endpoint abort cancels its requests) is caught by a
fallback re-check every `FALLBACK_S`. `am_recv` is `ucxx.Endpoint.am_recv` with that wait: the readers that
sit idle in one use it, so an idle node's UCX thread sleeps in epoll.
"""

from __future__ import annotations

import asyncio
from typing import Any

FALLBACK_S = 0.05
"""A waiter re-checks its request at least this often even without a progress (seconds)."""


_MAX_PROGRESS = 16
"""Progress rounds per event-fd callback before yielding to other work on the loop."""


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


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class ProgressWaker:
    """Futures resolved after each UCX worker progress, for coroutines on `loop` waiting on requests."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.installed = False
        self._waiters: list[asyncio.Future[None]] = []
        self._worker: Any = None

    def install(self) -> bool:
        """Hook the progress task ucxx runs on `self.loop` (call on the loop, after `ucxx.init()`).

        Returns False (and `wait` falls back to ucxx's own polling) when ucxx runs another progress mode
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
        except Exception:  # noqa: BLE001 - no event fd: leave ucxx's polling alone
            return False
        self._worker = worker
        task.worker = _WorkerProxy(worker, self.wake)
        # Replaces ucxx's reader of the worker's event fd, which progresses but never re-arms the worker,
        # so the fd stayed readable and the loop called it back-to-back (a spinning thread even when idle).
        self.loop.add_reader(epoll_fd, self._on_event)
        self.installed = True
        return True

    def _on_event(self) -> None:
        """The worker's event fd fired: progress until the worker arms (no event left), then wake waiters.
        Arming resets the fd, so the loop sleeps in epoll until UCX has something new. After
        `_MAX_PROGRESS` busy rounds the fd stays readable and the loop calls back again."""
        worker = self._worker
        for _ in range(_MAX_PROGRESS):
            worker.progress()
            if worker.arm():
                break
        self.wake()

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
            timer = self.loop.call_later(FALLBACK_S, _resolve, fut)
            try:
                await fut
            finally:
                timer.cancel()
        req.check_error()


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
