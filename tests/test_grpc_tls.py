"""gRPC TLS of `kvpool up` clusters: the generated CA and certificate (`kvpool.cluster.tls`) and mutual TLS
on real master processes (`kvpool.rpc.security`), with the admin CLI as a client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvpool.client import MasterClient
from kvpool.cluster.launch import plan
from kvpool.cluster.spec import ClusterSpec
from kvpool.cluster.tls import (
    TLS_ENV,
    UpTls,
    check_host,
    san_names,
    spec_hosts,
    tls_env,
    write_cluster_tls,
    write_etcd_tls,
)
from kvpool.errors import InvalidArgument, Unavailable
from kvpool.master.procs import LAYOUT, start, start_master
from kvpool.rpc.security import security


@pytest.fixture
def fresh_security(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in (*TLS_ENV, "KVPOOL_TLS_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    security.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    security.cache_clear()


def _use(mp: pytest.MonkeyPatch, env: dict[str, str], *, drop: tuple[str, ...] = ()) -> None:
    """This process's gRPC TLS settings: exactly `env` less `drop`."""
    for name in (*TLS_ENV, "KVPOOL_TLS_SERVER_NAME"):
        mp.delenv(name, raising=False)
    for name, value in env.items():
        if name not in drop:
            mp.setenv(name, value)
    security.cache_clear()


def test_the_cluster_certificate_covers_the_hosts_and_its_key_is_0600(tmp_path: Path) -> None:
    paths = write_cluster_tls(tmp_path / "tls", ["10.20.30.40", "node-b.example"])
    assert (paths["key"].stat().st_mode & 0o777) == 0o600
    assert ((tmp_path / "tls").stat().st_mode & 0o777) == 0o700
    assert sorted(p.name for p in (tmp_path / "tls").iterdir()) == [
        "ca.pem",
        "cert.pem",
        "key.pem",
    ]  # no CA key
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    cert = x509.load_pem_x509_certificate(paths["cert"].read_bytes())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert {"10.20.30.40", "127.0.0.1", "::1"} <= ips
    assert {"node-b.example", "localhost"} <= set(san.get_values_for_type(x509.DNSName))
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
    key = serialization.load_pem_private_key(paths["key"].read_bytes(), password=None)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]


def test_etcds_certificates_come_from_the_same_ca_code(tmp_path: Path) -> None:
    """`kvpool up`'s etcd TLS (`write_etcd_tls`, no openssl binary): a CA of its own whose key is never
    written, a server certificate for etcd's host, a client-only certificate (CN kvpool) for the masters."""
    tls = write_etcd_tls(tmp_path / "etcd-tls", "10.1.2.3")
    d = tmp_path / "etcd-tls"
    assert sorted(p.name for p in d.iterdir()) == [
        "ca.pem",
        "client.key",
        "client.pem",
        "server.key",
        "server.pem",
    ]
    assert (d.stat().st_mode & 0o777) == 0o700
    assert all((d / n).stat().st_mode & 0o777 == 0o600 for n in ("server.key", "client.key"))
    ca = x509.load_pem_x509_certificate(Path(tls.ca).read_bytes())
    server = x509.load_pem_x509_certificate(Path(tls.server_cert).read_bytes())
    client = x509.load_pem_x509_certificate(Path(tls.client_cert).read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert, key_file in ((server, tls.server_key), (client, tls.client_key)):
        cert.verify_directly_issued_by(ca)
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        key = serialization.load_pem_private_key(Path(key_file).read_bytes(), password=None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.1.2.3", "127.0.0.1"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert (
        ExtendedKeyUsageOID.SERVER_AUTH
        in server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    )
    assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH
    ]
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "kvpool"
    other = write_etcd_tls(tmp_path / "other")  # every call a fresh CA: another run's certificates fail
    with pytest.raises(InvalidSignature):
        x509.load_pem_x509_certificate(Path(other.server_cert).read_bytes()).verify_directly_issued_by(ca)


def test_spec_hosts_reach_the_certificate(tmp_path: Path) -> None:
    spec = ClusterSpec.model_validate(
        {"master": {"host": "10.0.0.1"}, "store": {"hosts": ["10.0.0.2"]}, "decode": {"hosts": ["gpu-3.lan"]}}
    )
    tls = UpTls.make(tmp_path, spec_hosts(spec), enabled=True, environ={})
    cert = x509.load_pem_x509_certificate(Path(tls.env["KVPOOL_TLS_CERT_FILE"]).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.0.0.1", "10.0.0.2"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert "gpu-3.lan" in san.get_values_for_type(x509.DNSName)
    assert tls.env["KVPOOL_TLS_CLIENT_AUTH"] == "true"
    tls.remove_files()
    assert not Path(tls.env["KVPOOL_TLS_KEY_FILE"]).exists()


def test_up_tls_off_or_the_operators_files(tmp_path: Path) -> None:
    files = write_cluster_tls(tmp_path / "mine", [])
    operator = {"KVPOOL_TLS_CERT_FILE": str(files["cert"]), "KVPOOL_TLS_KEY_FILE": str(files["key"]),
                "KVPOOL_TLS_CA_FILE": str(files["ca"]), "PATH": "/bin"}  # fmt: skip
    kept = UpTls.make(tmp_path / "run", [], enabled=True, environ=operator)
    assert kept.env == {k: v for k, v in operator.items() if k != "PATH"} and kept.made == []
    assert not (tmp_path / "run").exists()  # nothing made
    off = UpTls.make(tmp_path / "run", [], enabled=False, environ=operator)
    environ = dict(operator)
    off.apply(environ)
    assert environ == {"PATH": "/bin"}  # `tls = false`: no role gets the operator's TLS settings
    assert off.export_line() == ""
    missing = operator | {"KVPOOL_TLS_KEY_FILE": str(tmp_path / "nope.pem")}
    with pytest.raises(InvalidArgument, match="KVPOOL_TLS_KEY_FILE=.*nope.pem: cannot read it"):
        UpTls.make(tmp_path / "run", [], enabled=True, environ=missing)


def test_up_refuses_unreadable_operator_tls_files_in_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "cluster.toml"
    spec.write_text("[master]\nport = 0\n[router]\nport = 0\n")
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    env["KVPOOL_TLS_CERT_FILE"] = str(tmp_path / "missing-cert.pem")
    r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "up", "-c", str(spec), "--quiet"],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last
        == f"kvpool up: KVPOOL_TLS_CERT_FILE={tmp_path}/missing-cert.pem: cannot read it (the operator's TLS files)"
    )
    assert "ready in" not in r.stderr and "Traceback" not in r.stderr


