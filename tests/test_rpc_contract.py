"""The wire contract: committed stubs match the .proto; exceptions map to one status each; servers
answer health checks and reflection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import errors
from kvpool.rpc.server import channel, start_server, wait_healthy
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
