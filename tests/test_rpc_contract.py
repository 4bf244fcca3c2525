"""The wire contract: committed stubs match the .proto; exceptions map to one status each; servers
answer health checks and reflection."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import errors
from kvpool.rpc.server import (
    CONNECT_TIMEOUT_MS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    channel,
    start_server,
    wait_healthy,
)
from kvpool.rpc.status import raise_from_rpc_error, status_for

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (errors.StaleGeneration("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.DeadlineExceeded("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.ChecksumMismatch("x"), grpc.StatusCode.DATA_LOSS),
        (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_mapping(exc: Exception, code: grpc.StatusCode) -> None:
    assert status_for(exc) == code


def test_health_and_reflection_registered() -> None:
    server = start_server([], host="127.0.0.1", port=0)
    try:
        address = f"127.0.0.1:{server.port}"
        wait_healthy(address, timeout_s=10)
        with channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
            except grpc.RpcError as exc:
                with pytest.raises(errors.NotFound):
                    raise_from_rpc_error(exc, "health")
    finally:
        server.stop(0)


def _delaying_proxy(target_port: int, delay_s: float) -> tuple[socket.socket, int]:
    """A TCP proxy to 127.0.0.1:`target_port` that holds each new connection `delay_s` before forwarding
    (a peer slow to answer its handshake: a busy host, a long path). Returns (listening socket, port)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = lsock.accept()
                time.sleep(delay_s)
                upstream = socket.create_connection(("127.0.0.1", target_port))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return lsock, lsock.getsockname()[1]


def test_a_connection_attempt_gets_its_timeout_not_more_nor_less() -> None:
    """Our channels once gave a connection attempt 0.1 s (gRPC reads its minimum connect timeout from
    `grpc.min_reconnect_backoff_ms`, set low for fast reconnects): a server slower than that to answer its
    handshake, as a loaded 2-core host is, failed every call UNAVAILABLE. A peer that never answers still
    fails in about `CONNECT_TIMEOUT_MS` (gRPC's default is 20 s: a router would hold a request that long
    before failing over)."""
    server = start_server([], host="127.0.0.1", port=0)
    lsock, port = _delaying_proxy(server.port, 0.4)
    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    try:
        with channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with channel(f"127.0.0.1:{silent.getsockname()[1]}") as ch:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            elapsed = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert CONNECT_TIMEOUT_MS / 1000 * 0.8 <= elapsed < 10, elapsed
    finally:
        lsock.close()
        silent.close()
        server.stop(0)


_HANGING_SERVER = """
import time
from kvpool.rpc.server import start_server
s = start_server([], host="127.0.0.1", port=0)
print(s.port, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_call_to_a_peer_that_hangs_fails_within_the_keepalive() -> None:
    """A peer that stops answering with its connection open (SIGSTOP: the kernel still acknowledges every
    TCP segment) held a streaming call until its deadline. The channel's keepalive pings now drop the
    connection after `KEEPALIVE_TIME_MS` + `KEEPALIVE_TIMEOUT_MS`: UNAVAILABLE, which the router fails over
    on. The server side accepts those pings (no GOAWAY "too_many_pings" on a healthy, quiet call)."""
    proc = subprocess.Popen([sys.executable, "-c", _HANGING_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            quiet = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            assert next(quiet).status == health_pb2.HealthCheckResponse.SERVING
            # a healthy call that sends nothing for several keepalive periods stays up
            time.sleep(3 * KEEPALIVE_TIME_MS / 1000)
            assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                next(quiet)
            elapsed = time.monotonic() - t0
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert elapsed < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 10, (
            elapsed,
            info.value.details(),
        )
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
