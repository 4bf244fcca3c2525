"""Start a master: the gRPC service plus its background maintenance thread."""

from __future__ import annotations

import logging

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
    grpc_server = start_aio_server(
        [(service_handler(MASTER, pb, AioMasterServicer(master)), "kvpool.v1.Master")],
        host=settings.bind_host,
        port=settings.port,
        max_workers=settings.max_workers,
        max_concurrent_rpcs=settings.max_concurrent_rpcs,
        interceptors=[MemberGate(master.members)] if master.members.secured else [],
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
    master.members.warn_if_unsecured()
    log.info("master on %s:%d (layout %s)", settings.bind_host, grpc_server.port, settings.layout)
    return MasterServer(master, grpc_server, maintenance, settings.bind_host, metrics)
