"""The store side of the UCX data plane: `UcxBlockServer` serves a `BlockHandler` (protocol: transfer/ucx.py;
same-host mapped reads: transfer/ucx_mapped_reads.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from transfer.base import BlockHandler
from transfer.coalesce import merge, valid_groups
from transfer.mread_wire import MREAD_VERSION
from transfer.shared_segment import SharedSegment
from transfer.slot_state import SharedSlotState
from transfer.ucx_mapped_reads import MappedReads
from transfer.ucx_runtime import (
    MAX_BLOCKS_PER_MESSAGE,
    PEER_INFO_TIMEOUT_S,
    _err,
    _Runtime,
    _tag,
    _unpack,
    abort_ep,
    send_msg,
)
from transfer.ucx_wait import am_recv, tag_recv, tag_send
from transfer.xxh3 import HASH_POOL, INLINE_MAX_BYTES, checksum_many

log = logging.getLogger(__name__)
MAX_CAPABILITY_NBYTES = 64
"""Longest capability a request may carry (the project's are 16 bytes, 24 with a leader epoch; see kvpool/capability.py)."""
_HASH_EARLY_BYTES = 1 << 20
"""A written message at least this large is hashed as soon as it lands (smaller ones in `end_write`)."""


_IO_POOL: list[ThreadPoolExecutor] = []
_IO_THREADS = 4


def _io_pool() -> ThreadPoolExecutor:
    """The threads that begin reads which block on I/O (a handler's disk tier), made on first use."""
    if not _IO_POOL:
        _IO_POOL.append(ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="kvpool-block-io"))
    return _IO_POOL[0]


def _hash_parts(view: memoryview, n: int) -> list[int]:
    """xxh3 of each of the `n` equal parts of `view` (the blocks of one merged message)."""
    size = view.nbytes // n
    return checksum_many([view[k * size : (k + 1) * size] for k in range(n)])


