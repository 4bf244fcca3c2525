"""`MasterClient` follows the leader (real masters in HA on a real etcd): a call refused by a standby runs
once more at the leader it names; with a list of masters, a dead leader's calls move on to the next one."""

from __future__ import annotations

import pytest

from kvpool.client import MasterClient
from kvpool.client.leader import never_sent, not_leader_redirect
from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import Unavailable
from kvpool.master.server import MasterServer
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until
from tests.test_ha_master import ha_master, leader_of, two_masters  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(90)


def test_refusal_parsing() -> None:
    assert not_leader_redirect("not the leader (leader is 10.0.0.1:50051)") == "10.0.0.1:50051"
    assert not_leader_redirect("not the leader (leader is unknown)") == ""
    assert not_leader_redirect("failed to connect to all addresses") is None
    assert never_sent("failed to connect to all addresses; last error: ...")
    assert not never_sent("Socket closed")


def test_a_standby_s_refusal_is_redirected_once_to_the_leader(two_masters: list[MasterServer]) -> None:  # noqa: F811
    leader = leader_of(two_masters)
    standby = next(s for s in two_masters if s is not leader)
    wait_until(lambda: standby.master.election.view().leader == leader.address, 10, "the leader known")  # type: ignore[union-attr]
    with MasterClient(f"{standby.address},{leader.address}") as c:  # the standby first
        assert c.evict(0.5) == (0, 0)  # not idempotent, yet safe: the standby did not run it
        assert c.address == leader.address and c.masters().role == "leader"


def test_a_list_of_masters_survives_the_leader_s_death(etcd: ThrowawayEtcd) -> None:  # noqa: F811
    servers = [ha_master(etcd.endpoint, prefix="/client") for _ in range(2)]
    try:
        leader = leader_of(servers)
        standby = next(s for s in servers if s is not leader)
        with MasterClient(f"{leader.address},{standby.address}") as c:
            assert c.evict(0.5) == (0, 0) and c.address == leader.address
            leader.stop()  # gone: its port refuses connections
            wait_until(lambda: standby.master.election.is_leader, 10, "the standby takes over")
            assert c.evict(0.5) == (0, 0)  # never connected to the dead one: moved on, ran once
            assert c.address == standby.address
    finally:
        for s in servers:
            s.stop()


def test_one_master_no_list_no_move() -> None:
    with MasterClient("127.0.0.1:1", timeout_s=1.0) as c, pytest.raises(Unavailable):
        c.evict(0.5)
