"""The gRPC `Store` servicer: validates every request and maps it onto the slot table (proto stops here)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psutil

from kvpool.client.convert import disk_tier_pb, inventory_batch_pb
from kvpool.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvpool.membership import LEADER_PROOF_METADATA
from kvpool.rpc.status import rpc_errors
from kvpool.store.slots import Reservation, SlotTable
from kvpool.store.tier_moves import TierMoves
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

INVENTORY_CHUNK = 65_536
"""Entries per streamed `InventoryResponse` unless the request asks fewer (about 4.5 MB a message)."""
MAX_INVENTORY_CHUNK = 262_144
"""The most entries one `InventoryResponse` carries, whatever the request asks."""

CopyFn = Callable[[str, list[tuple[int, int, int, int, int, bytes, int]]], list[tuple[int, int, str]]]
"""(src data address, [(src slot, src gen, dst slot, dst gen, checksum, src read capability, its expiry
ms)]) -> [(dst slot, dst gen, error)]."""


def _leader_proof(context: grpc.ServicerContext) -> str:
    """The leader's proof of its epoch the call carries (`kvpool.membership.leader_proof`), "" if none."""
    value = next((v for k, v in context.invocation_metadata() or () if k == LEADER_PROOF_METADATA), "")
    return value if isinstance(value, str) else ""


