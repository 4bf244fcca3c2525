"""The election's claims and credentials on a real etcd (in-process `Election`s): with the cluster secret a
leader whose key is replaced by a forged one leads on without a break, at a new epoch it marks as
continued; a forged key with no leader is cleared by a standby after a lease TTL; the election reaches an
etcd that requires TLS with client certificates; an etcd password file readable by others is
refused."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from kvpool.capability import Capabilities, CapabilityKey
from kvpool.cluster.etcd import ThrowawayEtcd, enable_etcd_auth
from kvpool.cluster.tls import write_etcd_tls
from kvpool.master.ha.election import LEADER, Election, parse_endpoints
from kvpool.master.ha.endpoints import EtcdAuth, read_etcd_auth
from tests.capabilities import require_etcd
from tests.etcd_server import etcd, start_etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until

pytestmark = pytest.mark.timeout(90)
KEY = Capabilities(CapabilityKey(b"c" * 32))


def forge(endpoint: str, key: bytes, value: bytes) -> None:
    """Put `value` at `key` (no lease), over whatever is there: as a process with write access would."""
    from aetcd import Client

    host, port = endpoint.rsplit(":", 1)

    async def run() -> None:
        async with Client(host=host, port=int(port)) as c:
            await c.put(key, value)

    asyncio.run(run())


def test_a_leader_whose_key_is_forged_leads_on_without_a_break(etcd: ThrowawayEtcd) -> None:  # noqa: F811
    led: list[tuple[int, bool]] = []
    a = Election(parse_endpoints(etcd.endpoint), prefix="/c1", lease_ttl_s=3, key=KEY,
                 on_lead=lambda e: led.append((e, a.continued)))  # fmt: skip
    a.start("a:1")
    roles: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            roles.append(a.role)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        wait_until(lambda: a.is_leader, 10, "a leads")
        e1 = a.view().epoch
        watcher.start()
        forge(etcd.endpoint, a.leader_key, b"x:9")
        wait_until(lambda: a.view().epoch > e1, 10, "a leads again at a new epoch")
        stop.set()
        watcher.join()
        assert set(roles) == {LEADER} and a.view().leader == "a:1" and a.num_forged == 1
        assert led == [(e1, False), (a.view().epoch, True)]  # the new epoch continues the term
    finally:
        stop.set()
        a.stop()


def test_a_forged_key_with_no_leader_is_cleared_by_a_standby(etcd: ThrowawayEtcd) -> None:  # noqa: F811
    forge(etcd.endpoint, b"/c2/leader", b"x:9")  # before any master: no one leads to delete it
    b = Election(parse_endpoints(etcd.endpoint), prefix="/c2", lease_ttl_s=2, key=KEY)
    b.start("b:1")
    try:
        wait_until(lambda: b.num_forged >= 1, 10, "b sees the forged key")
        assert b.view().leader == ""  # names no leader meanwhile
        wait_until(lambda: b.is_leader, 10, "b clears it after a lease TTL and leads")
    finally:
        b.stop()


def test_the_election_reaches_etcd_over_tls_with_a_client_certificate(tmp_path: Path) -> None:
    require_etcd()
    files = write_etcd_tls(tmp_path / "etcd-tls")  # what kvpool up makes: etcd's CA, server and client certs
    server = ThrowawayEtcd(log_dir=tmp_path / "etcd", tls=files.server)
    tls = EtcdAuth(ca_file=files.ca, cert_file=files.client_cert, key_file=files.client_key)
    a = Election(parse_endpoints(server.endpoint), prefix="/c3", lease_ttl_s=2, key=KEY, etcd_auth=tls)
    plain = Election(parse_endpoints(server.endpoint), prefix="/c3", lease_ttl_s=2, key=KEY)
    try:
        a.start("a:1")
        wait_until(lambda: a.is_leader, 15, "a leads over TLS")
        plain.start("p:1")  # no TLS: etcd never answers it
        time.sleep(3)
        assert plain.view().leader == "" and not plain.is_leader
    finally:
        a.stop()
        plain.stop()
        server.stop()


def test_etcd_credentials_are_checked_at_start(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        read_etcd_auth("kvpool", str(secret))
    secret.chmod(0o600)
    assert read_etcd_auth("kvpool", str(secret)) == EtcdAuth("kvpool", "s3cret")
    with pytest.raises(ValueError, match="both etcd_user and etcd_password_file"):
        read_etcd_auth("kvpool", "")
    with pytest.raises(ValueError, match="needs etcd_ca_file"):
        read_etcd_auth("", "", "", str(secret), str(secret))
    with pytest.raises(ValueError, match="is not a file"):
        read_etcd_auth("", "", str(tmp_path / "missing.pem"))


def test_an_etcd_with_auth_takes_the_election_s_writes_only_with_the_password(tmp_path: Path) -> None:
    server = start_etcd(tmp_path / "etcd")
    try:
        env = enable_etcd_auth(server.endpoint, tmp_path / "auth")
        auth = read_etcd_auth(env["KVPOOL_ETCD_USER"], env["KVPOOL_ETCD_PASSWORD_FILE"])
        a = Election(
            parse_endpoints(server.endpoint), prefix="/kvpool/m", lease_ttl_s=2, key=KEY, etcd_auth=auth
        )
        anonymous = Election(parse_endpoints(server.endpoint), prefix="/kvpool/m", lease_ttl_s=2, key=KEY)
        try:
            a.start("a:1")
            wait_until(lambda: a.is_leader, 10, "a leads with the password")
            anonymous.start("n:1")
            time.sleep(2)
            assert anonymous.view().leader == "" and a.is_leader  # etcd refuses it everything
        finally:
            anonymous.stop()
            a.stop()
        with pytest.raises(Exception, match="user name is empty"):
            forge(server.endpoint, b"/kvpool/m/leader", b"x:9")
    finally:
        server.stop()
