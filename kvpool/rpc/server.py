"""Start a gRPC server with health checking and reflection registered (so `grpcurl` works), and make
channels; both apply the cluster's optional auth token and TLS (`kvpool.rpc.security`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.rpc.security import bind, secure_channel, security, server_interceptors
from kvpool.rpc.status import DecodeErrors
from kvpool.v1 import kvpool_pb2

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
CONNECT_TIMEOUT_MS = 1000
"""How long a channel's connection attempt may take (TCP connect, TLS and HTTP/2 handshake) before the
calls waiting on it fail UNAVAILABLE: a peer that drops packets or never answers costs this, not gRPC's
default 20 s. gRPC takes it from `grpc.min_reconnect_backoff_ms` (its MIN_CONNECT_TIMEOUT; measured here:
100 there failed connection attempts to a server slower than 0.1 s to send its HTTP/2 SETTINGS)."""
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
"""A channel with calls in flight pings its peer after `KEEPALIVE_TIME_MS` without traffic and drops the
connection when no answer comes within `KEEPALIVE_TIMEOUT_MS`: its calls fail UNAVAILABLE. A peer that
hangs (stopped, swapped out, wedged) with its connections open otherwise held every call until its
deadline (a router's prefill call: 300 s) — the kernel keeps acknowledging its TCP segments."""
# Channels reconnect quickly after a peer restarts (gRPC's default backoff grows to minutes): a restarted
# master is back in the cluster within about a second, not after a long reconnect backoff.
_CHANNEL_OPTIONS = [
    *_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # what gRPC >= 1.6x waits for a ping's ack (1 min)
    ("grpc.http2.max_pings_without_data", 0),  # a long call that sends nothing (a prefill) keeps pinging
]
# Servers accept those pings (gRPC servers answer pings more often than every 5 min without data frames
# with GOAWAY "too_many_pings", which would close the very connections the pings keep checked).
_SERVER_OPTIONS = [
    *_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


class GrpcServer:
    """A running gRPC server: `.port` is the bound port (ephemeral when asked for 0)."""

    def __init__(self, server: grpc.Server, port: int, health_servicer: health.HealthServicer) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)

    def stop(self, grace_s: float = 1.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_server(
    registrations: Sequence[tuple[Callable[[Any, grpc.Server], None], Any, str]],
    *,
    host: str,
    port: int,
    max_workers: int = 16,
    max_concurrent_rpcs: int | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> GrpcServer:
    """Start a server on `host:port` (port 0 = ephemeral) with the given servicers.

    `registrations`: `(add_XServicer_to_server, servicer, "kvpool.v1.X")` triples. Health checking and
    reflection are always registered. `max_concurrent_rpcs` bounds the calls in flight (running or
    queued for a worker, streams included): more are refused at once with RESOURCE_EXHAUSTED instead of
    waiting in an unbounded queue (None: no bound). `interceptors` run after the bearer-token check.
    Raises `OSError` when the address cannot be bound.
    """
    sec = security()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=_SERVER_OPTIONS,
        interceptors=[*server_interceptors(sec), *interceptors, DecodeErrors()],
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names, server)
    _ = kvpool_pb2  # the descriptor pool must hold our services for reflection
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = bind(server, address, sec)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    server.start()
    result = GrpcServer(server, bound, health_servicer)
    result.set_serving(True)
    log.info("gRPC server on %s:%d serving %s", host, bound, ", ".join(names[2:]))
    return result


def channel(address: str) -> grpc.Channel:
    """A channel with our message-size limits, and TLS / the bearer token when configured
    (`kvpool.rpc.security`)."""
    return secure_channel(address, _CHANNEL_OPTIONS, security())


def wait_healthy(address: str, timeout_s: float = 30.0) -> None:
    """Block until the server at `address` answers its health check SERVING; `TimeoutError` otherwise."""
    import time

    deadline = time.monotonic() + timeout_s
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"gRPC server at {address} not healthy within {timeout_s:.0f} s")
            time.sleep(0.05)
