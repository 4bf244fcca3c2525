"""A leader is proven, not read from etcd (docs/ha.md, docs/security.md): a leader key written in etcd by
anyone but a master (here: as etcd's root, as an attacker with write access would) names no leader. With
the cluster secret the real leader deletes it and leads on, standbys keep naming it, the store keeps its
orders (at the leader's new, proven epoch), and no client calls the forged address; without the secret
(masters that believe the key) a client still never calls a leader outside its masters list. Real
`kvpool master --etcd` and `kvpool store` processes on a real etcd with auth on (`enable_etcd_auth`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.capability import new_secret_env
from kvpool.client import MasterClient
from kvpool.cluster.etcd import ThrowawayEtcd, enable_etcd_auth
from kvpool.errors import KVPoolError
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start
from kvpool.membership import new_cluster_tokens
from kvpool.types import KVLayout
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until
from tests.test_ha_fencing import store_metrics
from tests.test_ha_master import ha_master

pytestmark = pytest.mark.timeout(120)
TTL_S = 3
LEADER_KEY = b"/kvpool/master/leader"


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listening socket standing for an attacker's master: a client that follows it connects here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        s.setblocking(False)
        yield s


def connections(trap: socket.socket) -> int:
    """Connections made to `trap` so far (accepted and closed now)."""
    n = 0
    while True:
        try:
            conn, _ = trap.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def forge(endpoint: str, value: bytes, *, user: str = "", password: str = "", bump: int = 0) -> int:
    """Replace the leader key with `value` (no lease), after `bump` writes elsewhere (a higher epoch: the
    key's create revision); returns that revision."""
    from aetcd import Client

    host, port = endpoint.rsplit(":", 1)

    async def run() -> int:
        async with Client(host=host, port=int(port), username=user or None, password=password or None) as c:
            for i in range(bump):
                await c.put(b"/kvpool/junk", str(i).encode())
            await c.delete(LEADER_KEY)
            await c.put(LEADER_KEY, value)
            got = await c.get(LEADER_KEY)
            assert got is not None
            return int(got.create_revision)

    return asyncio.run(run())


def leader_key(endpoint: str, user: str, password: str) -> bytes:
    from aetcd import Client

    host, port = endpoint.rsplit(":", 1)

    async def run() -> bytes:
        async with Client(host=host, port=int(port), username=user, password=password) as c:
            got = await c.get(LEADER_KEY)
            return b"" if got is None else bytes(got.value)

    return asyncio.run(run())


def role(address: str) -> str:
    try:
        with MasterClient(address, timeout_s=2.0) as c:
            return c.masters().role
    except KVPoolError:
        return "unreachable"


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The environments of a secured cluster: the secret (master, store), the token digests (master), and
    this process as a member (its join token)."""
    secret = new_secret_env(tmp_path)
    _, master_env, member_env = new_cluster_tokens(tmp_path)
    for name, value in member_env.items():
        monkeypatch.setenv(name, value)
    procs: list[Proc] = []
    yield {"secret": secret, "master": master_env, "procs": procs, "dir": tmp_path}
    for p in procs:
        p.kill()


def test_a_forged_leader_key_moves_no_master_no_store_and_no_client(
    etcd: ThrowawayEtcd,  # noqa: F811
    secured: dict[str, Any],
    trap: socket.socket,
) -> None:
    auth = enable_etcd_auth(etcd.endpoint, secured["dir"] / "etcd")
    root_password = (secured["dir"] / "etcd" / "etcd_root_password").read_text().strip()
    password = Path(auth["KVPOOL_ETCD_PASSWORD_FILE"]).read_text().strip()
    env = secured["secret"] | secured["master"] | auth
    procs: list[Proc] = secured["procs"]
    for _ in range(2):
        procs.append(start(["master", "--port", "0", "--layout", LAYOUT, "--listen", "127.0.0.1", "--etcd",
                            etcd.endpoint, "--ha-lease-ttl-s", str(TTL_S), "--no-metrics"], env=env))  # fmt: skip
    addresses = [p.grpc_address for p in procs]
    both = ",".join(addresses)
    wait_until(lambda: sorted(role(a) for a in addresses) == ["leader", "standby"], 20, "one leader")
    leader = next(a for a in addresses if role(a) == "leader")
    standby = next(a for a in addresses if a != leader)
    store = start(["store", "--master", both, "--listen", "127.0.0.1", "--grpc-port", "0", "--data-port", "0",
                   "--segment-size", "16MiB", "--layout", LAYOUT, "--node-id", "s0", "--pin-memory", "off"],
                  env=secured["secret"])  # fmt: skip
    procs.append(store)
    with MasterClient(f"{standby},{leader}", timeout_s=3.0) as c:
        wait_until(lambda: any(n.node.node_id == "s0" and n.alive for n in c.list_nodes()), 20, "s0 joins")
        before = c.masters()
        assert before.role == "leader" and before.address == leader
        forged = forge(
            etcd.endpoint, trap_address(trap).encode(), user="root", password=root_password, bump=300
        )
        assert forged > before.epoch + 300
        # the real leader deletes the key and leads on, at a new epoch of its own
        wait_until(lambda: leader_key(etcd.endpoint, "kvpool", password).startswith(leader.encode()), 10,
                   "the leader's claim back in etcd")  # fmt: skip
        wait_until(lambda: c.masters().epoch > forged, 10, "the leader's new epoch")
        after = c.masters()
        assert after.role == "leader" and after.address == leader and role(standby) == "standby"
        with MasterClient(standby, timeout_s=3.0) as s:
            assert s.masters().leader == leader  # the standby never named the forged address
        # the store takes the leader's orders at its new (proven) epoch
        ns, _ = c.register_namespace("m", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64)), KVLayout.from_fingerprint(LAYOUT).block_size)[:2]
        res = c.reserve(ns, None, hashes)
        assert {loc.node_id for b in res.blocks for loc in b.locations} == {"s0"}
        c.abort(res.reservation_id)
        seen = store_metrics(str(store.ready["metrics_address"]))
        assert (
            seen["kvpool_store_leader_epoch"] == after.epoch and seen["kvpool_store_fenced_orders_total"] == 0
        )
        assert any(n.node.node_id == "s0" and n.alive for n in c.list_nodes())
        assert c.address == leader
    assert connections(trap) == 0  # no client, store or master called the forged address


def trap_address(trap: socket.socket) -> str:
    host, port = trap.getsockname()[:2]
    return f"{host}:{port}"


def test_a_client_does_not_follow_a_leader_outside_its_list(etcd: ThrowawayEtcd, trap: socket.socket) -> None:  # noqa: F811
    """Masters without the secret believe the forged key (docs/security.md: run HA secured); a client
    whose masters list lacks the address named still never calls it."""
    servers = [ha_master(etcd.endpoint, prefix="/kvpool/master") for _ in range(2)]
    try:
        wait_until(lambda: sum(s.master.election.is_leader for s in servers) == 1, 10, "one leader")  # type: ignore[union-attr]
        forge(etcd.endpoint, trap_address(trap).encode())
        named = trap_address(trap)
        wait_until(lambda: all(s.master.election.view().leader == named for s in servers), 10,  # type: ignore[union-attr]
                   "the masters believe the forged key")  # fmt: skip
        with MasterClient(",".join(s.address for s in servers), timeout_s=2.0) as c:
            with pytest.raises(KVPoolError, match="not the leader"):
                c.evict(0.5)
            assert c.address in {s.address for s in servers}
        assert connections(trap) == 0
    finally:
        for s in servers:
            s.stop()
