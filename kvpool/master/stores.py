"""The master's calls to store nodes' control services (never made under the master's lock).

Each call has a deadline; gRPC failures become `kvpool.errors` (`Unavailable`, `FailedPrecondition`...).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvpool.capability import Capabilities, WallClock
from kvpool.errors import KVPoolError
from kvpool.master.grants import read_grant
from kvpool.membership import MASTER_CALL_METADATA, master_call_credential
from kvpool.rpc.security import CallMetadata
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.types import InventoryItem, Location
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class SlotOrder:
    """One slot reservation for a block: the slot, and the block it will hold."""

    slot: int
    generation: int
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes


class StoreCalls:
    """One channel per store gRPC address, reused; thread-safe. With `capabilities` (a secured cluster),
    every call carries the master's credential (`kvpool.membership.master_call_credential`). Every order
    (reserve, commit, free, copy) carries `leader_epoch`: 0 for a single master, else the epoch this master
    won its leadership with (`kvpool.master.ha`); stores refuse one older than the newest they have seen."""

    def __init__(self, timeout_s: float, capabilities: Capabilities | None = None) -> None:
        self.timeout_s = timeout_s
        self.leader_epoch = 0
        self._caps = capabilities
        self._clock = WallClock()
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.StoreStub]] = {}

    def _stub(self, address: str) -> pb_grpc.StoreStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                ch = channel(address)
                caps = self._caps
                if caps is not None:
                    clock = self._clock

                    def sign(method: str) -> list[tuple[str, str]]:
                        return [(MASTER_CALL_METADATA, master_call_credential(caps, method, clock.now_ms()))]

                    ch = grpc.intercept_channel(ch, CallMetadata(sign))
                entry = (ch, pb_grpc.StoreStub(ch))
                self._stubs[address] = entry
            return entry[1]

    def forget(self, address: str) -> None:
        with self._lock:
            entry = self._stubs.pop(address, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            entries, self._stubs = list(self._stubs.values()), {}
        for ch, _ in entries:
            ch.close()

    def identity(self, address: str, timeout_s: float, *, role: str = "store") -> tuple[str, int] | None:
        """(node_id, epoch) of the `role` node answering `GetInfo` at `address` (its Store, Prefill or Decode
        service), or None when none answers in time (or it is an older build without that method)."""
        if role == "store":
            return _identity(self._stub(address).GetInfo, timeout_s)
        stub_class = pb_grpc.PrefillStub if role == "prefill" else pb_grpc.DecodeStub
        with channel(address) as ch:  # a one-off probe: the master keeps no channel to serving nodes
            return _identity(stub_class(ch).GetInfo, timeout_s)

    def reserve(self, address: str, orders: Sequence[SlotOrder], write_lease_ms: int) -> None:
        req = pb.ReserveSlotsRequest(
            slots=[
                pb.SlotReservation(
                    slot=o.slot,
                    generation=o.generation,
                    namespace=o.namespace,
                    block_hash=o.block_hash,
                    parent_hash=o.parent_hash,
                )
                for o in orders
            ],
            write_lease_ms=write_lease_ms,
            leader_epoch=self.leader_epoch,
        )
        try:
            self._stub(address).ReserveSlots(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"ReserveSlots on {address}")

    def commit(self, address: str, slots: Sequence[Location]) -> dict[tuple[int, int], str]:
        """Commit slots; returns {(slot, generation): error} for the ones that failed ("" = ok)."""
        req = pb.CommitSlotsRequest(
            slots=[pb.SlotRef(slot=s.slot, generation=s.generation) for s in slots],
            leader_epoch=self.leader_epoch,
        )
        try:
            resp = self._stub(address).CommitSlots(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"CommitSlots on {address}")
        out = {(s.slot, s.generation): "no result" for s in slots}
        for r in resp.results:
            out[(r.slot, r.generation)] = "" if r.ok else (r.error or "refused")
        return out

    def free(self, address: str, slots: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """Order slots freed; returns (slot, new_generation, deferred) per slot the store answered."""
        req = pb.FreeSlotsRequest(
            slots=[pb.SlotRef(slot=s, generation=g) for s, g in slots], leader_epoch=self.leader_epoch
        )
        try:
            resp = self._stub(address).FreeSlots(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"FreeSlots on {address}")
        return [(f.slot, f.new_generation, f.deferred) for f in resp.slots]

    def inventory(self, address: str) -> Iterator[InventoryItem]:
        try:
            for resp in self._stub(address).Inventory(pb.InventoryRequest(), timeout=self.timeout_s * 4):
                for e in resp.entries:
                    yield InventoryItem(
                        e.namespace,
                        e.block_hash,
                        e.parent_hash,
                        e.slot,
                        e.generation,
                        e.checksum,
                        e.size_bytes,
                    )
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"Inventory of {address}")

    def copy(
        self, address: str, src_data_address: str, blocks: Sequence[tuple[Location, Location, int]]
    ) -> dict[tuple[int, int], str]:
        """Have the store at `address` pull (src, dst, checksum) blocks (with the read capability `src`
        carries); {(dst slot, gen): error}."""
        req = pb.CopyBlocksRequest(
            src_data_address=src_data_address,
            blocks=[
                pb.CopyBlock(
                    src=pb.SlotRef(slot=s.slot, generation=s.generation),
                    dst=pb.SlotRef(slot=d.slot, generation=d.generation),
                    checksum=c,
                    src_capability=s.capability,
                    src_capability_expiry_ms=s.capability_expiry_ms,
                )
                for s, d, c in blocks
            ],
            leader_epoch=self.leader_epoch,
        )
        try:
            resp = self._stub(address).CopyBlocks(req, timeout=self.timeout_s * 2)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"CopyBlocks on {address}")
        out = {(d.slot, d.generation): "no result" for _, d, _ in blocks}
        for r in resp.results:
            out[(r.slot, r.generation)] = "" if r.ok else (r.error or "refused")
        return out


def copy_into(
    stores: StoreCalls,
    caps: Capabilities | None,
    address: str,
    src_data_address: str,
    key: tuple[bytes, bytes],
    parent: bytes,
    src: Location,
    dst: Location,
    checksum: int,
    write_lease_ms: int,
    epoch: int = 0,
) -> str:
    """Copy block `key` (namespace, hash; `parent` its parent hash) from replica `src` (on the store at
    `src_data_address`) into slot `dst` of the store at `address`: reserve `dst`, have that store pull `src`
    with a read capability granted for `write_lease_ms` (bound to the leader `epoch`), commit. "" on success, else the error
    ("ChecksumMismatch: ...", "Unavailable: ...", a store's refusal). Outside the master's lock."""
    ns, h = key
    ref = (dst.slot, dst.generation)
    try:
        stores.reserve(address, [SlotOrder(dst.slot, dst.generation, ns, h, parent)], write_lease_ms)
        grant = read_grant(caps, ns, h, src, write_lease_ms, epoch)
        err = stores.copy(address, src_data_address, [(grant, dst, checksum)]).get(ref, "")
        if not err:
            err = stores.commit(address, [dst]).get(ref, "")
    except KVPoolError as exc:
        err = f"{type(exc).__name__}: {exc}"
    return err


def _identity(get_info: Callable[..., pb.GetInfoResponse], timeout_s: float) -> tuple[str, int] | None:
    try:
        info = get_info(pb.GetInfoRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return info.node.node_id, info.node.epoch