class UcxBlockServer(MappedReads):
    """Serves a `BlockHandler` over UCX. `start()` returns the listening port.

    ucxx listeners listen on every interface (its API takes a port only); `host` is the address this
    server advertises. A transfer still running `send_timeout_s` after its request arrived is aborted
    (its endpoint closed) so a stalled reader never pins a slot forever.

    `shared`: the handler's blocks live in this memfd segment; same-host readers that map it (its
    descriptor rides on ping replies) read with `mread` and copy the bytes themselves
    (`transfer.shared_segment`): the slots stay pinned until their `mdone`, their endpoint's end or
    `pin_timeout_s` (default: `send_timeout_s`), whichever comes first. `slot_state` (with `shared`
    only): the handler's slot states, advertised for optimistic reads (transfer/slot_state.py); the
    handler's slot k must lie at k * its block size in `shared`.
    """

    def __init__(
        self,
        handler: BlockHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        send_timeout_s: float = 30.0,
        shared: SharedSegment | None = None,
        slot_state: SharedSlotState | None = None,
        pin_timeout_s: float | None = None,
    ) -> None:
        self._handler = handler
        self._shared = shared
        self._pin_timeout_s = send_timeout_s if pin_timeout_s is None else pin_timeout_s
        self._hello: dict[str, Any] = {}
        if shared is not None:
            self._hello = {"seg": shared.descriptor.to_wire(), "mv": MREAD_VERSION}
            if slot_state is not None:
                self._hello["st"] = slot_state.to_wire()
        self._copying: dict[tuple[int, int], asyncio.Future[None]] = {}  # (endpoint id, request id)
        self.host = host
        self._port = port
        self._send_timeout_s = send_timeout_s
        self._rt: _Runtime | None = None
        self._listener: Any = None
        self._endpoints: set[Any] = set()  # endpoints whose reader waits in am_recv
        self._readers: dict[Any, asyncio.Task[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._probe_buf = np.zeros(0, dtype=np.uint8)
        self.inflight = 0
        self.num_merged_runs = 0
        """Runs of adjacent blocks sent or received as one message (`transfer.coalesce`)."""

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
        # ucxx's peer-info timeout off: on expiry it frees a buffer UCX may still write (`connect_endpoint`)
        self._listener = self._rt.ucxx.create_listener(
            self._on_connect, port=self._port, connect_timeout=PEER_INFO_TIMEOUT_S
        )

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
            self._abort(ep)

    def _abort(self, ep: Any) -> None:
        """Abort `ep` now and stop its reader (whose orphaned am_recv is recorded, see ucx_runtime)."""
        pending = ep in self._endpoints
        self._endpoints.discard(ep)
        abort_ep(ep, recv_pending=pending)
        reader = self._readers.pop(ep, None)
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()

    async def _on_connect(self, ep: Any) -> None:
        self._endpoints.add(ep)
        task = asyncio.current_task()
        if task is not None:
            self._readers[ep] = task
        try:
            while True:
                try:
                    buf = await am_recv(ep, _Runtime.get().waker)
                except Exception:  # noqa: BLE001 - the peer went away
                    break
                try:
                    msg = _unpack(buf)
                    op = msg["op"]
                    rid = int(msg["id"])
                except Exception as exc:  # noqa: BLE001 - a malformed header closes this endpoint
                    log.warning("malformed transfer header, closing endpoint: %s", _err(exc))
                    break
                if op == "mdone":  # a same-host reader copied the blocks of its `mread` rid
                    if (fut := self._copying.get((id(ep), rid))) is not None and not fut.done():
                        fut.set_result(None)
                    continue
                task = asyncio.create_task(self._serve(ep, op, rid, msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._endpoints.discard(ep)  # this reader's am_recv has ended
            self._abort(ep)
            for (eid, _), fut in list(self._copying.items()):  # its readers will never say `mdone`
                if eid == id(ep) and not fut.done():
                    fut.set_result(None)

    async def _serve(self, ep: Any, op: str, rid: int, msg: dict[str, Any]) -> None:
        if op == "mread":  # busy only while it answers, not while the reader copies (it needs the CPU)
            await self._serve_op(ep, op, rid, msg)
            return
        with _Runtime.get().waker.busy():
            await self._serve_op(ep, op, rid, msg)

    async def _serve_op(self, ep: Any, op: str, rid: int, msg: dict[str, Any]) -> None:
        try:
            if op == "read":
                await self._serve_read(ep, rid, msg.get("b", []), msg.get("c"), msg.get("g"))
            elif op == "write":
                await self._serve_write(ep, rid, msg.get("b", []), msg.get("c"), msg.get("g"))
            elif op == "mread" and self._shared is not None:
                await self._serve_mapped_read(ep, rid, msg)
            elif op == "ping":
                await send_msg(ep, {"id": rid, "ph": 0, **self._hello})
            elif op == "bw":
                await self._serve_bw(ep, rid, int(msg["n"]))
            else:
                await send_msg(ep, {"id": rid, "ph": 0, "error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the server
            log.debug("transfer request %d (%s) failed: %s", rid, op, _err(exc))
            self._abort(ep)

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

    def _check_caps(self, caps: Any, n: int) -> str:
        """`caps` (optional) is one [expiry_ms, capability bytes] per block, parallel to the blocks."""
        if caps is None:
            return ""
        if not isinstance(caps, list) or len(caps) != n:
            return "capabilities do not match the blocks"
        for c in caps:
            if not (
                isinstance(c, list)
                and len(c) == 2
                and isinstance(c[0], int)
                and c[0] >= 0
                and isinstance(c[1], bytes)
                and len(c[1]) <= MAX_CAPABILITY_NBYTES
            ):
                return "malformed capability entry"
        return ""

    async def _serve_read(self, ep: Any, rid: int, blocks: Any, caps: Any = None, groups: Any = None) -> None:
        problem = self._check_batch(blocks, 3) or self._check_caps(caps, len(blocks))
        if not problem and groups is not None and not valid_groups(groups, len(blocks)):
            problem = "malformed destination groups"
        if problem:
            await send_msg(ep, {"id": rid, "ph": 0, "error": problem})
            return
        header: list[list[Any]] = []
        began: list[int] = []
        views: list[tuple[int, memoryview]] = []
        grants = await self._grant_off_loop(blocks, caps)
        try:
            for i, ((slot, _, nbytes), grant) in enumerate(zip(blocks, grants, strict=True)):
                if isinstance(grant, Exception):  # per-block result
                    header.append([False, 0, _err(grant)])
                    continue
                view, stored = grant
                began.append(slot)
                if view.nbytes != nbytes:
                    header.append([False, 0, f"block is {view.nbytes} B, request names {nbytes} B"])
                    continue
                header.append([True, stored, ""])
                views.append((i, view))
            self.inflight += len(began)
            plan = merge(views, groups) if groups else [(i, 1, v) for i, v in views]
            reply: dict[str, Any] = {"id": rid, "ph": 0, "r": header}
            if merged := [[i, n] for i, n, _ in plan if n > 1]:
                reply["m"] = merged  # one message per run of adjacent slots (transfer.coalesce)
                self.num_merged_runs += len(merged)
            await send_msg(ep, reply)
            waker = _Runtime.get().waker
            sends = [tag_send(ep, view, _tag(rid, i), waker) for i, _, view in plan]
            try:
                await asyncio.wait_for(asyncio.gather(*sends), self._send_timeout_s)
            except BaseException:
                self._abort(ep)  # no UCX request may still read a slot once we end the read
                raise
        finally:
            self.inflight -= len(began)
            self._end_reads(began)

    def _grant(self, blocks: list[list[int]], caps: Any) -> list[Any]:
        """`begin_reads` of every block (one handler call per message): (view, stored checksum) or the
        exception, per block."""
        caps = caps or [(0, b"")] * len(blocks)
        return list(
            self._handler.begin_reads(
                [(s, g, n, c, e) for (s, g, n), (e, c) in zip(blocks, caps, strict=True)]
            )
        )

    async def _grant_off_loop(self, blocks: list[list[int]], caps: Any) -> list[Any]:
        """`_grant`, on the block I/O pool when the message names a slot whose read blocks on I/O (the
        handler's optional `blocking_slots_from`: a store's disk tier), else here. A read abandoned while
        its blocks are begun still ends them."""
        start = getattr(self._handler, "blocking_slots_from", None)
        if start is None or not any(b[0] >= start for b in blocks):
            return self._grant(blocks, caps)
        fut = _io_pool().submit(self._grant, blocks, caps)
        try:
            return await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:

            def end(f: Any) -> None:
                if f.exception() is None:
                    self._end_reads(
                        [
                            b[0]
                            for b, g in zip(blocks, f.result(), strict=True)
                            if not isinstance(g, Exception)
                        ]
                    )

            fut.add_done_callback(end)
            raise

    def _end_reads(self, slots: list[int]) -> None:
        """`end_reads` of every slot begun; never raises."""
        try:
            self._handler.end_reads(slots)
        except Exception:  # noqa: BLE001
            log.exception("end_reads(%d slots) failed", len(slots))

    async def _serve_write(
        self, ep: Any, rid: int, blocks: Any, caps: Any = None, groups: Any = None
    ) -> None:
        problem = self._check_batch(blocks, 4) or self._check_caps(caps, len(blocks))
        if not problem and groups is not None and not valid_groups(groups, len(blocks)):
            problem = "malformed source groups"
        if problem:
            await send_msg(ep, {"id": rid, "ph": 0, "error": problem})
            return
        header: list[list[Any]] = []
        accepted: list[tuple[int, int, int, int]] = []  # index, slot, gen, checksum
        served: list[tuple[int, memoryview]] = []
        landed: list[bool] = []
        final: list[list[Any]] = []
        ended = False
        try:
            for i, (slot, gen, nbytes, cs) in enumerate(blocks):
                try:
                    exp, cap = caps[i] if caps else (0, b"")
                    view = self._handler.begin_write(slot, gen, nbytes, cap, exp)
                except Exception as exc:  # noqa: BLE001 - per-block result
                    header.append([False, 0, _err(exc)])
                    continue
                accepted.append((i, slot, gen, cs))
                if view.nbytes != nbytes:
                    header.append([False, 0, f"slot is {view.nbytes} B, request names {nbytes} B"])
                    continue
                header.append([True, 0, ""])
                served.append((i, view))
            self.inflight += len(accepted)
            plan = merge(served, groups) if groups else [(i, 1, v) for i, v in served]
            digests: dict[int, int] = {}  # request index -> xxh3 of its landed bytes

            async def land(i: int, n: int, v: memoryview) -> None:
                await tag_recv(ep, v, _tag(rid, i), _Runtime.get().waker)
                if v.nbytes >= _HASH_EARLY_BYTES:  # hash it now, while later messages still move
                    sums = await asyncio.shield(asyncio.wrap_future(HASH_POOL.submit(_hash_parts, v, n)))
                    digests.update(zip(range(i, i + n), sums, strict=True))

            recvs = [asyncio.create_task(land(i, n, v)) for i, n, v in plan]
            reply: dict[str, Any] = {"id": rid, "ph": 0, "r": header}
            if merged := [[i, n] for i, n, _ in plan if n > 1]:
                reply["m"] = merged  # one message per run of adjacent slots (transfer.coalesce)
                self.num_merged_runs += len(merged)
            await send_msg(ep, reply)
            try:
                done = await asyncio.wait_for(
                    asyncio.gather(*recvs, return_exceptions=True), self._send_timeout_s
                )
            except BaseException:
                self._abort(ep)
                raise
            arrived = {
                j
                for (i, n, _), d in zip(plan, done, strict=True)
                if not isinstance(d, BaseException)
                for j in range(i, i + n)
            }
            landed = [i in arrived for i, *_ in accepted]
            # end_write hashes what landed: on a hashing thread (GIL released: transfer.xxh3), so the loop keeps
            # moving other messages' bytes meanwhile. Shielded: once submitted it runs to the end, and
            # `ended` keeps the finally below from ending these writes a second time.
            ended = True
            if sum(v.nbytes for _, v in served) <= INLINE_MAX_BYTES:  # ended in place: no thread hop
                final = self._end_writes(header, accepted, landed, digests)
            else:
                final = await asyncio.shield(
                    asyncio.wrap_future(HASH_POOL.submit(self._end_writes, header, accepted, landed, digests))
                )
        finally:
            self.inflight -= len(accepted)
            if not ended:
                final = self._end_writes(header, accepted, landed)
        await send_msg(ep, {"id": rid, "ph": 1, "r": final})

    def _end_writes(
        self,
        header: list[list[Any]],
        accepted: list[tuple[int, int, int, int]],
        landed: list[bool],
        digests: dict[int, int] | None = None,
    ) -> list[list[Any]]:
        """`end_write` every accepted block exactly once; the per-block results of the write."""
        final = [list(h) for h in header]
        digests = digests or {}
        for k, (i, slot, gen, cs) in enumerate(accepted):
            ok = k < len(landed) and landed[k] and final[i][0]
            try:
                self._handler.end_write(slot, gen, cs, ok, digests.get(i))
            except Exception as exc:  # noqa: BLE001 - per-block result
                final[i] = [False, 0, _err(exc)]
            else:
                final[i] = [True, cs, ""] if ok else [False, 0, final[i][2] or "block bytes did not arrive"]
        return final

    async def _serve_bw(self, ep: Any, rid: int, nbytes: int) -> None:
        nbytes = min(max(nbytes, 1), 64 << 20)
        if self._probe_buf.nbytes < nbytes:
            self._probe_buf = np.zeros(nbytes, dtype=np.uint8)
        await send_msg(ep, {"id": rid, "ph": 0, "n": nbytes})
        await asyncio.wait_for(
            tag_send(ep, self._probe_buf[:nbytes], _tag(rid, 0), _Runtime.get().waker), self._send_timeout_s
        )
