"""The process's UCX runtime: environment defaults, one UCX context progressed by one asyncio loop in a
daemon thread (`_Runtime`), and the small helpers the server and client share.

Why `ep_handle`/`stale` exist: ucxx queues an active-message receive by the raw `ucp_ep_h` of its
endpoint, and aborting an endpoint does not withdraw a receive still waiting on it. UCX recycles endpoint
handles, so the next endpoint that gets the same handle has its first incoming active message(s) handed to
that orphaned receive and lost. The transport therefore counts, per handle, the receives it orphaned
(`stale`), opens every connection with a handshake that sends enough pings to absorb them (and retries, for
the peer's side), and uses process-wide request ids so a lost or late reply never matches another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgpack

from transfer.base import TransferError
from transfer.ucx_wait import ProgressWaker, am_send

log = logging.getLogger(__name__)

UCX_ENV_DEFAULTS = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    # UCX's tcp transport sends a large message as zero-copy segments of at most TX_SEG_SIZE (8 KiB by
    # default): one syscall and one progress round each. 512 KiB segments move 4 MiB blocks 2.5-4x faster
    # over loopback here (0.7-1.0 -> 2.3-3.4 GB/s, raw ucxx); RX must be >= TX in one process.
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
    # A store restarted on its fixed data port failed with "Device is busy" for ~60 s while the old
    # listener's connections sat in TIME_WAIT; SO_REUSEADDR still refuses a port another listener holds.
    "UCX_TCP_CM_REUSEADDR": "y",
}
MAX_BLOCKS_PER_MESSAGE = 4096
"""A server refuses a message naming more blocks than this (clients split batches far below it)."""
_INDEX_BITS = 20
_ABORT_PERIOD_NS = 100_000_000  # an abort waits at most this long for UCX (it runs on the loop thread)
T = TypeVar("T")


def apply_ucx_env_defaults() -> None:
    """Set the UCX environment defaults documented above (values already set are kept)."""
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    tls = os.environ.get("UCX_TLS")
    if tls and not tls.startswith("^") and "tcp" not in tls.split(",") and tls != "all":
        os.environ["UCX_TLS"] = tls + ",tcp"


def _tag(rid: int, index: int) -> int:
    return (rid << _INDEX_BITS) | index


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


async def send_msg(ep: Any, msg: Any) -> None:
    """Send `msg` (msgpack-able) to `ep` as one active message, waited for without polling (`am_send`)."""
    await am_send(ep, _pack(msg), _Runtime.get().waker)


def _unpack(buf: Any) -> Any:
    """Decode an active message. ucxx hands over a numpy array owning the received bytes; after an
    endpoint error it can hand over one whose data pointer is NULL (reading it would segfault)."""
    if getattr(buf, "nbytes", 0) and getattr(getattr(buf, "ctypes", None), "data", 1) == 0:
        raise TransferError(f"active message of {buf.nbytes} B with no data (endpoint failed)")
    return msgpack.unpackb(memoryview(buf).cast("B"), raw=False)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Runtime:
    """The process's UCX context and the asyncio loop (daemon thread) that progresses it."""

    _instance: _Runtime | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _Runtime:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Runtime()
            return cls._instance

    def _run_loop(self) -> None:
        # The loop sleeps in epoll while no UCX request is in flight (`ucx_wait`) and progresses the worker
        # while transfers run. It runs at the process's own priority: at nice 19 (once, when an idle loop
        # still spun) a node's transfers and a store's serving got ~1.5 % of a core next to any busy
        # process, so a loaded host took seconds to connect (alpha 64 ms, 27 MB/s with two CPU-bound
        # processes on 2 cores; 0.5 ms and 1-2 GB/s at nice 0). Thread mode with Python futures does not
        # poll but aborted the process (ucxx C++ terminate in `Endpoint.send`) when a peer was killed, so
        # it is not the default.
        self.loop.run_forever()

    def __init__(self) -> None:
        apply_ucx_env_defaults()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kvpool-ucx", daemon=True)
        self._thread.start()
        self.ucxx: Any = None
        self.ids = itertools.count(1)
        """Request ids, unique in the process (every transport and connection draws from it)."""
        self.waker = ProgressWaker(self.loop)
        """Wakes coroutines waiting on UCX requests after each worker progress (see `ucx_wait`)."""
        self.stale: dict[int, int] = {}
        """ucp_ep_h -> active-message receives orphaned on it by an abort (see the module docstring)."""
        try:
            self.run(self._init(), 30.0)
        except Exception as exc:
            raise TransferError(f"UCX cannot initialise: {_err(exc)}") from exc

    async def _init(self) -> None:
        import ucxx

        ucxx.init()
        self.ucxx = ucxx
        if not self.waker.install():
            log.info("UCX progress is not in blocking mode: idle receives poll (see transfer.ucx_wait)")

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync transfer call from inside the UCX loop thread would deadlock")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise


def ep_handle(ep: Any) -> int:
    """The endpoint's `ucp_ep_h` (0 once closed)."""
    try:
        return int(ep.uid)
    except Exception:  # noqa: BLE001 - a closed endpoint has no handle
        return 0


def abort_ep(ep: Any, *, recv_pending: bool) -> None:
    """Abort `ep` at once (bounded wait); `recv_pending`: an `am_recv` on it is still waiting (see above)."""
    handle = ep_handle(ep)
    if handle and recv_pending:
        stale = _Runtime.get().stale
        stale[handle] = stale.get(handle, 0) + 1
    with contextlib.suppress(Exception):
        ep.abort(period=_ABORT_PERIOD_NS)
    _Runtime.get().waker.wake()  # an abort completes requests outside progress


PEER_INFO_TIMEOUT_S = 24 * 3600.0
"""ucxx's own peer-info timeout, effectively never: see `connect_endpoint`."""
_CONNECTS: set[asyncio.Task[Any]] = set()


def _close_late(task: asyncio.Task[Any]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    abort_ep(task.result(), recv_pending=False)


async def connect_endpoint(ucxx: Any, host: str, port: int, timeout_s: float) -> Any:
    """`ucxx.create_endpoint`, waited for at most `timeout_s` but never abandoned midway.

    ucxx's peer-info exchange posts a stream receive into a buffer local to its coroutine; its own timeout,
    or a cancellation, frees that buffer while UCX may still write the peer's 16-byte reply into it (seen:
    heap corruption and a segfault once a store cut off the network came back). So the attempt runs as its
    own task with ucxx's timeout off; after `timeout_s` (or if the caller is cancelled) we stop waiting, and
    an endpoint it still produces is aborted. A peer that never answers ends the attempt through UCX's
    endpoint error handling (connection refused/reset, TCP timeouts). Raises `TimeoutError`."""
    task = asyncio.ensure_future(ucxx.create_endpoint(host, port, connect_timeout=PEER_INFO_TIMEOUT_S))
    _CONNECTS.add(task)
    task.add_done_callback(_CONNECTS.discard)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)  # a cancelled wait leaves `task` running
    except asyncio.CancelledError:
        task.add_done_callback(_close_late)
        raise
    if not done:
        task.add_done_callback(_close_late)
        raise TimeoutError(f"no connection to {host}:{port} in {timeout_s:.3g} s")
    return task.result()


def ucx_available() -> str | None:
    """None when UCX initialises in this process, else the reason it cannot."""
    try:
        _Runtime.get()
    except TransferError as exc:
        return str(exc)
    return None
