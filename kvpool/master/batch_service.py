"""The batched publish RPCs of the `kvpool.v1.Master` servicer (`ReserveBatch`, `CommitBatch`): proto in,
`kvpool.master.publish_batch` call, proto out; each chain's or commit's error is its own status. Mixed into
`MasterServicer` (which also answers the single `Reserve` with `reserve_response`)."""

from __future__ import annotations

import grpc

from kvpool.errors import KVPoolError
from kvpool.master.core import Master
from kvpool.master.grants import write_grants
from kvpool.master.placement import CommitBlock, ReserveOutcome
from kvpool.master.publish_batch import ChainSpec, commit_batch, reserve_batch
from kvpool.master.roles import check_writer
from kvpool.master.wire import endpoint, location, location_pb, short
from kvpool.rpc.status import rpc_errors, status_for
from kvpool.v1 import kvpool_pb2 as pb


def reserve_response(m: Master, namespace: bytes, out: ReserveOutcome) -> pb.ReserveResponse:
    """A reserve's answer: its slots (with write grants on a secured master) and their stores."""
    locations = out.locations
    if m.capabilities is not None:
        locations = write_grants(
            m.capabilities, namespace, out.hashes, locations, out.write_lease_ms, m.leader_epoch
        )
    return pb.ReserveResponse(
        reservation_id=out.rid,
        blocks=[
            pb.ReservedBlock(block_hash=h, already_present=p, locations=[location_pb(x) for x in locs])
            for h, p, locs in zip(out.hashes, out.present, locations, strict=True)
        ],
        write_lease_ms=out.write_lease_ms,
        nodes=[endpoint(n) for n in out.nodes],
        num_replicas_placed=out.num_replicas_placed,
        leader_epoch=m.leader_epoch,
    )


def _status(exc: KVPoolError) -> pb.BatchStatus:
    return pb.BatchStatus(code=status_for(exc).value[0], message=str(exc))


def _chain(m: Master, req: pb.ReserveRequest, owner: str | None) -> ChainSpec:
    """A chain of a batch as a `ChainSpec` (its writer checked as `Reserve` checks it)."""
    writer = short(req.writer_node_id, "writer_node_id")
    if owner is not None:
        check_writer(m.st.nodes, owner, writer)
    return ChainSpec(
        req.namespace,
        req.parent_hash,
        list(req.block_hashes),
        num_replicas=req.num_replicas,
        block_nbytes=req.block_nbytes,
        costs=list(req.recompute_cost_s),
        write_lease_ms=req.write_lease_ms,
        flush_epoch=req.flush_epoch if req.HasField("flush_epoch") else None,
        writer=writer,
    )


class BatchRpcs:
    m: Master

    def _owner(self, context: grpc.ServicerContext) -> str | None: ...

    @rpc_errors
    def ReserveBatch(
        self, request: pb.ReserveBatchRequest, context: grpc.ServicerContext
    ) -> pb.ReserveBatchResponse:
        owner = self._owner(context)
        specs: list[ChainSpec] = []
        refused: dict[int, KVPoolError] = {}  # request index -> a writer refused before placement
        for i, req in enumerate(request.chains):
            try:
                specs.append(_chain(self.m, req, owner))
            except KVPoolError as exc:
                refused[i] = exc
        answers = iter(reserve_batch(self.m.publisher, specs, owner or ""))
        results = []
        for i, req in enumerate(request.chains):
            got = refused.get(i) or next(answers)
            if isinstance(got, KVPoolError):
                results.append(pb.ReserveBatchResult(status=_status(got)))
            else:
                results.append(
                    pb.ReserveBatchResult(
                        reserve=reserve_response(self.m, req.namespace, got), status=pb.BatchStatus()
                    )
                )
        return pb.ReserveBatchResponse(results=results, leader_epoch=self.m.leader_epoch)

    @rpc_errors
    def CommitBatch(
        self, request: pb.CommitBatchRequest, context: grpc.ServicerContext
    ) -> pb.CommitBatchResponse:
        commits = [
            (
                c.reservation_id,
                [CommitBlock(b.block_hash, b.checksum, [location(x) for x in b.written]) for b in c.blocks],
            )
            for c in request.commits
        ]
        results = []
        for got in commit_batch(self.m.publisher, commits, self._owner(context)):
            if isinstance(got, KVPoolError):
                results.append(pb.CommitBatchResult(status=_status(got)))
            else:
                commit = pb.CommitResponse(num_committed=got[0], num_existing=got[1])
                results.append(pb.CommitBatchResult(commit=commit, status=pb.BatchStatus()))
        return pb.CommitBatchResponse(results=results)
