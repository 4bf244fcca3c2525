"""etcd endpoint lists and credentials (no etcd client needed: settings validate them without `aetcd`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def parse_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """Parse `HOST:PORT[,HOST:PORT...]` (each may start with `http://`) into ((host, port), ...).

    Raises ValueError naming the malformed endpoint."""
    out = []
    for part in text.split(","):
        part = part.strip().removeprefix("http://")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint must be HOST:PORT, got {part!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EtcdAuth:
    """How a master reaches etcd: as `user` with `password` (etcd auth on), over TLS checked against
    `ca_file` (PEM; with `cert_file` and `key_file`, a client certificate too). All empty: plain, no auth."""

    user: str = ""
    password: str = field(default="", repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)


def read_etcd_auth(
    user: str, password_file: str, ca_file: str = "", cert_file: str = "", key_file: str = ""
) -> EtcdAuth:
    """`EtcdAuth` from settings: the password is the first line of `password_file` (which must be readable
    by its owner only). Raises ValueError naming what is wrong."""
    password = ""
    if bool(user) != bool(password_file):
        raise ValueError("etcd auth needs both etcd_user and etcd_password_file")
    if password_file:
        path = Path(password_file)
        if not path.is_file():
            raise ValueError(f"etcd_password_file {password_file!r} is not a file")
        if path.stat().st_mode & 0o077:
            raise ValueError(f"etcd_password_file {password_file!r} is readable by others: chmod 600 it")
        lines = path.read_text().strip().splitlines()
        password = lines[0].strip() if lines else ""
        if not password:
            raise ValueError(f"etcd_password_file {password_file!r} is empty")
    if bool(cert_file) != bool(key_file):
        raise ValueError("an etcd client certificate needs both etcd_cert_file and etcd_key_file")
    if cert_file and not ca_file:
        raise ValueError("etcd_cert_file needs etcd_ca_file (TLS)")
    for name, value in (
        ("etcd_ca_file", ca_file),
        ("etcd_cert_file", cert_file),
        ("etcd_key_file", key_file),
    ):
        if value and not Path(value).is_file():
            raise ValueError(f"{name} {value!r} is not a file")
    return EtcdAuth(user, password, ca_file, cert_file, key_file)
