"""The raw-UCX baseline of `kvpool bench transfer`: plain ucxx tagged send/recv of the same bytes.

`python -m kvpool.bench.raw_ucx` runs the peer: it prints `RAW_UCX_READY <port>` and serves until killed.
`RawUcxClient` (in the benchmark process) drives it with the pool's shape: a batch of `n` blocks of
`nbytes` is split into messages of `blocks_per_message` spread over `endpoints` endpoints, all in flight,
one msgpack header per message and one tagged message per block, but no slots, generations or per-block
results:

    get   client -> {op:"get", id, n, nbytes}           server -> n tagged sends (from one buffer)
    put   client -> {op:"put", id, n, nbytes, lo} + n tagged sends (into the peer's rows lo..lo+n-1);
          server -> {id} once all have landed

and the same with the pool's checksums and nothing else (`verify=True`: what the end-to-end xxh3 costs by
itself on this machine): a get hashes the blocks that landed on the hashing threads (`transfer.xxh3`) while
later ones still move, and compares each with the checksum of what the peer sends (all ones); a put hashes the rows first (as
`PoolClient.put_blocks` does), sends their checksums in the header (`op:"put_xxh3"`, `s`), and the peer hashes
what landed the same way and answers how many differ (`bad`).

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
from transfer.xxh3 import HASH_POOL, checksum, checksum_many, checksums

HASH_JOB_BYTES = 16 << 20
"""`verify=True`: landed blocks are hashed in jobs of at least this many bytes (the pool hashes each landed
message of up to 64 MiB, `transfer.coalesce`; one job per 64 KiB block would measure thread hand-offs)."""


async def _recv_hashed(ep: Any, bufs: list[np.ndarray], rid: int) -> list[int]:
    """Receive `bufs` (tags 0..n-1 of `rid`) and xxh3 each, in order: landed blocks are hashed on
    `HASH_POOL` in jobs of `HASH_JOB_BYTES` while later ones still move."""
    recvs = [asyncio.ensure_future(ep.recv(b, tag=_tag(rid, j))) for j, b in enumerate(bufs)]
    jobs: list[asyncio.Future[list[int]]] = []
    pending: list[np.ndarray] = []
    for b, r in zip(bufs, recvs, strict=True):
        await r
        pending.append(b)
        if sum(p.nbytes for p in pending) >= HASH_JOB_BYTES:
            jobs.append(asyncio.wrap_future(HASH_POOL.submit(checksum_many, pending)))
            pending = []
    if pending:
        jobs.append(asyncio.wrap_future(HASH_POOL.submit(checksum_many, pending)))
    return [cs for got in await asyncio.gather(*jobs) for cs in got]


class _Buffers:
    """One reusable buffer per block size and direction: gets send all ones (what a verifying client
    expects), puts land in a buffer of their own."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[bool, int], np.ndarray] = {}

    def get(self, n: int, nbytes: int, *, landing: bool) -> np.ndarray:
        buf = self._bufs.get((landing, nbytes))
        if buf is None or buf.shape[0] < n:
            buf = self._bufs[(landing, nbytes)] = np.ones((n, nbytes), dtype=np.uint8)
        return buf


async def _serve_ep(ep: Any, bufs: _Buffers) -> None:
    while True:
        try:
            msg = _unpack(await am_recv(ep, _Runtime.get().waker))
        except Exception:  # noqa: BLE001 - the peer went away
            return
        rid, n, nbytes, lo = int(msg["id"]), int(msg["n"]), int(msg["nbytes"]), int(msg.get("lo", 0))
        landing = msg["op"] != "get"  # each put's blocks land in rows of their own: puts run concurrently
        buf = bufs.get(lo + n, nbytes, landing=landing)[lo if landing else 0 :]
        with _Runtime.get().waker.busy():  # as the pool's server does per request
            await _serve_op(ep, msg, rid, n, buf)


async def _serve_op(ep: Any, msg: dict[str, Any], rid: int, n: int, buf: np.ndarray) -> None:
    if msg["op"] == "get":
        await asyncio.gather(*(ep.send(buf[i], tag=_tag(rid, i)) for i in range(n)))
    elif msg["op"] == "put":
        await asyncio.gather(*(ep.recv(buf[i], tag=_tag(rid, i)) for i in range(n)))
        await ep.am_send(_pack({"id": rid}))
    elif msg["op"] == "put_xxh3":
        got = await _recv_hashed(ep, [buf[i] for i in range(n)], rid)
        await ep.am_send(_pack({"id": rid, "bad": sum(a != b for a, b in zip(got, msg["s"], strict=True))}))
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

    def get(self, out: np.ndarray, timeout_s: float = 60.0, *, verify: bool = False) -> None:
        """Receive `out.shape[0]` blocks of `out.shape[1]` bytes into `out` (rows). `verify`: also xxh3 each
        landed block and compare it with the peer's (its buffer is all ones); `RuntimeError` on a mismatch."""
        bad = self._rt.run(self._busy(self._get(out, verify)), timeout_s)
        if bad:
            raise RuntimeError(f"raw get: {bad} blocks differ from what the peer sent")

    def put(self, data: np.ndarray, timeout_s: float = 60.0, *, verify: bool = False) -> None:
        """Send the rows of `data`; returns once the peer has received all of them. `verify`: hash the rows
        first and have the peer hash what landed and compare; `RuntimeError` on a mismatch."""
        sums = checksums(data) if verify else None
        bad = self._rt.run(self._busy(self._put(data, sums)), timeout_s)
        if bad:
            raise RuntimeError(f"raw put: the peer received {bad} blocks that differ from what was sent")

    async def _busy(self, coro: Any) -> Any:
        with self._rt.waker.busy():  # as the pool's client does per batch
            return await coro

    async def _get(self, out: np.ndarray, verify: bool) -> int:
        expected = checksum(np.ones(out.shape[1], dtype=np.uint8)) if verify else 0

        async def one(ep: Any, lo: int, hi: int) -> int:
            rid = next(self._rt.ids)
            header = _pack({"op": "get", "id": rid, "n": hi - lo, "nbytes": out.shape[1]})
            if not verify:
                recvs = [ep.recv(out[lo + j], tag=_tag(rid, j)) for j in range(hi - lo)]
                await ep.am_send(header)
                await asyncio.gather(*recvs)
                return 0
            hashed = asyncio.ensure_future(_recv_hashed(ep, [out[lo + j] for j in range(hi - lo)], rid))
            await ep.am_send(header)
            return sum(cs != expected for cs in await hashed)

        return sum(await asyncio.gather(*(one(*c) for c in self._chunks(out.shape[0]))))

    async def _put(self, data: np.ndarray, sums: list[int] | None) -> int:
        async def one(ep: Any, lo: int, hi: int) -> int:
            rid = next(self._rt.ids)
            header: dict[str, Any] = {"op": "put", "id": rid, "n": hi - lo, "nbytes": data.shape[1], "lo": lo}
            if sums is not None:
                header.update(op="put_xxh3", s=sums[lo:hi])
            await ep.am_send(_pack(header))
            await asyncio.gather(*(ep.send(data[lo + j], tag=_tag(rid, j)) for j in range(hi - lo)))
            return int(_unpack(await ep.am_recv()).get("bad", 0))

        return sum(await asyncio.gather(*(one(*c) for c in self._chunks(data.shape[0]))))

    def close(self) -> None:
        async def close() -> None:
            for ep in self._eps:
                ep.abort()

        with contextlib.suppress(Exception):  # best effort at exit
            self._rt.run(close(), 10.0)


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
