"""The router's door (issue 46, item 3): an unknown API key is refused from the headers before the body is
read, a slow body is cut off, a tenant's in-flight requests and the open connections are capped, the
tenants file is re-read when it changes, and no `/metrics` names a tenant.

A real `kvpool router` process on 127.0.0.1:0 (with `--block-size`, so it serves without a master: a
request that passes the door is answered 503 "no live prefill node"), spoken to over raw sockets so a
test controls exactly which bytes of a request are sent; a real `kvpool master` for its `/metrics`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.master.procs import LAYOUT, Proc, start
from kvpool.tenants import derived_salt, tenant_id
from tests.tenant_files import SALT_KEY, salt_key_file, write_private

ACME, GLOBEX = "acme-corp-tenant", "globex-tenant"
TENANTS = f"""
[[tenants]]
name = "{ACME}"
api_keys = ["sk-acme"]
pool_quota_blocks = 100

[[tenants]]
name = "{GLOBEX}"
api_keys = ["sk-globex"]
"""
PER_TENANT = 2
CONNECTIONS = 4
BODY_TIMEOUT_S = 3.0
BODY = b'{"model": "m", "prompt": "hello", "max_tokens": 2}'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(the router's host:port, its tenants file)."""
    d = Path(tmp_path_factory.mktemp("door"))
    tfile = write_private(d / "tenants.toml", TENANTS)
    proc = start(
        [
            "router", "--master", f"127.0.0.1:{_free_port()}", "--port", "0", "--block-size", "64",
            "--served-model-name", "m",
            "--tenants", str(tfile), "--salt-key-file", str(salt_key_file(d)),
            "--max-inflight-per-tenant", str(PER_TENANT), "--max-connections", str(CONNECTIONS),
            "--body-timeout-s", str(BODY_TIMEOUT_S),
        ]
    )  # fmt: skip
    try:
        yield str(proc.ready["http_address"]), tfile
    finally:
        proc.kill()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _head(path: str, key: str | None, length: int, method: str = "POST") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one response; the body read to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the connection closed before an answer: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return False


def _request(
    address: str, path: str, key: str | None, body: bytes = BODY
) -> tuple[int, dict[str, str], bytes]:
    with _connect(address) as sock:
        sock.sendall(_head(path, key, len(body)) + body)
        return _answer(sock)


def _get(address: str, path: str, key: str | None = None) -> int:
    with _connect(address) as sock:
        sock.sendall(_head(path, key, 0, method="GET"))
        return _answer(sock)[0]


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_an_unauthenticated_16_mib_body_is_refused_401_before_it_is_read(
    router: tuple[str, Path], key: str | None
) -> None:
    """Headers announce 16 MiB (the body limit) and only 10 bytes follow: the 401 comes back anyway, and
    the router closes the connection rather than take in the rest."""
    address, _ = router
    with _connect(address) as sock:
        sock.sendall(_head("/v1/completions", key, 16 * 2**20) + b'{"model": ')
        t0 = time.monotonic()
        status, headers, body = _answer(sock)
        waited_s = time.monotonic() - t0
        assert status == 401, (status, body)
        assert b"invalid_api_key" in body and headers.get("connection") == "close", headers
        assert waited_s < BODY_TIMEOUT_S, waited_s  # not the body timeout's answer
        assert _closed_by_server(sock)


def test_a_slow_body_is_cut_off_with_408(router: tuple[str, Path]) -> None:
    address, _ = router
    with _connect(address) as sock:
        sock.sendall(_head("/v1/completions", "sk-acme", len(BODY)) + BODY[:10])
        status, headers, body = _answer(sock)
        assert status == 408, (status, body)
        assert b"body_timeout_s" in body and headers.get("connection") == "close", headers
        assert _closed_by_server(sock)


def _held(address: str, key: str) -> socket.socket:
    """A request of `key` in flight: its headers and part of its body sent, the rest withheld."""
    sock = _connect(address)
    sock.sendall(_head("/v1/completions", key, len(BODY)) + BODY[:5])
    return sock