def test_a_tls_master_refuses_plaintext_and_clients_without_the_clusters_certificate(
    fresh_security: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = tls_env(write_cluster_tls(tmp_path / "tls", []))
    other = tls_env(write_cluster_tls(tmp_path / "other", []))  # another cluster's CA and certificate
    _use(fresh_security, env)
    master = start_master()
    try:
        with MasterClient(master.grpc_address) as c:
            assert c.list_nodes() == []  # the CA verifies the server; the certificate is the client's
        _use(fresh_security, {})
        with MasterClient(master.grpc_address, timeout_s=3.0) as c, pytest.raises(Unavailable):
            c.stats()  # plaintext
        _use(fresh_security, env, drop=("KVPOOL_TLS_CERT_FILE", "KVPOOL_TLS_KEY_FILE"))
        with MasterClient(master.grpc_address, timeout_s=3.0) as c, pytest.raises(Unavailable):
            c.stats()  # TLS with the right CA, but no client certificate
        _use(fresh_security, other)
        with MasterClient(master.grpc_address, timeout_s=3.0) as c, pytest.raises(Unavailable):
            c.stats()  # another cluster's files: neither side trusts the other
        _use(fresh_security, env | {"KVPOOL_TLS_SERVER_NAME": "not-this-cluster.example"})
        with MasterClient(master.grpc_address, timeout_s=3.0) as c, pytest.raises(Unavailable):
            c.stats()  # the server's certificate is checked for the name asked for
        _use(fresh_security, env | {"KVPOOL_TLS_SERVER_NAME": "localhost"})
        with MasterClient(master.grpc_address) as c:
            assert c.list_nodes() == []
    finally:
        master.kill()


def _admin(master: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in TLS_ENV}
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master, "--timeout", "5", "stats"],
        env=base | env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_up_plans_master_serves_tls_and_the_admin_cli_uses_the_export_line(tmp_path: Path) -> None:
    spec = ClusterSpec.model_validate({"master": {"port": 0}})
    tls = UpTls.make(tmp_path, spec_hosts(spec), enabled=True, environ={})
    exported = dict(w.split("=", 1) for w in tls.export_line().removeprefix("export ").split())
    assert exported == tls.env
    (master_launch,) = [x for x in plan(spec, LAYOUT) if x.role == "master"]
    master = start(master_launch.resolved("", ""), env=tls.env)
    try:
        ok = _admin(master.grpc_address, exported)
        assert ok.returncode == 0, ok.stderr
        assert "num_blocks" in ok.stdout
        plain = _admin(master.grpc_address, {})
        assert plain.returncode != 0
        assert master.grpc_address in plain.stderr  # one line naming the master, no traceback
        assert "Traceback" not in plain.stderr
    finally:
        master.kill()
        tls.remove_files()


def test_kvpool_tls_makes_one_set_for_a_cluster_across_hosts(tmp_path: Path) -> None:
    spec = tmp_path / "cluster.toml"
    spec.write_text('[master]\nhost = "10.0.0.1"\n[store]\nhosts = ["10.0.0.2"]\n')
    out = tmp_path / "tls"
    cmd = [sys.executable, "-m", "kvpool.cli.main", "tls", str(out), "-c", str(spec), "--host", "kv.example"]
    made = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    exported = dict(w.split("=", 1) for w in made.stdout.strip().removeprefix("export ").split())
    assert exported == tls_env({"ca": out / "ca.pem", "cert": out / "cert.pem", "key": out / "key.pem"})
    assert (out / "key.pem").stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate((out / "cert.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.0.0.1", "10.0.0.2"} <= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert "kv.example" in san.get_values_for_type(x509.DNSName)
    ca = (out / "ca.pem").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "not empty" in again.stderr
    assert (out / "ca.pem").read_bytes() == ca  # never overwritten


def test_kvpool_tls_refuses_a_host_that_is_no_name_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    for bad in ("bad host!", "-lead.example", "a..b", "x" * 64 + ".example"):
        cmd = [sys.executable, "-m", "kvpool.cli.main", "tls", str(out), "--host", bad]
        made = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert made.returncode == 2 and "neither an IP address nor a valid DNS host name" in made.stderr, made
        assert not out.exists()
    assert check_host("[::1]") == "::1" and check_host("node-b.example.") == "node-b.example."
    with pytest.raises(InvalidArgument):
        san_names(["under_score.example"])
