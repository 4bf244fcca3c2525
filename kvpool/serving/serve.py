"""Run a serving node (prefill or decode) until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvpool.client.master_link import HeartbeatReport
from kvpool.errors import KVPoolError
from kvpool.metrics import address_of, maybe_start
from kvpool.rpc.process import print_ready
from kvpool.rpc.server import start_server
from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric
from kvpool.serving.runtime import NodeRuntime
from kvpool.types import NodeLoad

log = logging.getLogger(__name__)


class NodeRefused(KVPoolError):
    """The master refused this node's re-registration while it ran (e.g. another live node took its id)."""


def default_node_id(role: str, port: int) -> str:
    """`role-host-port`, or `role-host-pPID` with an ephemeral port: two nodes on one host never share an
    id by default (the master refuses a node id a live node holds)."""
    import socket

    return f"{role}-{socket.gethostname()}-{port or f'p{os.getpid()}'}"


Registration = tuple[Callable[[Any, grpc.Server], None], Any, str]
"""A servicer for `kvpool.rpc.server.start_server`: (add_*Servicer_to_server, servicer, service name)."""


def start_node(settings: ServingSettings, *, role: str, latency: LatencyMetric) -> NodeRuntime:
    """A node's runtime (`NodeRuntime.start`: model, calibration, master and pool clients, metrics with
    the role's `latency` histogram), under `default_node_id` when `settings` name no node id.

    Before the model loads, `kvpool.serving.preflight.check_master` waits for the master (at most
    `settings.master_wait_s`) and raises what it would refuse: `Unavailable`, `Unauthenticated`,
    `FailedPrecondition` (layout), `AlreadyExists` (node id)."""
    from kvpool.model.runner import model_layout
    from kvpool.serving.preflight import check_master

    if not settings.node_id:
        settings = settings.model_copy(update={"node_id": default_node_id(role, settings.port)})
    layout = model_layout(settings.model, block_size=settings.block_size)
    check_master(settings.master, settings.master_wait_s, layout, settings.node_id)
    return NodeRuntime.start(settings, role=role, latency=latency)


def serve_node(
    rt: NodeRuntime,
    registrations: Sequence[Registration],
    *,
    queue_len: Callable[[], int],
    on_stop: Callable[[], None] = lambda: None,
) -> None:
    """Serve a started node: the gRPC server (its `registrations`) and `/metrics`, register with the
    master, print the READY line, and block until a stop signal; `queue_len` feeds heartbeats and metrics,
    `on_stop` runs after the server stopped. A registration the master refuses (`AlreadyExists`: a live
    node holds this node id) raises before READY, with everything started so far stopped; a refused
    re-registration later stops the node and raises `NodeRefused`."""
    settings, role = rt.settings, rt.role
    server = start_server(registrations, host=settings.bind_host, port=settings.port)
    address = f"{settings.bind_host}:{server.port}"
    rt.metrics.set_queue_len(queue_len)
    metrics = maybe_start(
        rt.metrics.registry, enabled=settings.metrics, host=settings.bind_host, port=settings.metrics_port
    )

    def report() -> HeartbeatReport:
        return HeartbeatReport(load=NodeLoad(queue_len=queue_len(), **rt.load_info()))

    def shutdown() -> None:
        if rt.link is not None:
            rt.link.stop()  # deregister first: the router stops sending new requests here
        server.stop(1.0)
        if metrics is not None:
            metrics.stop()
        on_stop()
        rt.close()

    stop = threading.Event()
    fatal: list[str] = []

    def on_fatal(message: str) -> None:
        fatal.append(message)
        stop.set()

    try:
        rt.attach_link(address, report, on_fatal=on_fatal)
    except BaseException:
        shutdown()  # refused (or no master): release the port and threads before the caller hears why
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print_ready(
        {
            "node_id": settings.node_id,
            "role": role,
            "grpc_address": address,
            "metrics_address": address_of(metrics),
            "model_id": rt.runner.model_id,
            "synthetic": rt.runner.synthetic,
        }
    )
    try:
        stop.wait()
    finally:
        log.info("%s %s stopping", role, settings.node_id)
        shutdown()
    if fatal:
        raise NodeRefused(f"{role} node {settings.node_id} stopped: the master refused it: {fatal[0]}")
