"""Optional bearer-token auth and TLS on the cluster's gRPC (a real master process)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client import MasterClient
from kvpool.errors import KVPoolError, Unauthenticated
from kvpool.master.procs import start_master
from kvpool.rpc.security import security
from kvpool.rpc.server import wait_healthy
from tests.capabilities import skip


@pytest.fixture
def fresh_security(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    security.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    security.cache_clear()


def test_token_required_when_auth_is_on(fresh_security: pytest.MonkeyPatch) -> None:
    fresh_security.setenv("KVPOOL_AUTH_TOKEN", "s3cret")
    security.cache_clear()
    master = start_master()
    try:
        wait_healthy(master.grpc_address, 20)  # the health check stays open for probes
        with MasterClient(master.grpc_address) as c:
            assert c.list_nodes() == []  # our channel sends the token
        fresh_security.setenv("KVPOOL_AUTH_TOKEN", "wrong")
        security.cache_clear()
        with MasterClient(master.grpc_address) as c, pytest.raises(Unauthenticated):
            c.stats()
        fresh_security.delenv("KVPOOL_AUTH_TOKEN")
        security.cache_clear()
        with MasterClient(master.grpc_address) as c, pytest.raises(Unauthenticated):
            c.stats()
    finally:
        master.kill()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def test_tls_when_configured(fresh_security: pytest.MonkeyPatch, tmp_path: Path) -> None:
    try:
        key, cert = _self_signed(tmp_path)
    except (OSError, subprocess.CalledProcessError) as exc:
        skip("openssl", f"openssl unavailable: {exc}")
    fresh_security.setenv("KVPOOL_TLS_CERT_FILE", str(cert))
    fresh_security.setenv("KVPOOL_TLS_KEY_FILE", str(key))
    fresh_security.setenv("KVPOOL_TLS_CA_FILE", str(cert))
    security.cache_clear()
    master = start_master()
    try:
        with MasterClient(master.grpc_address) as c:
            assert c.list_nodes() == []
        for var in ("KVPOOL_TLS_CERT_FILE", "KVPOOL_TLS_KEY_FILE", "KVPOOL_TLS_CA_FILE"):
            fresh_security.delenv(var)
        security.cache_clear()
        with MasterClient(master.grpc_address, timeout_s=2.0) as c, pytest.raises(KVPoolError):
            c.stats()  # a plaintext client cannot talk to a TLS server
    finally:
        master.kill()
