"""The gRPC TLS of a `kvpool up` cluster: a CA and one certificate every role serves and calls with.

`kvpool up` (unless the spec says `[cluster] tls = false`) makes, in its state directory:

| file | what | mode |
|---|---|---|
| `tls/ca.pem` | a fresh CA certificate (its key is never written: no other certificate can be signed) | 0644 |
| `tls/cert.pem` | the cluster's certificate, signed by that CA, for server and client use; its subject alternative names are 127.0.0.1, ::1, localhost, this host's names and every host of the spec | 0644 |
| `tls/key.pem` | its private key (ECDSA P-256) | 0600 |

and gives every role (and itself, for its health checks) `KVPOOL_TLS_CA_FILE`, `KVPOOL_TLS_CERT_FILE`,
`KVPOOL_TLS_KEY_FILE` and `KVPOOL_TLS_CLIENT_AUTH=true` (`kvpool.rpc.security`): every gRPC server
listens with TLS and refuses a connection without a certificate the CA signed, every channel verifies the
server's certificate and presents the cluster's. An operator whose environment already names
`KVPOOL_TLS_CERT_FILE` (their own PKI, or files copied from another host's `kvpool up`) keeps those files.
The key is removed when the cluster stops. A secured HA cluster's etcd gets its own CA, server and
client certificates the same way (`write_etcd_tls`: no openssl binary involved). UCX (the data plane) is not covered: it stays clear on the wire
(docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvpool.cluster.etcd import EtcdTls
from kvpool.cluster.spec import ClusterSpec
from kvpool.errors import InvalidArgument

TLS_ENV = ("KVPOOL_TLS_CA_FILE", "KVPOOL_TLS_CERT_FILE", "KVPOOL_TLS_KEY_FILE", "KVPOOL_TLS_CLIENT_AUTH")
"""The variables that configure gRPC TLS (`kvpool.rpc.security.RpcSecurity`)."""
VALID_DAYS = 365
"""How long the generated certificates are valid."""


_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(name: str) -> str:
    """`name` (an IP address, bracketed or not, or a DNS host name: dot-separated labels of letters, digits
    and inner hyphens, at most 253 characters) without brackets. Raises `InvalidArgument` otherwise."""
    bare = name.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    labels = bare.rstrip(".").split(".")
    if len(bare) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise InvalidArgument(f"{name!r} is neither an IP address nor a valid DNS host name")
    return bare


def san_names(hosts: Iterable[str]) -> list[str]:
    """The names a cluster certificate covers: loopback, this host's names and `hosts`, without repeats
    (order kept; empty names dropped). Raises `InvalidArgument` for a host that is neither an IP address nor
    a DNS name (see `check_host`)."""
    given = [check_host(h) for h in hosts if h]
    names = ["127.0.0.1", "::1", "localhost", socket.gethostname(), socket.getfqdn(), *given]
    return list(dict.fromkeys(n.strip("[]") for n in names if n))


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _ca(common_name: str, start: datetime.datetime, end: datetime.datetime) -> tuple[Any, x509.Certificate]:
    """A fresh self-signed CA (ECDSA P-256; it signs certificates only): (its key, its certificate)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca


def _issue(
    ca_key: Any,
    ca: x509.Certificate,
    common_name: str,
    names: list[str],
    usages: list[x509.ObjectIdentifier],
    start: datetime.datetime,
    end: datetime.datetime,
) -> tuple[Any, x509.Certificate]:
    """A fresh key (ECDSA P-256) and its certificate signed by `ca`: subject `common_name`, extended key
    usages `usages`, subject alternative names `names` (none when empty)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _write_pem(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: Any) -> None:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT: set it
        f.write(key_pem)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)


def write_cluster_tls(directory: Path, hosts: Iterable[str], *, days: int = VALID_DAYS) -> dict[str, Path]:
    """Make `directory` (0700) with a fresh CA certificate (`ca`), a certificate it signed for server and
    client authentication whose SAN covers `san_names(hosts)` (`cert`), and that certificate's key
    (`key`, 0600). Returns {"ca", "cert", "key": path}. The CA's key is never written."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    start, end = _validity(days)
    ca_key, ca = _ca("kvpool cluster CA", start, end)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    key, cert = _issue(ca_key, ca, "kvpool cluster", san_names(hosts), usages, start, end)
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    _write_pem(paths["ca"], ca)
    _write_pem(paths["cert"], cert)
    _write_key(paths["key"], key)
    return paths


