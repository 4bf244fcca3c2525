"""Start a master: the gRPC service plus its background maintenance thread."""

from __future__ import annotations

import logging

import grpc

from kvpool.master.aio_service import AioMasterServicer
from kvpool.master.core import Master
from kvpool.master.gate import MemberGate
from kvpool.master.maintenance import Maintenance
from kvpool.master.metrics import master_registry
from kvpool.master.settings import MasterSettings
from kvpool.metrics import MetricsServer, address_of, maybe_start
from kvpool.rpc.aio_server import AioGrpcServer, service_handler, start_aio_server
from kvpool.rpc.server import GrpcServer
from kvpool.types import Clock
from kvpool.v1 import kvpool_pb2 as pb

MASTER = pb.DESCRIPTOR.services_by_name["Master"]

log = logging.getLogger(__name__)


class MasterServer:
    """A running master; `address` is "host:port", `metrics_address` its `/metrics` ("" when off).
    The caller owns it and calls `stop()` once."""

    def __init__(
        self,
        master: Master,
        grpc_server: GrpcServer | AioGrpcServer,
        maintenance: Maintenance,
        host: str,
        metrics: MetricsServer | None = None,
    ) -> None:
        self.master = master
        self.grpc = grpc_server
        self.maintenance = maintenance
        self.address = f"{host}:{grpc_server.port}"
        self.metrics = metrics
        self.metrics_address = address_of(metrics)

    def wait(self) -> None:
        self.grpc.wait()

    def stop(self) -> None:
        if self.master.election is not None:
            self.master.election.stop()  # revokes the lease: a standby takes over at once
        self.maintenance.stop()
        if self.metrics is not None:
            self.metrics.stop()
        self.grpc.stop(0.5)
        self.master.stores.close()


def serve(settings: MasterSettings, *, clock: Clock | None = None) -> MasterServer:
    """Start the service on `settings.bind_host:settings.port` (0 = ephemeral), its maintenance and (when
    `settings.metrics`) Prometheus `/metrics` on `settings.metrics_port`."""
    master = Master(settings, clock=clock)
    maintenance = Maintenance(master)
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if master.members.secured:
        interceptors.append(MemberGate(master.members))
    if settings.etcd:
        interceptors.insert(0, _elect(master, settings))
    grpc_server = start_aio_server(
        [(service_handler(MASTER, pb, AioMasterServicer(master)), "kvpool.v1.Master")],
        host=settings.bind_host,
        port=settings.port,
        max_workers=settings.max_workers,
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        interceptors=interceptors,
    )
    try:
        metrics = maybe_start(
            master_registry(master),
            enabled=settings.metrics,
            host=settings.bind_host,
            port=settings.metrics_port,
        )
    except BaseException:
        grpc_server.stop(0)
        raise
    maintenance.start()
    if master.election is not None:
        master.election.start(advertised_address(settings, grpc_server.port))
    master.members.warn_if_unsecured()
    log.info("master on %s:%d (layout %s)", settings.bind_host, grpc_server.port, settings.layout)
    return MasterServer(master, grpc_server, maintenance, settings.bind_host, metrics)


def advertised_address(settings: MasterSettings, port: int) -> str:
    """`settings.advertise_address`, else "bind_host:port" (127.0.0.1 for a wildcard bind)."""
    if settings.advertise_address:
        return settings.advertise_address
    host = settings.bind_host
    return f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"


def _elect(master: Master, settings: MasterSettings) -> grpc.aio.ServerInterceptor:
    """Create `master.election` (not started) and the gate that keeps a non-leader from taking writes."""
    try:
        from kvpool.master.ha.election import Election
    except ImportError as exc:
        raise RuntimeError(f"--etcd needs the etcd client: pip install 'kvpool[ha]' ({exc})") from None
    from kvpool.master.ha.endpoints import parse_endpoints, read_etcd_auth
    from kvpool.master.ha.gate import LeaderGate

    def on_lead(epoch: int) -> None:
        election = master.election
        assert election is not None
        previous = master.leader_epoch
        if previous not in (0, epoch) and not election.continued:  # continued: a forged key, deleted
            forget_previous_term(master, previous, epoch)
        # set before the role turns leader: every store order (with the leader's proof) and capability carries it
        master.stores.lead(master.capabilities, election.address, epoch)
        master.leader_epoch = epoch

    master.election = Election(
        parse_endpoints(settings.etcd),
        prefix=settings.ha_prefix,
        lease_ttl_s=settings.ha_lease_ttl_s,
        on_lead=on_lead,
        key=master.capabilities,
        etcd_auth=read_etcd_auth(
            settings.etcd_user,
            settings.etcd_password_file,
            settings.etcd_ca_file,
            settings.etcd_cert_file,
            settings.etcd_key_file,
        ),
    )
    election = master.election
    master.stores.leading = lambda: election.is_leader  # no store order from a master not surely leading
    return LeaderGate(election)


def forget_previous_term(master: Master, previous: int, epoch: int) -> None:
    """A master leading again after another one led: what it knew of nodes is stale (they registered with
    the other leader, which placed and freed blocks). Forget every node, with no free orders: their next
    heartbeats answer `known=false`, they re-register, and the stores' inventories are adopted afresh."""
    with master.lock:
        live = [rec for rec in master.st.nodes.values() if rec.alive]
        for rec in live:
            master._forget_node(rec)
        master.st.free_q.clear()
    log.warning(
        "leading again (epoch %d after %d): forgot %d nodes of the previous term", epoch, previous, len(live)
    )
