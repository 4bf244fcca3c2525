"""The caller side of the UCX data plane: `UcxTransport` (protocol: transfer/ucx.py; one message's exchange:
transfer/ucx_messages.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from transfer.backoff import PeerBackoff
from transfer.base import (
    BlockRead,
    BlockResult,
    BlockWrite,
    LinkEstimate,
    LinkTracker,
    Overlap,
    PeerLost,
    TransferError,
    TransferTimedOut,
    validate_batch,
)
from transfer.shared_segment import StopFlag
from transfer.ucx_conn import Conn, PeerConns, PeerRefused
from transfer.ucx_deadline import DEFAULT_STALL_S, Expiry, let_land
from transfer.ucx_mapped import mapped_read, optimistic_read
from transfer.ucx_messages import Late, read_message, write_message
from transfer.ucx_runtime import (
    MAX_BLOCKS_PER_MESSAGE,
    _err,
    _Runtime,
    _tag,
    connect_endpoint,
)
from transfer.ucx_wait import tag_recv
from transfer.xxh3 import KERNELS, as_bytes_view

log = logging.getLogger(__name__)


class UcxTransport:
    """`Transport` over UCX. Thread-safe; calls block the caller, never the UCX loop.

    `endpoints_per_peer` endpoints are opened per peer (lazily) and reused; a batch is split into
    messages of `blocks_per_message` blocks spread over them, all in flight at once. The first
    connection to a peer probes the link (`probe_pings` tiny round trips for alpha, `probe_bytes` for beta).

    A read that misses its deadline while the peer answers is slow (`TransferTimedOut`: no back-off, the
    connections stay); the peer is lost (`PeerLost`: backed off) only on a connection failure or when
    nothing was heard from it for `peer_stall_s` while a transfer waited (`transfer.ucx_deadline`).

    `map_local_segments`: read from a same-host store that shares its segment by copying from a read-only
    mapping of it (`transfer.shared_segment`): on the calling thread without a message where the store
    shares its slot state too (`transfer.slot_state`), else under the store's checks and pins; else over
    UCX.
    """

    def __init__(
        self,
        *,
        endpoints_per_peer: int = 2,
        blocks_per_message: int = 64,
        probe_bytes: int = 4 << 20,
        probe_pings: int = 5,
        connect_timeout_s: float = 5.0,
        peer_backoff_s: float = 1.0,
        peer_stall_s: float = DEFAULT_STALL_S,
        map_local_segments: bool = True,
    ) -> None:
        if endpoints_per_peer < 1 or not 1 <= blocks_per_message <= MAX_BLOCKS_PER_MESSAGE:
            raise ValueError("endpoints_per_peer >= 1 and 1 <= blocks_per_message <= 4096 are required")
        self._rt = _Runtime.get()
        self._size = endpoints_per_peer
        self._per_msg = blocks_per_message
        self._probe_bytes = probe_bytes
        self._probe_pings = probe_pings
        self._connect_timeout_s = connect_timeout_s
        self._peers: dict[str, PeerConns] = {}
        self._ids = self._rt.ids  # process-wide: a stray reply never matches another request
        self._links = LinkTracker()
        self._overlap = Overlap()  # only transfers that ran alone measure the link
        self._closed = False
        self._map_local = map_local_segments
        self._stall_s = peer_stall_s
        self.backoff = PeerBackoff(first_s=peer_backoff_s)
        """Peers that could not be reached are skipped for a while (`transfer.backoff`)."""

    # -- sync API

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        validate_batch(len(reads), len(out))
        if why := self.backoff.down(peer):
            return [BlockResult(False, error=why)] * len(reads)
        views = [as_bytes_view(o) for o in out]
        idx = [
            i
            for i, (r, v) in enumerate(zip(reads, views, strict=True))
            if v.nbytes == r.nbytes and not v.readonly
        ]
        if len(idx) == len(reads):  # one result object per block: 256 more cost ~0.3 ms
            raw = self._read_here(peer, reads, views, timeout_s)
            if raw is None:
                raw = self._call(self._read(peer, reads, views, timeout_s), timeout_s, len(reads))
            return list(map(BlockResult._make, raw))  # (ok, checksum, error), verified on the loop side
        raw = self._call(
            self._read(peer, [reads[i] for i in idx], [views[i] for i in idx], timeout_s), timeout_s, len(idx)
        )
        done = {i: BlockResult(bool(ok), cs, err) for i, (ok, cs, err) in zip(idx, raw, strict=True)}
        return [
            done.get(i) or BlockResult(False, error=f"output buffer unusable for {r.nbytes} B")
            for i, r in enumerate(reads)
        ]

    def _read_here(
        self, peer: str, reads: Sequence[BlockRead], views: Sequence[memoryview], timeout_s: float
    ) -> list[tuple[bool, int, str]] | None:
        """A read from a same-host store whose slot state is mapped, on this thread and without a message
        (`optimistic_read`); the blocks it cannot take go through the loop (`mread`). None when it does
        not apply: no mapping yet (the loop path connects and maps), C kernels missing, capabilities."""
        p = self._peers.get(peer)
        mapping, state = (p.mapping, p.state) if p is not None else (None, None)
        if self._closed or mapping is None or state is None or KERNELS is None:
            return None
        if any(r.capability for r in reads):  # the store checks them: every read asks it (`mread`)
            return None
        t0 = time.perf_counter()
        token = self._overlap.begin()
        results: list[tuple[bool, int, str]] = [(False, 0, "")] * len(reads)
        try:
            left = optimistic_read(mapping, state, reads, views, results)
        finally:
            solo = self._overlap.end(token)
        if left:
            raw = self._call(
                self._read(peer, [reads[j] for j in left], [views[j] for j in left], timeout_s),
                timeout_s,
                len(left),
            )
            for j, res in zip(left, raw, strict=True):
                results[j] = res
        elif solo:
            self._observe(peer, sum(r.nbytes for r in reads), time.perf_counter() - t0)
        return results

    def write_blocks(self, peer: str, writes: Sequence[BlockWrite], *, timeout_s: float) -> list[BlockResult]:
        if why := self.backoff.down(peer):
            return [BlockResult(False, error=why)] * len(writes)
        views = [as_bytes_view(w.data) for w in writes]
        raw = self._call(self._write(peer, writes, views, timeout_s), timeout_s, len(writes))
        return [BlockResult(ok, cs, err) for ok, cs, err in raw]

    def link(self, peer: str) -> LinkEstimate:
        est = self._links.get(peer)
        if est is None:
            if why := self.backoff.down(peer):
                raise TransferError(why)
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
            return self._rt.run(coro, 2 * timeout_s + self._stall_s + 5.0)  # moving bytes may land late
        except Exception as exc:  # noqa: BLE001 - per-block results, never a raise
            return [(False, 0, _err(exc))] * n

    # -- loop side

    async def _close(self) -> None:
        for p in self._peers.values():
            for c in p.conns:
                if c is not None:
                    c.abort()
            p.unmap()
        self._peers.clear()

    async def _conn(self, peer: str, k: int) -> Conn:
        p = self._peers.get(peer)
        if p is None:
            p = self._peers[peer] = PeerConns(self._size)
        k %= self._size
        conn = p.conns[k]
        if conn is not None and not conn.dead:
            return conn
        async with p.lock:
            conn = p.conns[k]
            if conn is not None and not conn.dead:
                return conn
            with self._rt.waker.busy():
                return await self._connect(peer, p, k)

    async def _connect(self, peer: str, p: PeerConns, k: int) -> Conn:
        """Open connection `k` of `p` (its lock held): endpoint, handshake, link probe once per peer."""
        host, _, port = peer.rpartition(":")
        try:
            ep = await connect_endpoint(self._rt.ucxx, host, int(port), self._connect_timeout_s)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"cannot connect to {peer}: {_err(exc)}") from exc
        conn = Conn(ep, on_dead=p.conn_died)
        try:
            hello = await conn.handshake(self._rt, self._connect_timeout_s)
            if self._map_local:
                p.map_segment(peer, hello)
            if self._links.get(peer) is None:
                await asyncio.wait_for(self._probe(peer, conn), self._connect_timeout_s + 5.0)
        except BaseException as exc:
            conn.abort()
            if isinstance(exc, Exception):
                raise TransferError(f"cannot connect to {peer}: {_err(exc)}") from exc
            raise
        p.conns[k] = conn
        return conn

    async def _probe(self, peer: str, conn: Conn) -> None:
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
                await tag_recv(conn.ep, buf[: int(reply["n"])], _tag(rid, 0), self._rt.waker)
                dt = time.perf_counter() - t0
                beta = max(beta, self._probe_bytes / max(dt - alpha, dt * 0.1))
        est = self._links.set(peer, alpha, beta)
        log.info(
            "link %s: alpha %.1f us, beta %.2f GB/s", peer, est.alpha_s * 1e6, est.beta_bytes_per_s / 1e9
        )

    async def _batch(
        self, peer: str, n: int, timeout_s: float, one: Any, *, mapped: bool = False, late: Late | None = None
    ) -> list[tuple[bool, int, str]]:
        """Run `one(conn, indices, results)` per message chunk, all concurrently, under one deadline.

        Bytes moving over UCX: `blocks_per_message` per chunk, and UCX is polled on every loop iteration.
        `mapped` (a read from a mapped segment): messages carry only slots and offsets, so one chunk of up
        to `MAX_BLOCKS_PER_MESSAGE` (the store grants a batch at ~2 us a block, a round trip costs ~0.4 ms
        here, and the copying threads need the cores more than the store needs more messages), and no
        polling (a polling loop thread would hold the GIL and a core the copying threads need).

        At the deadline: with `late` (reads over UCX) its expiry fires and each chunk withdraws what has
        not started moving (`transfer.ucx_deadline`); bytes already moving may land while the peer is
        heard, for up to max(`timeout_s`, `stall_s`) more (`let_land`). A chunk still running then is
        cancelled, and a write's or a late read's connection aborted (bytes may still move from or into
        the caller's buffers); a mapped read stops its copies and keeps its connection. The peer is
        backed off only when lost: a connection failed, or nothing heard from it for `stall_s`."""
        results: list[tuple[bool, int, str]] = [(False, 0, "deadline passed")] * n
        per_msg = MAX_BLOCKS_PER_MESSAGE if mapped else self._per_msg
        chunks = [list(range(s, min(s + per_msg, n))) for s in range(0, n, per_msg)]
        done = [False] * len(chunks)
        used: list[Conn | None] = [None] * len(chunks)
        errors: list[str] = [""] * len(chunks)
        lost = [False] * len(chunks)  # the connection failed
        keep = [False] * len(chunks)  # failed, but nothing can still move on its connection
        t0 = time.monotonic()

        async def run(k: int) -> None:
            try:
                conn = used[k] = await self._conn(peer, k)
                await one(conn, chunks[k], results)
                done[k] = True
            except PeerRefused as exc:  # it answered: the link is fine
                errors[k], keep[k] = _err(exc), not exc.in_flight
            except TransferTimedOut as exc:  # it answered, slowly: what it sends is drained
                errors[k], keep[k] = _err(exc), True
            except PeerLost as exc:
                errors[k], lost[k] = _err(exc), True
            except Exception as exc:  # noqa: BLE001 - the chunk fails as a whole, typed
                errors[k], lost[k] = _err(PeerLost(f"connection lost: {_err(exc)}")), True

        polling = contextlib.nullcontext() if mapped else self._rt.waker.busy()
        with polling:
            tasks = [asyncio.ensure_future(run(k)) for k in range(len(chunks))]
            _, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
            if pending and late is not None:
                late.expiry.fire()
                for k, task in enumerate(tasks):
                    if used[k] is None:
                        task.cancel()  # still connecting: nothing to wait for
                pending = await let_land(
                    pending, lambda: self._silent(peer, t0), self._stall_s, max(timeout_s, self._stall_s)
                )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        unfinished = [k for k in range(len(chunks)) if not done[k]]
        p = self._peers.get(peer)
        waited_s = time.monotonic() - t0
        stalled = bool(unfinished) and (
            self._silent(peer, t0)  # connected, nothing heard
            or (waited_s >= self._stall_s and any(used[k] is None for k in unfinished))  # connecting
        )
        if any(lost) or stalled:
            why = (
                next((errors[k] for k in unfinished if lost[k]), "") or f"nothing heard for {waited_s:.3g} s"
            )
            self.backoff.failed(peer, why)
            if p is not None:
                p.conn_died()  # a store that cannot be reached: release its segment once no conn lives
        elif chunks:
            self.backoff.ok(peer)
        for k, idxs in enumerate(chunks):
            if done[k]:
                continue
            conn = used[k]
            # cancelled (no error) while bytes may still move from or into the caller's buffers (a mapped
            # read's copies stopped), lost, or refused with its bytes in flight: no other use is safe
            unsafe = not mapped if not errors[k] else not keep[k]
            if conn is not None and (unsafe or stalled):
                conn.abort()  # cancels its posted receives before the caller sees the result
            why = errors[k] or _err(TransferTimedOut(f"deadline of {timeout_s:.3g} s passed"))
            for i in idxs:
                results[i] = (False, 0, f"transfer to {peer} failed: {why}")
        return results

    def _silent(self, peer: str, since_s: float) -> bool:
        """Nothing heard from `peer` for `stall_s` (counted from `since_s` at the earliest)."""
        p = self._peers.get(peer)
        return p is not None and p.silent_s(since_s) >= self._stall_s

    async def _read(
        self, peer: str, reads: Sequence[BlockRead], views: Sequence[memoryview], timeout_s: float
    ) -> list[tuple[bool, int, str]]:
        stop = StopFlag()
        late = Late(Expiry(), self._stall_s, lambda why: self.backoff.failed(peer, why))

        async def one(conn: Conn, idxs: list[int], results: list[tuple[bool, int, str]]) -> None:
            p = self._peers.get(peer)
            if p is not None and p.mapping is not None:
                # a slot past the mapped segment (a store's disk tier) is sent, as from another host
                size = p.mapping.descriptor.nbytes
                outside = [i for i in idxs if (reads[i].slot + 1) * reads[i].nbytes > size]
                inside = [i for i in idxs if (reads[i].slot + 1) * reads[i].nbytes <= size]
                if inside:
                    await mapped_read(
                        conn,
                        p.mapping,
                        next(self._ids),
                        [reads[i] for i in inside],
                        [views[i] for i in inside],
                        inside,
                        results,
                        stop,
                    )
                if outside:
                    with self._rt.waker.busy():
                        await read_message(
                            conn, next(self._ids), reads, views, outside, results, self._rt.waker, late
                        )
                return
            await read_message(conn, next(self._ids), reads, views, idxs, results, self._rt.waker, late)

        t0 = time.perf_counter()
        p = self._peers.get(peer)
        mapped = p is not None and p.mapping is not None
        token = self._overlap.begin()
        try:
            res = await self._batch(
                peer, len(reads), timeout_s, one, mapped=mapped, late=None if mapped else late
            )
        finally:
            solo = self._overlap.end(token)
        if solo:
            self._observe(
                peer, sum(reads[i].nbytes for i, r in enumerate(res) if r[0]), time.perf_counter() - t0
            )
        return res

    async def _write(
        self, peer: str, writes: Sequence[BlockWrite], views: Sequence[memoryview], timeout_s: float
    ) -> list[tuple[bool, int, str]]:
        async def one(conn: Conn, idxs: list[int], results: list[tuple[bool, int, str]]) -> None:
            await write_message(conn, next(self._ids), writes, views, idxs, results, self._rt.waker)

        t0 = time.perf_counter()
        token = self._overlap.begin()
        try:
            res = await self._batch(peer, len(writes), timeout_s, one)
        finally:
            solo = self._overlap.end(token)
        if solo:
            self._observe(
                peer, sum(views[i].nbytes for i, r in enumerate(res) if r[0]), time.perf_counter() - t0
            )
        return res

    def _observe(self, peer: str, nbytes: int, elapsed_s: float) -> None:
        if nbytes >= 1 << 20:  # small batches measure latency, not bandwidth
            self._links.observe(peer, nbytes, elapsed_s)
