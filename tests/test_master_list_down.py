"""A client given several masters none of which answers says so, naming them all, not only the last one it
tried (`kvpool admin --master a,b status` with both down); one master stays one address. Real gRPC
clients against loopback ports nothing listens on."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import MasterClient
from kvpool.errors import Unavailable


def _dead_addresses(n: int) -> list[str]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()  # bound, never listening: connections are refused
    return addresses


@pytest.mark.parametrize("n", [2, 3])
def test_every_master_of_a_dead_list_is_named(n: int) -> None:
    dead = _dead_addresses(n)
    with MasterClient(",".join(dead), timeout_s=2.0) as client, pytest.raises(Unavailable) as caught:
        client.stats()
    assert f"(none of {', '.join(dead)} answered)" in str(caught.value), caught.value


def test_one_dead_master_is_one_address() -> None:
    (dead,) = _dead_addresses(1)
    with MasterClient(dead, timeout_s=2.0) as client, pytest.raises(Unavailable) as caught:
        client.stats()
    assert f"Stats at master {dead}: " in str(caught.value) and "none of" not in str(caught.value)


def test_admin_against_a_dead_list_is_one_line_naming_both() -> None:
    dead = _dead_addresses(2)
    result = CliRunner().invoke(app, ["admin", "--master", ",".join(dead), "--timeout", "2", "status"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool admin: Unavailable: "), result.output
    assert f"none of {dead[0]}, {dead[1]} answered" in lines[0], lines


def test_admin_without_tls_settings_says_how_to_reach_a_tls_cluster(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dead = _dead_addresses(1)
    monkeypatch.delenv("KVPOOL_TLS_CA_FILE", raising=False)
    result = CliRunner().invoke(app, ["admin", "--master", dead[0], "--timeout", "2", "status"])
    assert result.exit_code == 1 and "export KVPOOL_TLS_CA_FILE=" in result.output, result.output
    monkeypatch.setenv("KVPOOL_TLS_CA_FILE", "/nonexistent/ca.pem")  # TLS configured: no such hint
    result = CliRunner().invoke(app, ["admin", "--master", dead[0], "--timeout", "2", "status"])
    assert result.exit_code != 0 and "export KVPOOL_TLS_CA_FILE=" not in result.output, result.output
