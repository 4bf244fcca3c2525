"""Batched publish on the master (`ReserveBatch` / `CommitBatch`): many chains reserved, many reservations
committed, in one call each (see `kvpool.master.publish_batch`). Each chain's (commit's) answer is its own:
a `Reservation` (`CommitResult`) or the `KVPoolError` a lone `Reserve` (`Commit`) would have raised."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvpool.client import convert as cv
from kvpool.client.types import ChainReserve, CommitBlock, CommitResult, Reservation
from kvpool.errors import KVPoolError
from kvpool.rpc.status import error_from_status
from kvpool.v1 import kvpool_pb2 as pb

Call = Callable[..., Any]
"""`MasterClient._call`: (method name, request, retry=...) -> the answer."""


def _chain_pb(c: ChainReserve) -> pb.ReserveRequest:
    req = pb.ReserveRequest(
        namespace=c.namespace,
        parent_hash=c.parent or b"",
        block_hashes=list(c.block_hashes),
        num_replicas=c.num_replicas,
        block_nbytes=c.block_nbytes,
        recompute_cost_s=list(c.recompute_cost_s),
        write_lease_ms=c.write_lease_ms,
        writer_node_id=c.writer_node_id,
    )
    if c.flush_epoch is not None:
        req.flush_epoch = c.flush_epoch
    return req


def reserve_batch(call: Call, chains: Sequence[ChainReserve]) -> tuple[list[Reservation | KVPoolError], int]:
    """(per chain, in order, its `Reservation` or error; the answering master's leader epoch). The whole
    call raises only for what fails it all (`InvalidArgument` past the master's batch caps, the master
    unreachable...)."""
    resp = call("ReserveBatch", pb.ReserveBatchRequest(chains=[_chain_pb(c) for c in chains]))
    out: list[Reservation | KVPoolError] = []
    for r in resp.results:
        if r.status.code:
            out.append(error_from_status(r.status.code, r.status.message))
        else:
            out.append(cv.reservation(r.reserve))
    return out, int(resp.leader_epoch)


def commit_batch(
    call: Call, commits: Sequence[tuple[int, Sequence[CommitBlock]]]
) -> list[CommitResult | KVPoolError]:
    """Per (reservation_id, written blocks), in order, its `CommitResult` or error. Idempotent per
    reservation (a repeat answers the first result), so the call is retried on another master."""
    req = pb.CommitBatchRequest(
        commits=[
            pb.CommitRequest(reservation_id=rid, blocks=[cv.commit_block_pb(b) for b in blocks])
            for rid, blocks in commits
        ]
    )
    resp = call("CommitBatch", req, retry=True)
    out: list[CommitResult | KVPoolError] = []
    for r in resp.results:
        if r.status.code:
            out.append(error_from_status(r.status.code, r.status.message))
        else:
            out.append(CommitResult(r.commit.num_committed, r.commit.num_existing))
    return out