def test_a_tenant_past_its_inflight_cap_gets_429_the_others_do_not(router: tuple[str, Path]) -> None:
    address, _ = router
    acme_id = tenant_id(derived_salt(ACME, SALT_KEY))
    held = [_held(address, "sk-acme") for _ in range(PER_TENANT)]
    try:
        gauge = f'kvpool_router_tenant_inflight_requests{{tenant="{acme_id}"}} {PER_TENANT}.0'
        deadline = time.monotonic() + 10
        while gauge not in httpx.get(f"http://{address}/metrics").text:  # the router has taken both in
            assert time.monotonic() < deadline, "the held requests never reached the router"
            time.sleep(0.05)
        status, headers, body = _request(address, "/v1/completions", "sk-acme")
        assert status == 429 and b"tenant_overloaded" in body, (status, body)
        assert headers.get("retry-after") == "1", headers
        other, _, body = _request(address, "/v1/completions", "sk-globex")
        assert other == 503 and b"no live prefill node" in body, (other, body)  # past the door
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while (status := _request(address, "/v1/completions", "sk-acme")[0]) == 429:
        assert time.monotonic() < deadline, "the tenant's slots were not given back"
        time.sleep(0.1)
    assert status == 503
    metrics = httpx.get(f"http://{address}/metrics").text
    assert f'kvpool_router_tenant_rejected_total{{tenant="{acme_id}"}} 1.0' in metrics, metrics
    assert ACME not in metrics and GLOBEX not in metrics and "acme" not in metrics


def test_connections_past_the_cap_are_answered_503(router: tuple[str, Path]) -> None:
    address, _ = router
    idle = [_connect(address) for _ in range(CONNECTIONS - 1)]
    try:
        deadline = time.monotonic() + 10  # earlier tests' connections may still be closing
        while _get(address, "/metrics") != 200:  # the cap's last connection
            assert time.monotonic() < deadline, "a request within the connection cap was refused"
            time.sleep(0.1)
        idle.append(_connect(address))
        assert _get(address, "/metrics") == 503  # one past the cap
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 10
    while _get(address, "/metrics") == 503:
        assert time.monotonic() < deadline, "closed connections were not given back"
        time.sleep(0.1)


def test_the_tenants_file_is_reloaded_when_it_changes(router: tuple[str, Path]) -> None:
    address, tfile = router
    assert _get(address, "/v1/models", "sk-new") == 401
    changed = TENANTS + '\n[[tenants]]\nname = "newco"\napi_keys = ["sk-new"]\n'

    def wait_for(key: str, status: int) -> None:
        deadline = time.monotonic() + 10
        while _get(address, "/v1/models", key) != status:
            assert time.monotonic() < deadline, f"{key} did not get {status} after the file changed"
            time.sleep(0.1)

    try:
        write_private(tfile, changed)
        wait_for("sk-new", 200)
        assert _get(address, "/v1/models", "sk-acme") == 200
        write_private(tfile, "this is = not [toml")  # a broken file keeps the tenants as they were
        time.sleep(1.5)
        assert _get(address, "/v1/models", "sk-new") == 200
        write_private(tfile, changed.replace('"sk-acme"', '"sk-acme-2"'))  # a key removed
        wait_for("sk-acme", 401)
        assert _get(address, "/v1/models", "sk-acme-2") == 200
        # an edit refused for the file's mode applies once the mode is fixed: the chmod alone, no new content
        tfile.write_text(changed.replace('"sk-acme"', '"sk-acme-3"'))
        os.chmod(tfile, 0o644)
        time.sleep(1.5)
        assert _get(address, "/v1/models", "sk-acme-3") == 401
        os.chmod(tfile, 0o600)
        wait_for("sk-acme-3", 200)
    finally:
        write_private(tfile, TENANTS)
        wait_for("sk-acme", 200)


def test_the_masters_metrics_name_no_tenant(tmp_path: Path) -> None:
    """The master keys the tenants' salts with the same salt key and labels its quota series by opaque id."""
    tfile = write_private(tmp_path / "tenants.toml", TENANTS)
    env = {"KVPOOL_TENANTS": str(tfile), "KVPOOL_TENANT_SALT_KEY_FILE": str(salt_key_file(tmp_path))}
    master: Proc = start(["master", "--port", "0", "--layout", LAYOUT, "--metrics-port", "0"], env=env)
    try:
        metrics = httpx.get(f"http://{master.ready['metrics_address']}/metrics").text
    finally:
        master.kill()
    acme_id = tenant_id(derived_salt(ACME, SALT_KEY))
    assert f'kvpool_master_tenant_pool_quota_blocks{{tenant="{acme_id}"}} 100.0' in metrics, metrics
    assert ACME not in metrics and "acme" not in metrics
