"""The raw-UCX baseline of `kvpool bench transfer`: plain ucxx tagged send/recv of the same bytes.

`python -m kvpool.bench.raw_ucx` runs the peer: it prints `RAW_UCX_READY <port>` and serves until killed.
`RawUcxClient` (in the benchmark process) drives it with the pool's shape: a batch of `n` blocks of
`nbytes` is split into messages of `blocks_per_message` spread over `endpoints` endpoints, all in flight,
one msgpack header per message and one tagged message per block, but no slots, generations, checksums or
per-block results:

    get   client -> {op:"get", id, n, nbytes}           server -> n tagged sends (from one buffer)
    put   client -> {op:"put", id, n, nbytes} + n tagged sends;  server -> {id} once all have landed

Both sides use the project's UCX runtime (`transfer.ucx_runtime`), so environment defaults, progress mode
and the UCX context are the ones the pool runs with.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from typing import Any

import numpy as np

from transfer.ucx_runtime import _pack, _Runtime, _tag, _unpack
from transfer.ucx_wait import am_recv


class _Buffers:
    """One reusable buffer per block size (the peer never checks what it moves)."""

    def __init__(self) -> None:
        self._bufs: dict[int, np.ndarray] = {}

    def get(self, n: int, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(nbytes)
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[nbytes] = np.ones((n, nbytes), dtype=np.uint8)
        return buf


async def _serve_ep(ep: Any, bufs: _Buffers) -> None:
    while True:
        try:
            msg = _unpack(await am_recv(ep, _Runtime.get().waker))
        except Exception:  # noqa: BLE001 - the peer went away
            return
        rid, n, nbytes = int(msg["id"]), int(msg["n"]), int(msg["nbytes"])
        buf = bufs.get(n, nbytes)
        with _Runtime.get().waker.busy():  # as the pool's server does per request
            await _serve_op(ep, msg, rid, n, buf)


async def _serve_op(ep: Any, msg: dict[str, Any], rid: int, n: int, buf: np.ndarray) -> None:
    if msg["op"] == "get":
        await asyncio.gather(*(ep.send(buf[i], tag=_tag(rid, i)) for i in range(n)))
    elif msg["op"] == "put":
        await asyncio.gather(*(ep.recv(buf[i], tag=_tag(rid, i)) for i in range(n)))
        await ep.am_send(_pack({"id": rid}))
    else:  # ping
        await ep.am_send(_pack({"id": rid}))


def serve(port: int = 0) -> None:
    rt = _Runtime.get()
    bufs = _Buffers()
    listeners: list[Any] = []

    async def on_connect(ep: Any) -> None:  # ucxx wants a coroutine function here, not a lambda
        await _serve_ep(ep, bufs)

    async def start() -> int:
        listeners.append(rt.ucxx.create_listener(on_connect, port=port))
        return int(listeners[0].port)

    bound = rt.run(start(), 30.0)
    print(f"RAW_UCX_READY {bound}", flush=True)
    threading.Event().wait()


class RawUcxClient:
    """The client side: `endpoints` endpoints to one raw peer, used like `UcxTransport` uses its pool."""

    def __init__(self, host: str, port: int, *, endpoints: int, blocks_per_message: int) -> None:
        self._rt = _Runtime.get()
        self._per_msg = blocks_per_message
        self._eps: list[Any] = self._rt.run(self._busy(self._connect(host, port, endpoints)), 30.0)

    async def _connect(self, host: str, port: int, n: int) -> list[Any]:
        eps = [await self._rt.ucxx.create_endpoint(host, port) for _ in range(n)]
        for ep in eps:  # one round trip each: the endpoint is wired up before anything is timed
            rid = next(self._rt.ids)
            await ep.am_send(_pack({"op": "ping", "id": rid, "n": 0, "nbytes": 0}))
            await ep.am_recv()
        return eps

    def _chunks(self, n: int) -> list[tuple[Any, int, int]]:
        return [
            (self._eps[k % len(self._eps)], s, min(s + self._per_msg, n))
            for k, s in enumerate(range(0, n, self._per_msg))
        ]

    def get(self, out: np.ndarray, timeout_s: float = 60.0) -> None:
        """Receive `out.shape[0]` blocks of `out.shape[1]` bytes into `out` (rows)."""
        self._rt.run(self._busy(self._get(out)), timeout_s)

    def put(self, data: np.ndarray, timeout_s: float = 60.0) -> None:
        """Send the rows of `data`; returns once the peer has received all of them."""
        self._rt.run(self._busy(self._put(data)), timeout_s)

    async def _busy(self, coro: Any) -> Any:
        with self._rt.waker.busy():  # as the pool's client does per batch
            return await coro

    async def _get(self, out: np.ndarray) -> None:
        async def one(ep: Any, lo: int, hi: int) -> None:
            rid = next(self._rt.ids)
            recvs = [ep.recv(out[lo + j], tag=_tag(rid, j)) for j in range(hi - lo)]
            await ep.am_send(_pack({"op": "get", "id": rid, "n": hi - lo, "nbytes": out.shape[1]}))
            await asyncio.gather(*recvs)

        await asyncio.gather(*(one(*c) for c in self._chunks(out.shape[0])))

    async def _put(self, data: np.ndarray) -> None:
        async def one(ep: Any, lo: int, hi: int) -> None:
            rid = next(self._rt.ids)
            await ep.am_send(_pack({"op": "put", "id": rid, "n": hi - lo, "nbytes": data.shape[1]}))
            await asyncio.gather(*(ep.send(data[lo + j], tag=_tag(rid, j)) for j in range(hi - lo)))
            await ep.am_recv()

        await asyncio.gather(*(one(*c) for c in self._chunks(data.shape[0])))

    def close(self) -> None:
        async def close() -> None:
            for ep in self._eps:
                ep.abort()

        with contextlib.suppress(Exception):  # best effort at exit
            self._rt.run(close(), 10.0)


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
