"""`MasterClient`: typed calls to the master. Every call has a deadline; errors are `kvpool.errors`.

Idempotent calls are retried (a few times, short backoff) when the master is `Unavailable`; calls whose
repetition would change state twice (reserve, counted matches, evict, drain, remove) are not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from kvpool.client import convert as cv
from kvpool.client.errors import raise_refined
from kvpool.client.leader import Masters, never_sent, not_leader_redirect
from kvpool.client.match_stream import MatchStream
from kvpool.client.types import (
    AdapterStatus,
    CommitBlock,
    CommitResult,
    HeartbeatAnswer,
    MastersStatus,
    Match,
    NodeInfo,
    NodeLoad,
    NodeStatus,
    PoolStats,
    Registration,
    Reservation,
)
from kvpool.types import DiskTierReport, Location
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

T = TypeVar("T")
_RETRIES = 3
_MAX_MOVES = 2
"""Moves to another master per call after a refusal that did not run it (not the leader, no connection)."""


def _none_answered(tried: list[str], details: str | None) -> str:
    """ " (none of a:1, b:2 answered)" when a call that reached no master was tried on several."""
    if len(set(tried)) < 2 or not never_sent(details):
        return ""
    return f" (none of {', '.join(dict.fromkeys(tried))} answered)"


class MasterClient:
    """A channel to the master at `address` ("host:port"); thread-safe; `close()` when done.

    `address` may list several masters in high availability ("a:1,b:2,c:3"; the first is tried first).
    A call that did not run, refused by a master that does not lead (UNAVAILABLE "not the leader (leader is
    X)") or not connected at all, is sent again to X when X is in the list (else, or with no leader named,
    to the next master of the list: a leader named outside the list is never called, so a forged etcd key
    receives no call and no join token), at most `_MAX_MOVES` times; later calls go there too. Idempotent calls retried on UNAVAILABLE
    also move on to the next master of the list. `address` is the master in use."""

    def __init__(self, address: str, *, timeout_s: float = 5.0) -> None:
        self._masters = Masters(address)
        self.addresses = self._masters.addresses
        self.timeout_s = timeout_s
        self._sessions: dict[str, bytes] = {}  # node id -> its registration's session (secured master)
        self.leader_epoch = 0
        """The newest leader epoch a master's answer carried (registration, heartbeat, match, reserve; 0: a
        single master or none yet)."""

    def saw_leader(self, epoch: int) -> None:
        """Note a master's answer at leader `epoch` (kept: the newest)."""
        if epoch > self.leader_epoch:
            self.leader_epoch = int(epoch)

    @property
    def address(self) -> str:
        """The master in use ("host:port")."""
        return self._masters.address

    @property
    def _stub(self) -> pb_grpc.MasterStub:
        return self._masters.stub

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._masters.close()

    def _call(self, name: str, request: Any, *, retry: bool = False, timeout_s: float | None = None) -> Any:
        attempts = _RETRIES if retry else 1
        attempt = moves = 0
        tried: list[str] = []
        while True:
            ms = self._masters
            address, stub = ms.address, ms.stub
            method: Callable[..., Any] = getattr(stub, name)
            tried.append(address)
            try:
                return method(request, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise_refined(exc, f"{name} at master {address}")
                details = exc.details() if hasattr(exc, "details") else ""
                leader = not_leader_redirect(details)
                if (leader is not None or never_sent(details)) and moves < _MAX_MOVES:
                    # the call did not run there: send it once more, to the leader named (only one of the
                    # masters configured: a standby may repeat a forged etcd key) or the next master
                    named = leader if leader and leader != address and leader in ms.addresses else ""
                    target = named or ms.next_after(address)
                    if target and target != address:
                        moves += 1
                        ms.use(target)
                        continue
                if attempt + 1 < attempts:
                    time.sleep(0.05 * 2**attempt)
                    attempt += 1
                    if leader is None and (following := ms.next_after(address)):
                        ms.use(following)  # that master is down: try the next one
                    continue
                raise_refined(exc, f"{name} at master {address}{_none_answered(tried, details)}")

    # ---- nodes ------------------------------------------------------------------------------------
    def register_node(
        self,
        node: NodeInfo,
        *,
        protocol_version: int,
        layout_fingerprint: str,
        num_slots: int = 0,
        block_nbytes: int = 0,
        challenge: bytes = b"",
        proof: bytes = b"",
    ) -> Registration:
        """Join the pool (again). A store offers `num_slots` of `block_nbytes` and, in a secured cluster,
        answers a `join_challenge` with a `proof` of the cluster secret (`kvpool.membership.store_proof`).
        Refusals: `FailedPrecondition` (protocol or layout mismatch), `AlreadyExists` (a live node holds
        the id), `InvalidArgument`, `Unauthenticated` / `PermissionDenied` (secured cluster)."""
        req = pb.RegisterNodeRequest(
            node=cv.endpoint_pb(node),
            protocol_version=protocol_version,
            layout_fingerprint=layout_fingerprint,
            num_slots=num_slots,
            block_nbytes=block_nbytes,
            challenge=challenge,
            proof=proof,
        )
        resp = self._call("RegisterNode", req, retry=True)
        self._sessions[node.node_id] = bytes(resp.session)  # our heartbeats and deregistration carry it
        self.saw_leader(resp.leader_epoch)
        return Registration(
            resp.heartbeat_interval_ms,
            resp.master_epoch,
            resp.layout_fingerprint,
            int(resp.leader_epoch),
            resp.leader_proof,
        )

    def join_challenge(self, node_id: str) -> bytes:
        """A fresh challenge a store answers with its registration's proof; b"" when the master runs
        unsecured (no cluster secret)."""
        req = pb.JoinChallengeRequest(node_id=node_id)
        return bytes(self._call("JoinChallenge", req, retry=True).challenge)

    def heartbeat(
        self,
        node_id: str,
        epoch: int,
        *,
        freed_slots: Sequence[tuple[int, int]] = (),
        num_used_slots: int = 0,
        load: NodeLoad | None = None,
        disk: DiskTierReport | None = None,
    ) -> HeartbeatAnswer:
        """`known` false: the master does not know this node/epoch (register again); `flush_epoch`: see
        `kvpool.v1.HeartbeatResponse`."""
        req = pb.HeartbeatRequest(
            node_id=node_id,
            epoch=epoch,
            freed_slots=[pb.SlotRef(slot=s, generation=g) for s, g in freed_slots],
            num_used_slots=num_used_slots,
            load=cv.load_pb(load or NodeLoad()),
            session=self._sessions.get(node_id, b""),
            disk=cv.disk_tier_pb(disk),
        )
        resp = self._call("Heartbeat", req, retry=True)
        self.saw_leader(resp.leader_epoch)
        return HeartbeatAnswer(
            bool(resp.known),
            int(resp.master_epoch),
            int(resp.flush_epoch),
            int(resp.leader_epoch),
            resp.leader_proof,
        )

    def deregister_node(self, node_id: str, epoch: int, *, timeout_s: float | None = None) -> bool:
        """Leave the pool now (a graceful stop); False when the master knew no live node with that id and
        epoch. Not retried: callers on their way out give it one short try."""
        req = pb.DeregisterNodeRequest(node_id=node_id, epoch=epoch, session=self._sessions.get(node_id, b""))
        return bool(self._call("DeregisterNode", req, timeout_s=timeout_s).known)

    def list_nodes(self) -> list[NodeStatus]:
        return [cv.node_status(n) for n in self._call("ListNodes", pb.ListNodesRequest(), retry=True).nodes]

    def drain(self, node_id: str, *, cancel: bool = False) -> int:
        """Drain a store (the blocks it must move), or with `cancel` stop draining it (0)."""
        return int(self._call("Drain", pb.DrainRequest(node_id=node_id, cancel=cancel)).num_blocks_to_move)

    # ---- namespaces -------------------------------------------------------------------------------
    def register_namespace(
        self,
        model_id: str,
        weights_version: str,
        layout_fingerprint: str,
        *,
        cache_salt: str = "",
        adapter_digest: str = "",
        extra: Mapping[str, str] | None = None,
    ) -> tuple[bytes, str]:
        """Returns (namespace digest, the model's active version)."""
        req = pb.RegisterNamespaceRequest(
            model_id=model_id,
            weights_version=weights_version,
            layout_fingerprint=layout_fingerprint,
            cache_salt=cache_salt,
            adapter_digest=adapter_digest,
            extra=dict(extra or {}),
        )
        resp = self._call("RegisterNamespace", req, retry=True)
        return bytes(resp.namespace), resp.active_version

    def set_model_version(
        self, model_id: str, weights_version: str, *, force: bool = False
    ) -> tuple[str, int, int]:
        """Returns (previous version, namespaces invalidated, blocks made unreachable). `FailedPrecondition`
        when no registered namespace or live engine of the model uses `weights_version` (a typo), unless
        `force` (activating a version ahead of its rollout)."""
        req = pb.SetModelVersionRequest(model_id=model_id, weights_version=weights_version, force=force)
        resp = self._call("SetModelVersion", req, retry=True)
        return resp.previous_version, int(resp.num_namespaces_invalidated), int(resp.num_blocks_unreachable)

    def invalidate(self, namespace: bytes) -> None:
        self._call("InvalidateNamespace", pb.InvalidateNamespaceRequest(namespace=namespace), retry=True)

    # ---- adapters (kvpool.master.adapters) ---------------------------------------------------------
    def register_adapter(self, model_id: str, name: str, digest: str) -> bool:
        """Name an adapter of a model by its content digest (32 lowercase hex chars); True when new.
        `AlreadyExists` when the name has another digest (reload it), `ResourceExhausted` past the cap."""
        req = pb.RegisterAdapterRequest(model_id=model_id, name=name, digest=digest)
        return bool(self._call("RegisterAdapter", req, retry=True).created)

    def reload_adapter(self, model_id: str, name: str, digest: str) -> tuple[str, int, int]:
        """New weights for a named adapter: the previous digest's KV is unreachable at once. Returns
        (previous digest, namespaces invalidated, blocks invalidated)."""
        req = pb.ReloadAdapterRequest(model_id=model_id, name=name, digest=digest)
        r = self._call("ReloadAdapter", req)  # not retried: a repeat would answer (new digest, 0, 0)
        return r.previous_digest, int(r.num_namespaces_invalidated), int(r.num_blocks_invalidated)

    def unload_adapter(self, model_id: str, name: str) -> tuple[str, int, int]:
        """Forget a named adapter (its digest's KV unreachable unless another name uses it). Returns
        (its digest, namespaces invalidated, blocks invalidated)."""
        r = self._call("UnloadAdapter", pb.UnloadAdapterRequest(model_id=model_id, name=name))
        return r.previous_digest, int(r.num_namespaces_invalidated), int(r.num_blocks_invalidated)

    def list_adapters(self, model_id: str = "") -> list[AdapterStatus]:
        """Registered adapters (of `model_id`, or all), sorted by model and name."""
        r = self._call("ListAdapters", pb.ListAdaptersRequest(model_id=model_id), retry=True)
        return [
            AdapterStatus(a.model_id, a.name, a.digest, int(a.num_namespaces), int(a.num_blocks))
            for a in r.adapters
        ]

    # ---- match and leases -------------------------------------------------------------------------
    def match(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool = False,
        lease_ttl_ms: int = 0,
        num_prompt_tokens: int = 0,
        request_id: str = "",
    ) -> Match:
        req = cv.match_pb(namespace, block_hashes, count_hit, lease_ttl_ms, num_prompt_tokens, request_id)
        peek = not count_hit and lease_ttl_ms == 0
        resp = self._call("MatchPrefix", req, retry=peek)
        self.saw_leader(resp.leader_epoch)
        return cv.match(resp)

    def match_stream(self) -> MatchStream:
        """A bidirectional stream for many matches at a lower per-call cost (one caller thread)."""
        return MatchStream(self._stub, self.address)

    def renew_lease(self, lease_id: int, ttl_ms: int) -> int:
        return int(
            self._call(
                "RenewLease", pb.RenewLeaseRequest(lease_id=lease_id, ttl_ms=ttl_ms), retry=True
            ).ttl_ms
        )

    def release_lease(self, lease_id: int) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    def release_leases(self, lease_ids: Sequence[int]) -> tuple[int, int]:
        """End 1..1024 read leases in one call. Returns (released or already expired, not found). Retried
        on UNAVAILABLE: a repeat only counts the ids the first call ended as not found."""
        r = self._call("ReleaseLeases", pb.ReleaseLeasesRequest(lease_ids=list(lease_ids)), retry=True)
        return int(r.num_released), int(r.num_not_found)

    # ---- publish ----------------------------------------------------------------------------------
    def reserve(
        self,
        namespace: bytes,
        parent: bytes | None,
        block_hashes: Sequence[bytes],
        *,
        num_replicas: int = 0,
        block_nbytes: int = 0,
        recompute_cost_s: Sequence[float] = (),
        write_lease_ms: int = 0,
        writer_node_id: str = "",
        request_id: str = "",
        flush_epoch: int | None = None,
    ) -> Reservation:
        req = pb.ReserveRequest(
            namespace=namespace,
            parent_hash=parent or b"",
            block_hashes=list(block_hashes),
            num_replicas=num_replicas,
            block_nbytes=block_nbytes,
            recompute_cost_s=list(recompute_cost_s),
            write_lease_ms=write_lease_ms,
            request_id=request_id,
            writer_node_id=writer_node_id,
        )
        if flush_epoch is not None:  # the master's flush epoch when this KV was computed
            req.flush_epoch = flush_epoch
        resp = self._call("Reserve", req)
        self.saw_leader(resp.leader_epoch)
        return cv.reservation(resp)

    def commit(self, reservation_id: int, blocks: Sequence[CommitBlock]) -> CommitResult:
        req = pb.CommitRequest(reservation_id=reservation_id, blocks=[cv.commit_block_pb(b) for b in blocks])
        resp = self._call("Commit", req, retry=True)
        return CommitResult(resp.num_committed, resp.num_existing)

    def abort(self, reservation_id: int) -> None:
        self._call("Abort", pb.AbortRequest(reservation_id=reservation_id), retry=True)

    def remove(self, namespace: bytes, block_hashes: Sequence[bytes], *, force: bool = False) -> int:
        req = pb.RemoveBlocksRequest(namespace=namespace, block_hashes=list(block_hashes), force=force)
        return int(self._call("RemoveBlocks", req).num_removed)

    def report_bad_replica(
        self, namespace: bytes, block_hash: bytes, location: Location, reason: str
    ) -> None:
        req = pb.ReportBadReplicaRequest(
            namespace=namespace, block_hash=block_hash, location=cv.location_pb(location), reason=reason
        )
        self._call("ReportBadReplica", req, retry=True)

    def report_dataplane_failure(self, node_id: str, epoch: int, kind: str, detail: str) -> None:
        """A data-plane operation with store `node_id` failed (`kind`: write, read or checksum; `epoch` 0:
        its current process). The caller reports off its request path (`kvpool.client.faults`)."""
        req = pb.ReportDataPlaneFailureRequest(node_id=node_id, epoch=epoch, kind=kind, detail=detail)
        self._call("ReportDataPlaneFailure", req)

    def report_local(
        self,
        node_id: str,
        epoch: int,
        namespace: bytes = b"",
        *,
        stored: Sequence[bytes] = (),
        removed: Sequence[bytes] = (),
        cleared: bool = False,
    ) -> None:
        req = pb.ReportLocalRequest(
            node_id=node_id,
            epoch=epoch,
            namespace=namespace,
            stored=list(stored),
            removed=list(removed),
            cleared=cleared,
        )
        self._call("ReportLocal", req, retry=True)

    # ---- admin ------------------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        return cv.stats(self._call("Stats", pb.StatsRequest(), retry=True))

    def masters(self) -> MastersStatus:
        """Who leads (high availability on etcd); answered by standbys too."""
        r = self._call("Masters", pb.MastersRequest(), retry=True)
        return MastersStatus(
            ha=r.ha,
            address=r.address,
            role=r.role,
            leader=r.leader,
            epoch=r.epoch,
            standbys=tuple(r.standbys),
            etcd_endpoints=tuple(r.etcd_endpoints),
            lease_ttl_s=r.lease_ttl_s,
            elections=r.elections,
            failovers=r.failovers,
        )

    def evict(self, fraction: float, node_id: str = "") -> tuple[int, int]:
        """Returns (evicted, shortfall)."""
        resp = self._call("Evict", pb.EvictRequest(fraction=fraction, node_id=node_id))
        return int(resp.num_evicted), int(resp.shortfall)