def write_etcd_tls(directory: Path, host: str = "127.0.0.1", *, days: int = VALID_DAYS) -> EtcdTls:
    """The TLS files of a secured `kvpool up`'s etcd, made as the cluster's (`write_cluster_tls`), in
    `directory` (0700): a fresh CA of its own (its key never written), the server's certificate (SAN over
    `san_names([host])`) and the client certificate the masters present (CN `kvpool`, client use only),
    keys 0600."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    start, end = _validity(days)
    ca_key, ca = _ca("kvpool etcd CA", start, end)
    server_usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    server_key, server = _issue(ca_key, ca, host, san_names([host]), server_usages, start, end)
    client_key, client = _issue(ca_key, ca, "kvpool", [], [ExtendedKeyUsageOID.CLIENT_AUTH], start, end)
    tls = EtcdTls(
        *(str(directory / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"))
    )
    _write_pem(Path(tls.ca), ca)
    _write_pem(Path(tls.server_cert), server)
    _write_key(Path(tls.server_key), server_key)
    _write_pem(Path(tls.client_cert), client)
    _write_key(Path(tls.client_key), client_key)
    return tls


def tls_env(paths: Mapping[str, Path]) -> dict[str, str]:
    """The `KVPOOL_TLS_*` entries for `write_cluster_tls`'s files: TLS on every server and channel, client
    certificates required."""
    return {
        "KVPOOL_TLS_CA_FILE": str(paths["ca"]),
        "KVPOOL_TLS_CERT_FILE": str(paths["cert"]),
        "KVPOOL_TLS_KEY_FILE": str(paths["key"]),
        "KVPOOL_TLS_CLIENT_AUTH": "true",
    }


@dataclass(frozen=True, slots=True)
class UpTls:
    """The TLS settings of one `kvpool up`: `env` for every role (empty: plaintext gRPC), the key file it
    made (removed at stop; never the operator's)."""

    env: dict[str, str] = field(default_factory=dict)
    made: list[Path] = field(default_factory=list)

    @classmethod
    def make(
        cls, directory: Path, hosts: Iterable[str], *, enabled: bool, environ: Mapping[str, str]
    ) -> UpTls:
        """Disabled: no TLS (the operator's `KVPOOL_TLS_*` are to be dropped). The operator's environment
        names a certificate: those files, as they are (`InvalidArgument` naming the variable when one cannot
        be read). Otherwise fresh files under `directory/tls`."""
        if not enabled:
            return cls()
        if environ.get("KVPOOL_TLS_CERT_FILE"):
            env = {k: environ[k] for k in TLS_ENV if environ.get(k)}
            for name, path in env.items():
                if name.endswith("_FILE") and not os.access(path, os.R_OK):
                    raise InvalidArgument(f"{name}={path}: cannot read it (the operator's TLS files)")
            return cls(env)
        paths = write_cluster_tls(directory / "tls", hosts)
        return cls(tls_env(paths), [paths["key"]])

    def apply(self, environ: os._Environ[str] | dict[str, str]) -> None:
        """Set `env` in `environ` (this process's, so its own health checks and every role it starts use it);
        with TLS off, remove the `KVPOOL_TLS_*` variables from it."""
        for name in TLS_ENV:
            environ.pop(name, None)
        environ.update(self.env)

    def remove_files(self) -> None:
        for path in self.made:
            path.unlink(missing_ok=True)

    def export_line(self) -> str:
        """What the admin CLI, a client or a role started by hand on another host exports ("" without TLS)."""
        if not self.env:
            return ""
        return "export " + " ".join(f"{k}={v}" for k, v in self.env.items())


def spec_hosts(spec: ClusterSpec) -> list[str]:
    """Every host a role of `spec` listens on (the names its certificate must cover)."""
    return [spec.master.host, *spec.store.hosts, *spec.prefill.hosts, *spec.decode.hosts, spec.router.host]
