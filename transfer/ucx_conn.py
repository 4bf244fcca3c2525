"""One client connection to a UCX block server: an endpoint, its reply router and the handshake."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from transfer.base import PeerLost, TransferError
from transfer.mread_wire import MREAD_VERSION
from transfer.shared_segment import SegmentDescriptor, SegmentMapping
from transfer.slot_state import SlotStateMapping
from transfer.ucx_runtime import _err, _Runtime, _unpack, abort_ep, ep_handle, send_msg
from transfer.ucx_wait import am_recv

log = logging.getLogger(__name__)
_HANDSHAKE_RETRY_S = 0.2  # first wait for a handshake reply before pinging again (doubles each time)


class PeerRefused(TransferError):
    """The peer answered with an error: the request was bad, not the link.

    `in_flight`: bytes of the request may still move on the connection (the peer accepted it but its reply
    was unusable), so the connection must be aborted; False (a refusal before anything moved) keeps it."""

    def __init__(self, message: str, *, in_flight: bool = False) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class Conn:
    """One endpoint to a peer, with a reader task that routes response headers to waiting requests."""

    def __init__(self, ep: Any, on_dead: Callable[[], None] | None = None) -> None:
        self.ep = ep
        self.dead = False
        self.heard_s = time.monotonic()
        """When the peer was last heard on this connection (monotonic s): a reply or a tagged message."""
        self._on_dead = on_dead
        self._pending: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = _unpack(await am_recv(self.ep, _Runtime.get().waker))
                self.heard()
                fut = self._pending.pop((int(msg["id"]), int(msg.get("ph", 0))), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except Exception as exc:  # noqa: BLE001 - the endpoint failed: fail every waiter
            self._fail(PeerLost(f"connection lost: {_err(exc)}"))
            abort_ep(self.ep, recv_pending=False)  # release it now; its am_recv has ended

    def _fail(self, exc: Exception) -> None:
        first = not self.dead
        self.dead = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
        if first and self._on_dead is not None:
            self._on_dead()

    def heard(self) -> None:
        """The peer was just heard on this connection (a message of it landed)."""
        self.heard_s = time.monotonic()

    def expect(self, rid: int, phase: int) -> asyncio.Future[Any]:
        if self.dead:
            raise PeerLost("connection lost")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[(rid, phase)] = fut
        return fut

    def forget(self, rid: int, phase: int) -> None:
        """Stop expecting a reply (the request was refused before that phase could come)."""
        fut = self._pending.pop((rid, phase), None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        fut = self.expect(msg["id"], 0)
        await send_msg(self.ep, msg)
        reply: dict[str, Any] = await fut
        if "error" in reply:
            raise PeerRefused(f"peer refused the request: {reply['error']}")
        return reply

    def abort(self) -> None:
        """Close at once: cancels every posted receive (no late bytes land in a caller's buffer)."""
        self._fail(PeerLost("connection aborted"))
        if not self._reader.done():
            self._reader.cancel()
            abort_ep(self.ep, recv_pending=True)  # its am_recv stays queued in ucxx: count it

    async def handshake(self, rt: _Runtime, timeout_s: float) -> dict[str, Any]:
        """Ping until a reply comes back (returned: it may describe the peer's shared segment), absorbing
        active messages that ucxx hands to receives orphaned on a recycled endpoint handle: ours are counted
        (one extra ping each, sent at once); the peer's are unknown here, so a ping that gets no reply is
        sent again after a short, doubling wait."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        wait = _HANDSHAKE_RETRY_S
        count = 1 + rt.stale.pop(ep_handle(self.ep), 0)
        futs: list[asyncio.Future[Any]] = []
        rids: list[int] = []
        try:
            while True:
                for _ in range(count):
                    rids.append(next(rt.ids))
                    futs.append(self.expect(rids[-1], 0))
                    await send_msg(self.ep, {"op": "ping", "id": rids[-1]})
                left = end - loop.time()
                if left <= 0:
                    raise TransferError(f"no handshake reply in {timeout_s:.3g} s")
                done, _ = await asyncio.wait(futs, timeout=min(wait, left), return_when="FIRST_COMPLETED")
                for fut in done:
                    reply: dict[str, Any] = fut.result()  # raises when the connection was lost
                    return reply
                count, wait = 1, wait * 2
        finally:
            for rid, fut in zip(rids, futs, strict=True):
                self._pending.pop((rid, 0), None)
                fut.cancel()


class PeerConns:
    """A peer's small pool of connections (filled on first use), the lock that serialises connecting and,
    for a same-host store that shares its segment, the read-only mapping of it (and of its slot state,
    for optimistic reads, when the store shares that too)."""

    def __init__(self, size: int) -> None:
        self.conns: list[Conn | None] = [None] * size
        self.lock = asyncio.Lock()
        self.mapping: SegmentMapping | None = None
        self.state: SlotStateMapping | None = None

    def silent_s(self, since_s: float) -> float:
        """Seconds the peer has not been heard on any live connection, counted from `since_s` at the
        earliest (monotonic s: the start of the transfer that asks)."""
        heard = max([c.heard_s for c in self.conns if c is not None and not c.dead], default=0.0)
        return time.monotonic() - max(heard, since_s)

    def conn_died(self) -> None:
        """A connection failed or was aborted: once none is alive, drop the segment mapping (a dead store's
        memory stays allocated while any process maps it); the next connection's handshake maps it again."""
        if all(c is None or c.dead for c in self.conns):
            self.unmap()

    def map_segment(self, peer: str, hello: dict[str, Any]) -> None:
        """Map the segment a handshake reply describes (or keep the current mapping of it); on any
        failure reads from this peer stay on UCX. A reply without one (a store restarted at this address
        with sharing off, or one that serves another `mread` wire version) drops the mapping of its
        predecessor."""
        if "seg" not in hello or hello.get("mv") != MREAD_VERSION:
            self.unmap()
            return
        try:
            desc = SegmentDescriptor.from_wire(hello["seg"])
        except ValueError as exc:
            log.warning("store %s: %s; reading over UCX", peer, exc)
            return
        if self.mapping is None or self.mapping.descriptor != desc:
            self.unmap()
            try:
                self.mapping = SegmentMapping.attach(desc)
            except OSError as exc:
                log.info("store %s: its segment cannot be mapped here (%s); reading over UCX", peer, exc)
                return
            log.info("store %s: same host, reading from its shared segment (%d MiB)", peer, desc.nbytes >> 20)
        self._map_state(peer, hello.get("st"))

    def _map_state(self, peer: str, wire: Any) -> None:
        """Map (or keep) the slot state `wire` describes; None or any failure: reads ask the store first."""
        if self.state is not None and (
            not isinstance(wire, dict) or wire.get("seg") != self.state.descriptor.to_wire()
        ):
            self.state.close()
            self.state = None
        if wire is None or self.state is not None:
            return
        try:
            self.state = SlotStateMapping.attach(wire)
        except (ValueError, OSError) as exc:
            log.info("store %s: its slot state cannot be mapped here (%s); every read asks first", peer, exc)

    def unmap(self) -> None:
        if self.state is not None:
            self.state.close()
            self.state = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
