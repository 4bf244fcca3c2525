"""`StoreClient`: the calls to store nodes' control service (`kvpool.v1.Store`) that the master makes, and
`node_identity`: who answers `GetInfo` at a store, prefill or decode node's address.

Domain values in and out (`kvpool.types.SlotOrder`, `Location`, `InventoryBatch`; `NodeIdentity`). Every call
takes its deadline (`timeout_s`, seconds) and, for the orders (reserve, commit, free, copy), the leader epoch
they carry (0: a single master; a store refuses an epoch older than the newest it has seen). A failed call
raises the `KVPoolError` of its gRPC status (`kvpool.rpc.status.raise_from_rpc_error`; UNAVAILABLE, a store
that cannot be reached, is `Unavailable`; a fenced order is `FailedPrecondition`), its message prefixed with
the method and the store's address. Which store, which epoch and what to do on failure are the caller's
(`kvpool.master.stores`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvpool.client import convert as cv
from kvpool.client.types import NodeIdentity
from kvpool.errors import DeadlineExceeded
from kvpool.rpc.security import CallMetadata
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.types import InventoryBatch, Location, SlotOrder
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

_GET_INFO_STUBS: dict[
    str, Callable[[grpc.Channel], pb_grpc.StoreStub | pb_grpc.PrefillStub | pb_grpc.DecodeStub]
] = {
    "store": pb_grpc.StoreStub,
    "prefill": pb_grpc.PrefillStub,
    "decode": pb_grpc.DecodeStub,
}
"""The roles whose nodes serve `GetInfo`, and the service each serves it on."""

CallSigner = Callable[[str, str, bytes], list[tuple[str, str]]]
"""The metadata to send with a call: (the store's address, the method "/kvpool.v1.Store/ReserveSlots"..., the
request's serialized bytes) -> metadata pairs."""


class SignedCalls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `sign(address, method, request bytes)` to every call of a channel to one store (all its calls
    send one request message)."""

    def __init__(self, address: str, sign: CallSigner) -> None:
        self._address = address
        self._sign = sign

    def _signed(self, details: Any, request: Any) -> Any:
        body = request if isinstance(request, bytes) else request.SerializeToString()  # the bytes sent
        return CallMetadata(lambda method: self._sign(self._address, method, body))._details(details)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._signed(details, request), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._signed(details, request), request)


class StoreClient:
    """One channel per store gRPC address ("host:port"), reused until `forget` or `close`; thread-safe.
    With `sign`, every call carries the metadata it returns for the store's address, the call's method and
    its request's bytes (a secured cluster: the master's credential,
    `kvpool.membership.master_call_credential`)."""

    def __init__(self, *, sign: CallSigner | None = None) -> None:
        self._sign = sign
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.StoreStub]] = {}

    def _stub(self, address: str) -> pb_grpc.StoreStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                ch = channel(address)
                if self._sign is not None:
                    ch = grpc.intercept_channel(ch, SignedCalls(address, self._sign))
                entry = (ch, pb_grpc.StoreStub(ch))
                self._stubs[address] = entry
            return entry[1]

    def forget(self, address: str) -> None:
        """Close the channel to `address` (a later call opens a new one)."""
        with self._lock:
            entry = self._stubs.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            entries, self._stubs = list(self._stubs.values()), {}
        for ch, _ in entries:
            ch.close()

    def get_info(self, address: str, *, timeout_s: float) -> NodeIdentity | None:
        """The store at `address`'s `GetInfo` (on this client's channel, signed), or None when it does not
        answer in time (or fails it: an older build without that method)."""
        return _get_info(self._stub(address), timeout_s)

    def reserve_slots(
        self,
        address: str,
        orders: Sequence[SlotOrder],
        *,
        write_lease_ms: int,
        leader_epoch: int,
        timeout_s: float,
    ) -> None:
        """Reserve `orders` (free slots at their generation) for blocks the writer sends within
        `write_lease_ms`."""
        req = pb.ReserveSlotsRequest(
            slots=[cv.slot_reservation_pb(o) for o in orders],
            write_lease_ms=write_lease_ms,
            leader_epoch=leader_epoch,
        )
        try:
            self._stub(address).ReserveSlots(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"ReserveSlots on {address}")

    def commit_slots(
        self, address: str, slots: Sequence[Location], *, leader_epoch: int, timeout_s: float
    ) -> dict[tuple[int, int], str]:
        """Commit written slots; {(slot, generation): error} per slot ("" = committed)."""
        req = pb.CommitSlotsRequest(
            slots=[cv.slot_ref_pb(s.slot, s.generation) for s in slots], leader_epoch=leader_epoch
        )
        try:
            resp = self._stub(address).CommitSlots(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"CommitSlots on {address}")
        return cv.slot_results([(s.slot, s.generation) for s in slots], resp.results)

    def free_slots(
        self, address: str, slots: Sequence[tuple[int, int]], *, leader_epoch: int, timeout_s: float
    ) -> list[tuple[int, int, bool]]:
        """Free (slot, generation) pairs; (slot, new_generation, deferred) per slot the store answered
        (deferred: a read still holds it; it is freed when the read ends)."""
        req = pb.FreeSlotsRequest(slots=[cv.slot_ref_pb(s, g) for s, g in slots], leader_epoch=leader_epoch)
        try:
            resp = self._stub(address).FreeSlots(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"FreeSlots on {address}")
        return [(f.slot, f.new_generation, f.deferred) for f in resp.slots]

    def inventory(
        self, address: str, *, after_slot: int = 0, message_timeout_s: float, max_entries: int = 0
    ) -> Iterator[InventoryBatch]:
        """The committed blocks the store holds in slots >= `after_slot`, in slot order, one `InventoryBatch`
        per streamed message (`max_entries` per message, 0: the store's default). The deadline is per
        message, not per stream (a store of any size completes): each message must arrive within
        `message_timeout_s` seconds of asking for it, else the call is cancelled and `DeadlineExceeded`
        raised. After any failure the caller resumes from the last batch's `next_slot` (-1: complete)."""
        req = pb.InventoryRequest(after_slot=after_slot, max_entries=max_entries)
        call = self._stub(address).Inventory(req)
        watch = _MessageDeadline(call, message_timeout_s)
        try:
            while True:
                watch.waiting()
                try:
                    resp = next(call)
                except StopIteration:
                    return
                finally:
                    watch.arrived()
                yield cv.inventory_batch(resp)
        except grpc.RpcError as exc:
            if watch.expired:
                raise DeadlineExceeded(
                    f"Inventory of {address}: no message within {message_timeout_s:g} s"
                ) from exc
            raise_from_rpc_error(exc, f"Inventory of {address}")
        finally:
            watch.stop()
            call.cancel()  # a consumer that stopped early ends the stream (no-op once it ended)

    def copy_blocks(
        self,
        address: str,
        src_data_address: str,
        blocks: Sequence[tuple[Location, Location, int]],
        *,
        leader_epoch: int,
        timeout_s: float,
    ) -> dict[tuple[int, int], str]:
        """Have the store at `address` pull (src, dst, checksum) blocks from the store whose data plane
        listens at `src_data_address` (with the read capability each `src` carries) into its reserved
        slots `dst`; {(dst slot, generation): error} ("" = copied)."""
        req = pb.CopyBlocksRequest(
            src_data_address=src_data_address,
            blocks=[cv.copy_block_pb(s, d, c) for s, d, c in blocks],
            leader_epoch=leader_epoch,
        )
        try:
            resp = self._stub(address).CopyBlocks(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"CopyBlocks on {address}")
        return cv.slot_results([(d.slot, d.generation) for _, d, _ in blocks], resp.results)


def node_identity(address: str, role: str, *, timeout_s: float) -> NodeIdentity | None:
    """The `GetInfo` of the `role` node ("store", "prefill" or "decode") at `address`, on a one-off channel;
    None when it does not answer in time (or fails it), or for a role without `GetInfo` (a vLLM engine)."""
    stub_class = _GET_INFO_STUBS.get(role)
    if stub_class is None or not address:
        return None
    with channel(address) as ch:
        return _get_info(stub_class(ch), timeout_s)


def _get_info(
    stub: pb_grpc.StoreStub | pb_grpc.PrefillStub | pb_grpc.DecodeStub, timeout_s: float
) -> NodeIdentity | None:
    try:
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return cv.node_identity(info)


class _MessageDeadline:
    """Cancels a streaming call when a message it waits for does not arrive within `timeout_s` (a deadline
    per message; the time the consumer spends between messages does not count). One watcher thread per
    call, polling at a quarter of the deadline."""

    def __init__(self, call: Any, timeout_s: float) -> None:
        self._call = call
        self._timeout_s = timeout_s
        self._since: float | None = None  # monotonic time the current wait began; None: not waiting
        self._done = threading.Event()
        self.expired = False
        threading.Thread(target=self._watch, name="kvpool-inventory-deadline", daemon=True).start()

    def waiting(self) -> None:
        self._since = time.monotonic()

    def arrived(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self._timeout_s / 4):
            since = self._since
            if since is not None and time.monotonic() - since > self._timeout_s:
                self.expired = True
                self._call.cancel()
                return
