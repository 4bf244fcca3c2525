"""The UCX data plane on `ucxx`: store-mediated two-sided messaging, never one-sided RMA.

Wire protocol (per endpoint; control headers are msgpack maps sent as UCX active messages, block bytes
are tagged messages straight from/into the slot and caller buffers; tag = (request id << 20) | index):

    read   client -> {op:"read", id, b:[[slot, gen, nbytes], ...]}
           server -> {id, ph:0, r:[[ok, checksum, error], ...]}, then one tagged send per ok block
    write  client -> {op:"write", id, b:[[slot, gen, nbytes, checksum], ...]}
           server -> {id, ph:0, r:[[ok, 0, error], ...]}   (accepted blocks; their receives are posted)
           client -> one tagged send per accepted block
           server -> {id, ph:1, r:[[ok, checksum, error], ...]}   (after the checksum of what landed)
    ping   client -> {op:"ping", id}           server -> {id, ph:0}
    bw     client -> {op:"bw", id, n}          server -> {id, ph:0}, then n bytes tagged (link probe)

One process holds one UCX context, progressed by one asyncio loop in a daemon thread (`_Runtime`); the
sync API submits coroutines to it. UCX environment defaults, set before `ucxx` is imported unless
already set: `UCX_MM_ERROR_HANDLING=y` (else shared memory is silently unused), `UCXPY_PROGRESS_MODE=
blocking` (several times faster than the progress thread on few cores), and `tcp` is appended to a
user-given `UCX_TLS` that lacks it (connection establishment needs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import statistics
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np

from transfer.base import (
    BlockHandler,
    BlockRead,
    BlockResult,
    BlockWrite,
    LinkEstimate,
    LinkTracker,
    TransferError,
    as_bytes_view,
    checksum,
    validate_batch,
)

log = logging.getLogger(__name__)

UCX_ENV_DEFAULTS = {
    "UCX_MM_ERROR_HANDLING": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
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


def _unpack(buf: Any) -> Any:
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

    def __init__(self) -> None:
        apply_ucx_env_defaults()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvpool-ucx", daemon=True)
        self._thread.start()
        self.ucxx: Any = None
        try:
            self.run(self._init(), 30.0)
        except Exception as exc:
            raise TransferError(f"UCX cannot initialise: {_err(exc)}") from exc

    async def _init(self) -> None:
        import ucxx

        ucxx.init()
        self.ucxx = ucxx

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


def ucx_available() -> str | None:
    """None when UCX initialises in this process, else the reason it cannot."""
    try:
        _Runtime.get()
    except TransferError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------- server


class UcxBlockServer:
    """Serves a `BlockHandler` over UCX. `start()` returns the listening port.

    ucxx listeners listen on every interface (its API takes a port only); `host` is the address this
    server advertises. A transfer still running `send_timeout_s` after its request arrived is aborted
    (its endpoint closed) so a stalled reader never pins a slot forever.
    """

    def __init__(
        self, handler: BlockHandler, host: str = "127.0.0.1", port: int = 0, *, send_timeout_s: float = 30.0
    ) -> None:
        self._handler = handler
        self.host = host
        self._port = port
        self._send_timeout_s = send_timeout_s
        self._rt: _Runtime | None = None
        self._listener: Any = None
        self._endpoints: set[Any] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._probe_buf = np.zeros(0, dtype=np.uint8)
        self.inflight = 0

    @property
    def port(self) -> int:
        return int(self._listener.port) if self._listener is not None else 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        self._rt = _Runtime.get()
        self._rt.run(self._start(), 30.0)
        log.info("UCX block server listening on port %d", self.port)
        return self.port

    async def _start(self) -> None:
        assert self._rt is not None
        self._listener = self._rt.ucxx.create_listener(self._on_connect, port=self._port)

    def stop(self) -> None:
        if self._rt is None:
            return
        with contextlib.suppress(Exception):
            self._rt.run(self._stop(), 15.0)
        self._rt = None

    async def _stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for ep in list(self._endpoints):
            with contextlib.suppress(Exception):
                ep.abort(period=_ABORT_PERIOD_NS)
        self._endpoints.clear()

    async def _on_connect(self, ep: Any) -> None:
        self._endpoints.add(ep)
        try:
            while True:
                try:
                    buf = await ep.am_recv()
                except Exception:  # noqa: BLE001 - the peer went away
                    break
                try:
                    msg = _unpack(buf)
                    op = msg["op"]
                    rid = int(msg["id"])
                except Exception as exc:  # noqa: BLE001 - a malformed header closes this endpoint
                    log.warning("malformed transfer header, closing endpoint: %s", _err(exc))
                    break
                task = asyncio.create_task(self._serve(ep, op, rid, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._endpoints.discard(ep)
            with contextlib.suppress(Exception):
                ep.abort(period=_ABORT_PERIOD_NS)

    async def _serve(self, ep: Any, op: str, rid: int, msg: dict[str, Any]) -> None:
        try:
            if op == "read":
                await self._serve_read(ep, rid, msg.get("b", []))
            elif op == "write":
                await self._serve_write(ep, rid, msg.get("b", []))
            elif op == "ping":
                await ep.am_send(_pack({"id": rid, "ph": 0}))
            elif op == "bw":
                await self._serve_bw(ep, rid, int(msg["n"]))
            else:
                await ep.am_send(_pack({"id": rid, "ph": 0, "error": f"unknown op {op!r}"}))
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the server
            log.debug("transfer request %d (%s) failed: %s", rid, op, _err(exc))
            with contextlib.suppress(Exception):
                ep.abort(period=_ABORT_PERIOD_NS)

    def _check_batch(self, blocks: Any, width: int) -> str:
        if not isinstance(blocks, list) or len(blocks) > MAX_BLOCKS_PER_MESSAGE:
            return f"a message names at most {MAX_BLOCKS_PER_MESSAGE} blocks"
        for b in blocks:
            if (
                not isinstance(b, list)
                or len(b) != width
                or not all(isinstance(v, int) and v >= 0 for v in b)
            ):
                return "malformed block entry"
        return ""

    async def _serve_read(self, ep: Any, rid: int, blocks: Any) -> None:
        problem = self._check_batch(blocks, 3)
        if problem:
            await ep.am_send(_pack({"id": rid, "ph": 0, "error": problem}))
            return
        header: list[list[Any]] = []
        began: list[int] = []
        views: list[tuple[int, memoryview]] = []
        try:
            for i, (slot, gen, nbytes) in enumerate(blocks):
                try:
                    view, stored = self._handler.begin_read(slot, gen, nbytes)
                except Exception as exc:  # noqa: BLE001 - per-block result
                    header.append([False, 0, _err(exc)])
                    continue
                began.append(slot)
                if view.nbytes != nbytes:
                    header.append([False, 0, f"block is {view.nbytes} B, request names {nbytes} B"])
                    continue
                header.append([True, stored, ""])
                views.append((i, view))
            self.inflight += len(began)
            await ep.am_send(_pack({"id": rid, "ph": 0, "r": header}))
            sends = [ep.send(view, tag=_tag(rid, i)) for i, view in views]
            try:
                await asyncio.wait_for(asyncio.gather(*sends), self._send_timeout_s)
            except BaseException:
                ep.abort(period=_ABORT_PERIOD_NS)  # no UCX request may still read a slot once we end the read
                raise
        finally:
            self.inflight -= len(began)
            for slot in began:
                try:
                    self._handler.end_read(slot)
                except Exception:  # noqa: BLE001
                    log.exception("end_read(%d) failed", slot)

    async def _serve_write(self, ep: Any, rid: int, blocks: Any) -> None:
        problem = self._check_batch(blocks, 4)
        if problem:
            await ep.am_send(_pack({"id": rid, "ph": 0, "error": problem}))
            return
        header: list[list[Any]] = []
        accepted: list[tuple[int, int, int, int]] = []  # index, slot, gen, checksum
        recvs: list[asyncio.Task[Any]] = []
        landed: list[bool] = []
        try:
            for i, (slot, gen, nbytes, cs) in enumerate(blocks):
                try:
                    view = self._handler.begin_write(slot, gen, nbytes)
                except Exception as exc:  # noqa: BLE001 - per-block result
                    header.append([False, 0, _err(exc)])
                    continue
                accepted.append((i, slot, gen, cs))
                if view.nbytes != nbytes:
                    header.append([False, 0, f"slot is {view.nbytes} B, request names {nbytes} B"])
                    recvs.append(asyncio.create_task(asyncio.sleep(0, result=False)))
                    continue
                header.append([True, 0, ""])
                recvs.append(asyncio.create_task(ep.recv(view, tag=_tag(rid, i))))
            self.inflight += len(accepted)
            await ep.am_send(_pack({"id": rid, "ph": 0, "r": header}))
            try:
                done = await asyncio.wait_for(
                    asyncio.gather(*recvs, return_exceptions=True), self._send_timeout_s
                )
            except BaseException:
                ep.abort(period=_ABORT_PERIOD_NS)
                raise
            landed = [d is not False and not isinstance(d, BaseException) for d in done]
        finally:
            self.inflight -= len(accepted)
            final = [list(h) for h in header]
            for k, (i, slot, gen, cs) in enumerate(accepted):
                ok = k < len(landed) and landed[k] and final[i][0]
                try:
                    self._handler.end_write(slot, gen, cs, ok)
                except Exception as exc:  # noqa: BLE001 - per-block result
                    final[i] = [False, 0, _err(exc)]
                else:
                    final[i] = (
                        [True, cs, ""] if ok else [False, 0, final[i][2] or "block bytes did not arrive"]
                    )
        await ep.am_send(_pack({"id": rid, "ph": 1, "r": final}))

    async def _serve_bw(self, ep: Any, rid: int, nbytes: int) -> None:
        nbytes = min(max(nbytes, 1), 64 << 20)
        if self._probe_buf.nbytes < nbytes:
            self._probe_buf = np.zeros(nbytes, dtype=np.uint8)
        await ep.am_send(_pack({"id": rid, "ph": 0, "n": nbytes}))
        await asyncio.wait_for(ep.send(self._probe_buf[:nbytes], tag=_tag(rid, 0)), self._send_timeout_s)


# ---------------------------------------------------------------- client


class _Conn:
    """One endpoint to a peer, with a reader task that routes response headers to waiting requests."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.dead = False
        self._pending: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = _unpack(await self.ep.am_recv())
                fut = self._pending.pop((int(msg["id"]), int(msg.get("ph", 0))), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except Exception as exc:  # noqa: BLE001 - the endpoint failed: fail every waiter
            self._fail(TransferError(f"connection lost: {_err(exc)}"))

    def _fail(self, exc: Exception) -> None:
        self.dead = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()

    def expect(self, rid: int, phase: int) -> asyncio.Future[Any]:
        if self.dead:
            raise TransferError("connection lost")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[(rid, phase)] = fut
        return fut

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        fut = self.expect(msg["id"], 0)
        await self.ep.am_send(_pack(msg))
        reply: dict[str, Any] = await fut
        if "error" in reply:
            raise TransferError(f"peer refused the request: {reply['error']}")
        return reply

    def abort(self) -> None:
        """Close at once: cancels every posted receive (no late bytes land in a caller's buffer)."""
        self._fail(TransferError("connection aborted"))
        self._reader.cancel()
        with contextlib.suppress(Exception):
            self.ep.abort(period=_ABORT_PERIOD_NS)


class _Peer:
    def __init__(self, size: int) -> None:
        self.conns: list[_Conn | None] = [None] * size
        self.lock = asyncio.Lock()


class UcxTransport:
    """`Transport` over UCX. Thread-safe; calls block the caller, never the UCX loop.

    `endpoints_per_peer` endpoints are opened per peer (lazily) and reused; a batch is split into
    messages of `blocks_per_message` blocks spread over them, all in flight at once. The first
    connection to a peer probes the link (`probe_pings` tiny round trips for alpha, `probe_bytes` for beta).
    """

    def __init__(
        self,
        *,
        endpoints_per_peer: int = 2,
        blocks_per_message: int = 64,
        probe_bytes: int = 4 << 20,
        probe_pings: int = 5,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if endpoints_per_peer < 1 or not 1 <= blocks_per_message <= MAX_BLOCKS_PER_MESSAGE:
            raise ValueError("endpoints_per_peer >= 1 and 1 <= blocks_per_message <= 4096 are required")
        self._rt = _Runtime.get()
        self._size = endpoints_per_peer
        self._per_msg = blocks_per_message
        self._probe_bytes = probe_bytes
        self._probe_pings = probe_pings
        self._connect_timeout_s = connect_timeout_s
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)
        self._links = LinkTracker()
        self._closed = False

    # -- sync API

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        validate_batch(len(reads), len(out))
        views = [as_bytes_view(o) for o in out]
        pre = [
            "" if v.nbytes == r.nbytes and not v.readonly else f"output buffer unusable for {r.nbytes} B"
            for r, v in zip(reads, views, strict=True)
        ]
        idx = [i for i, p in enumerate(pre) if not p]
        raw = self._call(
            self._read(peer, [reads[i] for i in idx], [views[i] for i in idx], timeout_s), timeout_s, len(idx)
        )
        results = [BlockResult(False, error=p) for p in pre]
        nbytes = 0
        for i, (ok, cs, err) in zip(idx, raw, strict=True):
            if not ok:
                results[i] = BlockResult(False, error=err)
                continue
            got = checksum(views[i])
            if got != cs:
                results[i] = BlockResult(False, got, f"checksum mismatch: got {got:#x}, peer sent {cs:#x}")
            else:
                results[i] = BlockResult(True, got)
                nbytes += reads[i].nbytes
        return results

    def write_blocks(self, peer: str, writes: Sequence[BlockWrite], *, timeout_s: float) -> list[BlockResult]:
        views = [as_bytes_view(w.data) for w in writes]
        raw = self._call(self._write(peer, writes, views, timeout_s), timeout_s, len(writes))
        return [BlockResult(ok, cs, err) for ok, cs, err in raw]

    def link(self, peer: str) -> LinkEstimate:
        est = self._links.get(peer)
        if est is None:
            self._rt.run(self._conn(peer, 0), self._connect_timeout_s + 10.0)
            est = self._links.get(peer)
        if est is None:
            raise TransferError(f"no link estimate for {peer}")
        return est

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._rt.run(self._close(), 10.0)

    def _call(self, coro: Coroutine[Any, Any, list[Any]], timeout_s: float, n: int) -> list[Any]:
        if self._closed:
            coro.close()
            return [(False, 0, "transport closed")] * n
        try:
            return self._rt.run(coro, timeout_s + 5.0)
        except Exception as exc:  # noqa: BLE001 - per-block results, never a raise
            return [(False, 0, _err(exc))] * n

    # -- loop side

    async def _close(self) -> None:
        for p in self._peers.values():
            for c in p.conns:
                if c is not None:
                    c.abort()
        self._peers.clear()

    async def _conn(self, peer: str, k: int) -> _Conn:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = _Peer(self._size)
        k %= self._size
        conn = p.conns[k]
        if conn is not None and not conn.dead:
            return conn
        async with p.lock:
            conn = p.conns[k]
            if conn is not None and not conn.dead:
                return conn
            host, _, port = peer.rpartition(":")
            try:
                ep = await asyncio.wait_for(
                    self._rt.ucxx.create_endpoint(host, int(port), connect_timeout=self._connect_timeout_s),
                    self._connect_timeout_s + 1.0,
                )
            except Exception as exc:  # noqa: BLE001
                raise TransferError(f"cannot connect to {peer}: {_err(exc)}") from exc
            conn = p.conns[k] = _Conn(ep)
            if self._links.get(peer) is None:
                await self._probe(peer, conn)
            return conn

    async def _probe(self, peer: str, conn: _Conn) -> None:
        rtts = []
        for _ in range(self._probe_pings):
            t0 = time.perf_counter()
            await conn.request({"op": "ping", "id": next(self._ids)})
            rtts.append(time.perf_counter() - t0)
        alpha = statistics.median(rtts) if rtts else 0.0
        beta = 0.0
        if self._probe_bytes > 0:
            buf = np.empty(self._probe_bytes, dtype=np.uint8)
            for _ in range(2):
                rid = next(self._ids)
                t0 = time.perf_counter()
                reply = await conn.request({"op": "bw", "id": rid, "n": self._probe_bytes})
                await conn.ep.recv(buf[: int(reply["n"])], tag=_tag(rid, 0))
                dt = time.perf_counter() - t0
                beta = max(beta, self._probe_bytes / max(dt - alpha, dt * 0.1))
        est = self._links.set(peer, alpha, beta)
        log.info(
            "link %s: alpha %.1f us, beta %.2f GB/s", peer, est.alpha_s * 1e6, est.beta_bytes_per_s / 1e9
        )

    async def _batch(self, peer: str, n: int, timeout_s: float, one: Any) -> list[tuple[bool, int, str]]:
        """Run `one(conn, indices, results)` per message chunk, all concurrently, under one deadline."""
        results: list[tuple[bool, int, str]] = [(False, 0, "deadline passed")] * n
        chunks = [list(range(s, min(s + self._per_msg, n))) for s in range(0, n, self._per_msg)]
        done = [False] * len(chunks)
        used: list[_Conn | None] = [None] * len(chunks)
        errors: list[str] = [""] * len(chunks)

        async def run(k: int) -> None:
            try:
                conn = used[k] = await self._conn(peer, k)
                await one(conn, chunks[k], results)
                done[k] = True
            except Exception as exc:  # noqa: BLE001 - the chunk fails as a whole
                errors[k] = _err(exc)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(run(k) for k in range(len(chunks)))), timeout_s)
        for k, idxs in enumerate(chunks):
            if done[k]:
                continue
            conn = used[k]
            if conn is not None:
                conn.abort()  # cancels its posted receives before the caller sees the result
            why = errors[k] or f"deadline of {timeout_s:.3g} s passed"
            for i in idxs:
                results[i] = (False, 0, f"transfer to {peer} failed: {why}")
        return results

    async def _read(
        self, peer: str, reads: Sequence[BlockRead], views: Sequence[memoryview], timeout_s: float
    ) -> list[tuple[bool, int, str]]:
        async def one(conn: _Conn, idxs: list[int], results: list[tuple[bool, int, str]]) -> None:
            rid = next(self._ids)
            reply = await conn.request(
                {
                    "op": "read",
                    "id": rid,
                    "b": [[reads[i].slot, reads[i].generation, reads[i].nbytes] for i in idxs],
                }
            )
            recvs = []
            for j, (ok, cs, err) in enumerate(reply["r"]):
                results[idxs[j]] = (bool(ok), int(cs), str(err))
                if ok:
                    recvs.append(conn.ep.recv(views[idxs[j]], tag=_tag(rid, j)))
            await asyncio.gather(*recvs)

        t0 = time.perf_counter()
        res = await self._batch(peer, len(reads), timeout_s, one)
        self._observe(peer, sum(reads[i].nbytes for i, r in enumerate(res) if r[0]), time.perf_counter() - t0)
        return res

    async def _write(
        self, peer: str, writes: Sequence[BlockWrite], views: Sequence[memoryview], timeout_s: float
    ) -> list[tuple[bool, int, str]]:
        async def one(conn: _Conn, idxs: list[int], results: list[tuple[bool, int, str]]) -> None:
            rid = next(self._ids)
            final = conn.expect(rid, 1)
            reply = await conn.request(
                {
                    "op": "write",
                    "id": rid,
                    "b": [
                        [writes[i].slot, writes[i].generation, views[i].nbytes, writes[i].checksum]
                        for i in idxs
                    ],
                }
            )
            sends = [conn.ep.send(views[idxs[j]], tag=_tag(rid, j)) for j, h in enumerate(reply["r"]) if h[0]]
            await asyncio.gather(*sends)
            for j, (ok, cs, err) in enumerate((await final)["r"]):
                results[idxs[j]] = (bool(ok), int(cs), str(err))

        t0 = time.perf_counter()
        res = await self._batch(peer, len(writes), timeout_s, one)
        self._observe(peer, sum(views[i].nbytes for i, r in enumerate(res) if r[0]), time.perf_counter() - t0)
        return res

    def _observe(self, peer: str, nbytes: int, elapsed_s: float) -> None:
        if nbytes >= 1 << 20:  # small batches measure latency, not bandwidth
            self._links.observe(peer, nbytes, elapsed_s)
