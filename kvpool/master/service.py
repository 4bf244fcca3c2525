"""The `kvpool.v1.Master` gRPC servicer: proto in, `Master` call, proto out (proto stops here)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import grpc

from kvpool.client.convert import load_from_pb
from kvpool.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvpool.master import dataplane, replica_ops
from kvpool.master.adapter_service import AdapterRpcs
from kvpool.master.core import Master
from kvpool.master.gate import join_token_of
from kvpool.master.grants import match_grants, write_grants
from kvpool.master.members import new_session
from kvpool.master.ops import admin_evict, drain, undrain
from kvpool.master.placement import CommitBlock
from kvpool.master.ratelimit import PeerRateLimiter
from kvpool.master.roles import check_registration, check_writer, is_admin
from kvpool.master.wire import (
    endpoint,
    engine_namespace,
    engine_url,
    location,
    location_pb,
    match_response,
    node_stats,
    short,
)
from kvpool.rpc.status import rpc_errors
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class MasterServicer(AdapterRpcs, pb_grpc.MasterServicer):
    def __init__(self, master: Master) -> None:
        self.m = master
        s = master.settings
        self.join_limiter = PeerRateLimiter(
            rate_per_s=s.join_rate_per_s, burst=s.join_burst, max_peers=s.max_rate_limited_peers
        )
        """Per-peer token buckets of the open calls, JoinChallenge and RegisterNode (`master.ratelimit`)."""

    def _owner(self, context: grpc.ServicerContext) -> str | None:
        """The caller's join token name when its reservations are bound to it (a non-admin token of a
        secured master); None: unbound (admin, or an unsecured master)."""
        name, role = self.m.members.token_role(join_token_of(context.invocation_metadata()))
        return None if is_admin(role) else name

    @rpc_errors
    def JoinChallenge(
        self, request: pb.JoinChallengeRequest, context: grpc.ServicerContext
    ) -> pb.JoinChallengeResponse:
        self.join_limiter.take(context.peer(), "JoinChallenge")
        challenge, ttl_ms = self.m.members.new_challenge(short(request.node_id, "node_id"))
        return pb.JoinChallengeResponse(challenge=challenge, expires_in_ms=ttl_ms)

    @rpc_errors
    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNodeResponse:
        self.join_limiter.take(context.peer(), "RegisterNode")
        n = request.node
        node_id = short(n.node_id, "node_id")
        grpc_address = short(n.grpc_address, "grpc_address")
        url = engine_url(n.role, short(n.url, "url"))
        engine_ns = engine_namespace(n.role, n)
        if engine_ns and engine_ns[2] != request.layout_fingerprint:
            raise InvalidArgument(
                "engine_namespace.layout_fingerprint differs from the registration's layout"
            )
        data_address = short(n.data_address, "data_address")
        members = self.m.members
        join_token = ""
        try:
            if n.role == "store":
                members.admit_store(
                    challenge=request.challenge,
                    proof=request.proof,
                    node_id=node_id,
                    role=n.role,
                    epoch=n.epoch,
                    grpc_address=grpc_address,
                    data_address=data_address,
                )
            else:
                join_token, token_role = members.token_role(join_token_of(context.invocation_metadata()))
                check_registration(token_role, n.role)
        except (Unauthenticated, PermissionDenied) as exc:
            log.warning("refused %s %r from %s: %s", n.role, node_id, context.peer(), exc)
            raise
        session = new_session() if members.secured else b""
        self.m.register_node(
            node_id=node_id,
            role=n.role,
            grpc_address=grpc_address,
            data_address=data_address,
            epoch=n.epoch,
            protocol_version=request.protocol_version,
            layout_fingerprint=request.layout_fingerprint,
            num_slots=request.num_slots,
            block_nbytes=request.block_nbytes,
            session=session,
            join_token=join_token,
            url=url,
            engine_namespace=engine_ns,
        )
        return pb.RegisterNodeResponse(
            heartbeat_interval_ms=self.m.settings.heartbeat_interval_ms,
            master_epoch=self.m.master_epoch,
            layout_fingerprint=self.m.layout.fingerprint(),
            secured=members.secured,
            session=session,
            leader_epoch=self.m.leader_epoch,
            leader_proof=self._leader_proof(),
        )

    def _leader_proof(self) -> str:
        """The leader's proof of its epoch for a member's fence ("" without HA or a cluster secret)."""
        return self.m.stores.leader_proof if self.m.leader_epoch else ""

    @rpc_errors
    def Masters(self, request: pb.MastersRequest, context: grpc.ServicerContext) -> pb.MastersResponse:
        election = self.m.election
        if election is None:
            return pb.MastersResponse(ha=False, role="leader")
        v = election.view()
        return pb.MastersResponse(
            ha=True,
            address=v.address,
            role=v.role,
            leader=v.leader,
            epoch=v.epoch,
            standbys=v.standbys,
            etcd_endpoints=v.endpoints,
            lease_ttl_s=election.lease_ttl_s,
            elections=v.elections,
            failovers=v.failovers,
        )

    @rpc_errors
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        ld = request.load
        values = [ld.recompute_s_per_token, ld.recompute_s_per_token_ctx, ld.recompute_overhead_s]
        values += [ld.link_alpha_s, ld.link_beta_bytes_per_s]
        if any(not math.isfinite(x) or x < 0 for x in values):
            raise InvalidArgument("load figures must be finite and >= 0")
        if not 0.0 <= ld.kv_usage <= 1.0:  # NaN fails too
            raise InvalidArgument(f"load.kv_usage must be a fraction in [0, 1], got {ld.kv_usage}")
        load = load_from_pb(ld)
        freed = [(s.slot, s.generation) for s in request.freed_slots]
        self.m.check_session(request.node_id, request.epoch, request.session)
        known = self.m.heartbeat(request.node_id, request.epoch, freed, request.num_used_slots, load)
        return pb.HeartbeatResponse(
            known=known,
            master_epoch=self.m.master_epoch,
            flush_epoch=self.m.namespaces.flush_epoch,
            leader_epoch=self.m.leader_epoch,
            leader_proof=self._leader_proof(),
        )

    @rpc_errors
    def DeregisterNode(
        self, request: pb.DeregisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterNodeResponse:
        self.m.check_session(request.node_id, request.epoch, request.session)
        return pb.DeregisterNodeResponse(known=self.m.deregister_node(request.node_id, request.epoch))

    @rpc_errors
    def RegisterNamespace(
        self, request: pb.RegisterNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNamespaceResponse:
        if len(request.extra) > 64:
            raise InvalidArgument("at most 64 extra namespace keys")
        digest, active = self.m.register_namespace(
            model_id=short(request.model_id, "model_id"),
            weights_version=short(request.weights_version, "weights_version"),
            layout_fingerprint=request.layout_fingerprint,
            cache_salt=short(request.cache_salt, "cache_salt"),
            adapter_digest=short(request.adapter_digest, "adapter_digest"),
            extra=dict(request.extra),
        )
        return pb.RegisterNamespaceResponse(namespace=digest, active_version=active)

    @rpc_errors
    def SetModelVersion(
        self, request: pb.SetModelVersionRequest, context: grpc.ServicerContext
    ) -> pb.SetModelVersionResponse:
        previous, n, blocks = self.m.set_model_version(
            short(request.model_id, "model_id"),
            short(request.weights_version, "weights_version"),
            force=request.force,
        )
        return pb.SetModelVersionResponse(
            previous_version=previous, num_namespaces_invalidated=n, num_blocks_unreachable=blocks
        )

    def _match(self, request: pb.MatchPrefixRequest, owner: str | None = None) -> pb.MatchPrefixResponse:
        """`owner`: the caller its read lease is bound to (`_owner`; None: unbound)."""
        res, nodes = self.m.match(
            request.namespace,
            request.block_hashes,
            count_hit=request.count_hit,
            lease_ttl_ms=request.lease_ttl_ms,
            num_prompt_tokens=request.num_prompt_tokens,
            owner=owner,
        )
        caps = self.m.capabilities
        grants: tuple[Sequence[bytes], int] = ((), 0)
        if caps is not None and res.lease_id and res.num_matched:
            grants = match_grants(
                caps,
                request.namespace,
                request.block_hashes,
                res,
                request.lease_ttl_ms,
                self.m.leader_epoch,
            )
        resp = match_response(
            res, nodes, request.request_id, request.lease_ttl_ms, request.packed_replicas, grants
        )
        resp.leader_epoch = self.m.leader_epoch
        return resp

    @rpc_errors
    def MatchPrefix(
        self, request: pb.MatchPrefixRequest, context: grpc.ServicerContext
    ) -> pb.MatchPrefixResponse:
        return self._match(request, self._owner(context))

    @rpc_errors
    def MatchPrefixStream(
        self, request_iterator: Iterator[pb.MatchPrefixRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.MatchPrefixResponse]:
        owner = self._owner(context)
        for request in request_iterator:
            yield self._match(request, owner)

    @rpc_errors
    def RenewLease(
        self, request: pb.RenewLeaseRequest, context: grpc.ServicerContext
    ) -> pb.RenewLeaseResponse:
        owner = self._owner(context)
        return pb.RenewLeaseResponse(ttl_ms=self.m.renew_lease(request.lease_id, request.ttl_ms, owner=owner))

    @rpc_errors
    def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeaseResponse:
        self.m.release_lease(request.lease_id, owner=self._owner(context))
        return pb.ReleaseLeaseResponse()

    @rpc_errors
    def ReleaseLeases(
        self, request: pb.ReleaseLeasesRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseLeasesResponse:
        released, not_found = self.m.release_leases(list(request.lease_ids), owner=self._owner(context))
        return pb.ReleaseLeasesResponse(num_released=released, num_not_found=not_found)

    @rpc_errors
    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        writer = short(request.writer_node_id, "writer_node_id")
        owner = self._owner(context)
        if owner is not None:
            check_writer(self.m.st.nodes, owner, writer)
        out = self.m.publisher.reserve(
            request.namespace,
            request.parent_hash,
            list(request.block_hashes),
            num_replicas=request.num_replicas,
            block_nbytes=request.block_nbytes,
            costs=list(request.recompute_cost_s),
            write_lease_ms=request.write_lease_ms,
            flush_epoch=request.flush_epoch if request.HasField("flush_epoch") else None,
            writer=writer,
            owner=owner or "",
        )
        locations = out.locations
        if self.m.capabilities is not None:
            locations = write_grants(
                self.m.capabilities,
                request.namespace,
                out.hashes,
                locations,
                out.write_lease_ms,
                self.m.leader_epoch,
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
            leader_epoch=self.m.leader_epoch,
        )

    @rpc_errors
    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:
        blocks = [
            CommitBlock(b.block_hash, b.checksum, [location(x) for x in b.written]) for b in request.blocks
        ]
        committed, existing = self.m.publisher.commit(
            request.reservation_id, blocks, owner=self._owner(context)
        )
        return pb.CommitResponse(num_committed=committed, num_existing=existing)

    @rpc_errors
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        self.m.publisher.abort(request.reservation_id, owner=self._owner(context))
        return pb.AbortResponse()

    @rpc_errors
    def RemoveBlocks(
        self, request: pb.RemoveBlocksRequest, context: grpc.ServicerContext
    ) -> pb.RemoveBlocksResponse:
        n = replica_ops.remove_blocks(self.m, request.namespace, list(request.block_hashes), request.force)
        return pb.RemoveBlocksResponse(num_removed=n)

    @rpc_errors
    def ReportBadReplica(
        self, request: pb.ReportBadReplicaRequest, context: grpc.ServicerContext
    ) -> pb.ReportBadReplicaResponse:
        replica_ops.report_bad_replica(
            self.m, request.namespace, request.block_hash, location(request.location), request.reason
        )
        return pb.ReportBadReplicaResponse()

    @rpc_errors
    def ReportDataPlaneFailure(
        self, request: pb.ReportDataPlaneFailureRequest, context: grpc.ServicerContext
    ) -> pb.ReportDataPlaneFailureResponse:
        dataplane.report_failure(self.m, request.node_id, request.epoch, request.kind, request.detail)
        return pb.ReportDataPlaneFailureResponse()

    @rpc_errors
    def ReportLocal(
        self, request: pb.ReportLocalRequest, context: grpc.ServicerContext
    ) -> pb.ReportLocalResponse:
        replica_ops.report_local(
            self.m,
            request.node_id,
            request.epoch,
            request.namespace,
            list(request.stored),
            list(request.removed),
            request.cleared,
        )
        return pb.ReportLocalResponse()

    @rpc_errors
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        m, c = self.m, self.m.counters
        with m.lock:
            stores = [n for n in m.st.nodes.values() if n.is_store and n.alive]
            return pb.StatsResponse(
                num_blocks=m.index.num_blocks,
                used_bytes=sum(m.index.bytes_on_node(n.node_id) for n in stores),
                capacity_bytes=sum(n.num_slots * n.block_nbytes for n in stores),
                num_live_leases=m.index.num_live_leases,
                num_evictions=c.num_evictions,
                num_match_requests=c.num_match_requests,
                requested_tokens=c.requested_tokens,
                hit_tokens=c.hit_tokens,
                requested_blocks=c.requested_blocks,
                hit_blocks=c.hit_blocks,
                uptime_s=(m.clock.now_ms() - m.started_ms) / 1000,
                nodes=[node_stats(m, n) for n in m.st.nodes.values()],
                num_namespaces=len(m.namespaces),
                num_reserved_blocks=m.publisher.num_reserved_blocks,
                num_rereplications=c.num_rereplications,
                block_size=m.layout.block_size,
                index_bytes=m.admission.index_bytes(),
                index_bytes_limit=m.admission.limit_bytes,
                num_admission_refusals=m.admission.num_refusals,
                namespaces=[
                    pb.NamespaceInfo(
                        namespace=r.digest,
                        model_id=r.model_id,
                        weights_version=r.weights_version,
                        active=m.namespaces.is_active(r.digest),
                        num_blocks=m.index.num_blocks_in(r.digest),
                    )
                    for r in m.namespaces.records()
                ],
            )

    @rpc_errors
    def ListNodes(self, request: pb.ListNodesRequest, context: grpc.ServicerContext) -> pb.ListNodesResponse:
        with self.m.lock:
            return pb.ListNodesResponse(nodes=[node_stats(self.m, n) for n in self.m.st.nodes.values()])

    @rpc_errors
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        if request.cancel:
            undrain(self.m, request.node_id)
            return pb.DrainResponse(num_blocks_to_move=0)
        return pb.DrainResponse(num_blocks_to_move=drain(self.m, request.node_id))

    @rpc_errors
    def Evict(self, request: pb.EvictRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        evicted, shortfall = admin_evict(self.m, request.fraction, request.node_id)
        return pb.EvictResponse(num_evicted=evicted, shortfall=shortfall)

    @rpc_errors
    def InvalidateNamespace(
        self, request: pb.InvalidateNamespaceRequest, context: grpc.ServicerContext
    ) -> pb.InvalidateNamespaceResponse:
        self.m.invalidate_namespace(request.namespace)
        return pb.InvalidateNamespaceResponse()
