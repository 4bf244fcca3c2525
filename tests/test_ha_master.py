"""Masters in high availability on a real etcd (in-process gRPC servers on 127.0.0.1): the standby refuses
everything but status with UNAVAILABLE naming the leader, `Masters` tells who leads, a clean stop hands over
at once, and a single master (no etcd) has no gate."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool.client import MasterClient
from kvpool.errors import Unavailable
from kvpool.master import MasterSettings, serve
from kvpool.master.procs import LAYOUT
from kvpool.master.server import MasterServer
from tests.etcd_server import EtcdServer, etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until

pytestmark = pytest.mark.timeout(90)


def ha_master(endpoint: str, prefix: str = "/ha-master") -> MasterServer:
    settings = MasterSettings(
        port=0,
        bind_host="127.0.0.1",
        layout=LAYOUT,
        metrics=False,
        etcd=endpoint,
        ha_prefix=prefix,
        ha_lease_ttl_s=2,
    )
    return serve(settings)


@pytest.fixture
def two_masters(etcd: EtcdServer) -> Iterator[list[MasterServer]]:  # noqa: F811
    servers = [ha_master(etcd.endpoint) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def leader_of(servers: list[MasterServer]) -> MasterServer:
    wait_until(lambda: sum(s.master.election.is_leader for s in servers) == 1, 10, "one leader")  # type: ignore[union-attr]
    return next(s for s in servers if s.master.election.is_leader)  # type: ignore[union-attr]


def test_standby_refuses_writes_naming_the_leader(two_masters: list[MasterServer]) -> None:
    leader = leader_of(two_masters)
    standby = next(s for s in two_masters if s is not leader)
    with MasterClient(leader.address) as lc, MasterClient(standby.address) as sc:
        wait_until(lambda: sc.masters().leader == leader.address, 10, "the standby knows the leader")
        status = sc.masters()
        assert status.ha and status.role == "standby" and status.address == standby.address
        assert status.epoch > 0 and status.lease_ttl_s == 2 and status.standbys == (standby.address,)
        assert lc.masters().role == "leader" and lc.masters().epoch == status.epoch
        assert leader.master.stores.leader_epoch == status.epoch  # store orders carry it
        assert lc.evict(0.5) == (0, 0)  # a write: the leader takes it
        with pytest.raises(Unavailable, match=f"not the leader \\(leader is {leader.address}\\)"):
            sc.evict(0.5)
        with pytest.raises(Unavailable, match="not the leader"):
            sc.match(b"\0" * 16, [b"\1" * 16])  # a standby's index is empty: no reads either
        assert sc.stats().num_blocks == 0  # read-only status: answered
        epoch = status.epoch
        t0 = time.monotonic()
        leader.stop()  # revokes its lease
        wait_until(lambda: sc.masters().role == "leader", 5, "the standby takes over")
        assert time.monotonic() - t0 < 2.0
        after = sc.masters()
        assert after.epoch > epoch and after.leader == standby.address and after.failovers == 1
        assert standby.master.stores.leader_epoch == after.epoch
        assert sc.evict(0.5) == (0, 0)


def test_single_master_has_no_election() -> None:
    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", layout=LAYOUT, metrics=False))
    try:
        assert server.master.election is None and server.master.stores.leader_epoch == 0
        with MasterClient(server.address) as c:
            assert not c.masters().ha and c.masters().role == "leader"
            assert c.evict(0.5) == (0, 0)
    finally:
        server.stop()


def test_bad_etcd_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="etcd endpoint must be HOST:PORT"):
        MasterSettings(etcd="localhost")