class StoreServicer(pb_grpc.StoreServicer):
    def __init__(
        self,
        table: SlotTable,
        *,
        endpoint: Callable[[], pb.NodeEndpoint],
        layout_fingerprint: str,
        epoch: int,
        copy: CopyFn,
        max_batch_slots: int,
        inflight: Callable[[], int],
        moves: TierMoves | None = None,
    ) -> None:
        self._table = table
        self._endpoint = endpoint
        self._layout = layout_fingerprint
        self._epoch = epoch
        self._copy = copy
        self._max = max_batch_slots
        self._inflight = inflight
        self._proc = psutil.Process()
        self.fence = table.fence
        self._moves = moves

    def _in_range(self, slot: int) -> bool:
        disk = self._table.disk
        return slot < self._table.num_slots or (disk is not None and disk.owns(slot))

    def _range_error(self, slot: int) -> InvalidArgument:
        disk = self._table.disk
        extra = "" if disk is None else f" or [{disk.first_slot}, {disk.first_slot + disk.num_slots})"
        return InvalidArgument(f"slot {slot} out of range [0, {self._table.num_slots}){extra}")

    def _check_batch(self, n: int) -> None:
        if n > self._max:
            raise ResourceExhausted(f"{n} slots in one request; at most {self._max}")

    @rpc_errors
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:
        t = self._table
        return pb.GetInfoResponse(
            node=self._endpoint(),
            layout_fingerprint=self._layout,
            num_slots=t.num_slots,
            block_nbytes=t.block_nbytes,
            segment_bytes=t.segment.nbytes,
            num_used_slots=t.num_used,
            num_inflight_transfers=self._inflight(),
            rss_bytes=self._proc.memory_info().rss,
            disk=disk_tier_pb(None if t.disk is None else t.disk.report()),
        )

    @rpc_errors
    def ReserveSlots(
        self, request: pb.ReserveSlotsRequest, context: grpc.ServicerContext
    ) -> pb.ReserveSlotsResponse:
        self._check_batch(len(request.slots))
        self.fence.check(request.leader_epoch, _leader_proof(context))
        self._table.reserve(
            [
                Reservation(s.slot, s.generation, s.namespace, s.block_hash, s.parent_hash)
                for s in request.slots
            ],
            request.write_lease_ms,
        )
        return pb.ReserveSlotsResponse()

    @rpc_errors
    def CommitSlots(
        self, request: pb.CommitSlotsRequest, context: grpc.ServicerContext
    ) -> pb.CommitSlotsResponse:
        self._check_batch(len(request.slots))
        self.fence.check(request.leader_epoch, _leader_proof(context))
        results = self._table.commit((s.slot, s.generation) for s in request.slots)
        return pb.CommitSlotsResponse(
            results=[pb.SlotResult(slot=s, generation=g, ok=not e, error=e) for s, g, e in results]
        )

    @rpc_errors
    def FreeSlots(self, request: pb.FreeSlotsRequest, context: grpc.ServicerContext) -> pb.FreeSlotsResponse:
        self._check_batch(len(request.slots))
        for s in request.slots:  # all-or-nothing on malformed input
            if not self._in_range(s.slot):
                raise self._range_error(s.slot)
        self.fence.check(request.leader_epoch, _leader_proof(context))
        freed = self._table.free((s.slot, s.generation) for s in request.slots)
        return pb.FreeSlotsResponse(
            slots=[
                pb.FreedSlot(slot=f.slot, new_generation=f.new_generation, deferred=f.deferred) for f in freed
            ]
        )

    @rpc_errors
    def Inventory(self, request: pb.InventoryRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        """The committed blocks in slots >= `after_slot`, `max_entries` (capped) per message, as columns;
        at least one message, the last with `next_slot` -1."""
        limit = min(request.max_entries or INVENTORY_CHUNK, MAX_INVENTORY_CHUNK)
        cursor = request.after_slot
        while True:
            batch = self._table.inventory_batch(cursor, limit)
            yield inventory_batch_pb(batch, self._epoch)
            if batch.next_slot < 0:
                return
            cursor = batch.next_slot

    @rpc_errors
    def CopyBlocks(
        self, request: pb.CopyBlocksRequest, context: grpc.ServicerContext
    ) -> pb.CopyBlocksResponse:
        self._check_batch(len(request.blocks))
        host, sep, port = request.src_data_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"src_data_address must be HOST:PORT, got {request.src_data_address!r}")
        for b in request.blocks:
            if not self._in_range(b.dst.slot):
                raise self._range_error(b.dst.slot)
        self.fence.check(request.leader_epoch, _leader_proof(context))
        results = self._copy(
            request.src_data_address,
            [
                (
                    b.src.slot,
                    b.src.generation,
                    b.dst.slot,
                    b.dst.generation,
                    b.checksum,
                    b.src_capability,
                    b.src_capability_expiry_ms,
                )
                for b in request.blocks
            ],
        )
        return pb.CopyBlocksResponse(
            results=[pb.SlotResult(slot=s, generation=g, ok=not e, error=e) for s, g, e in results]
        )

    @rpc_errors
    def DemoteBlocks(self, request: pb.TierMoveRequest, context: grpc.ServicerContext) -> pb.TierMoveResponse:
        return self._move(request, context, demote=True)

    @rpc_errors
    def PromoteBlocks(
        self, request: pb.TierMoveRequest, context: grpc.ServicerContext
    ) -> pb.TierMoveResponse:
        return self._move(request, context, demote=False)

    def _move(
        self, request: pb.TierMoveRequest, context: grpc.ServicerContext, *, demote: bool
    ) -> pb.TierMoveResponse:
        """A tier move order (`kvpool.store.tier_moves`): queued (refused when the queue is full), answered
        once done. An order still queued when the call's deadline passes is not begun."""
        if self._moves is None:
            raise FailedPrecondition("this store has no disk tier (--disk-path)")
        self._check_batch(len(request.moves))
        self.fence.check(request.leader_epoch, _leader_proof(context))
        left = context.time_remaining()
        deadline = None if left is None else time.monotonic() + left
        fut = self._moves.submit(
            demote=demote,
            moves=[(m.src.slot, m.src.generation, m.dst.slot, m.dst.generation) for m in request.moves],
            deadline_s=deadline,
        )
        results = fut.result()
        return pb.TierMoveResponse(
            results=[
                pb.TierMoveResult(
                    src=pb.SlotRef(slot=r.src_slot, generation=r.src_generation),
                    dst=pb.SlotRef(slot=r.dst_slot, generation=r.dst_generation),
                    status=int(r.status),  # type: ignore[arg-type]
                    error=r.error,
                )
                for r in results
            ]
        )
