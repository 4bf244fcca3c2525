"""Masters in high availability on a real etcd (in-process gRPC servers on 127.0.0.1): the standby refuses
everything but status with UNAVAILABLE naming the leader, `Masters` tells who leads, a clean stop hands over
at once, and a single master (no etcd) has no gate."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvpool.client import MasterClient
from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import Unavailable
from kvpool.master import MasterSettings, serve
from kvpool.master.procs import LAYOUT
from kvpool.master.server import MasterServer
from kvpool.rpc.server import channel
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until

pytestmark = pytest.mark.timeout(90)
TTL_S = 3
HANDOVER_TTL_S = 10
"""A revoked lease hands over within a watch round trip (tens of ms), a lapsed one after up to the TTL: the
hand-over test's masters hold a 10 s lease and it is timed against half of it (room for a loaded host)."""
"""The tests' lease TTL (s): short, with room for a loaded shared machine (keep-alives every TTL/3)."""


def refusal(address: str, name: str, request: Any) -> str:
    """The details of the UNAVAILABLE a master answers a plain call with (no client redirect)."""
    with channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        getattr(pb_grpc.MasterStub(ch), name)(request, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return str(info.value.details())


def ha_master(endpoint: str, prefix: str = "/ha-master", ttl_s: int = TTL_S) -> MasterServer:
    settings = MasterSettings(
        port=0,
        bind_host="127.0.0.1",
        layout=LAYOUT,
        metrics=False,
        etcd=endpoint,
        ha_prefix=prefix,
        ha_lease_ttl_s=ttl_s,
    )
    return serve(settings)


@pytest.fixture
def two_masters(etcd: ThrowawayEtcd) -> Iterator[list[MasterServer]]:  # noqa: F811
    servers = [ha_master(etcd.endpoint) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def two_masters_long_lease(etcd: ThrowawayEtcd) -> Iterator[list[MasterServer]]:  # noqa: F811
    servers = [ha_master(etcd.endpoint, ttl_s=HANDOVER_TTL_S) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def leader_of(servers: list[MasterServer]) -> MasterServer:
    wait_until(lambda: sum(s.master.election.is_leader for s in servers) == 1, 10, "one leader")  # type: ignore[union-attr]
    return next(s for s in servers if s.master.election.is_leader)  # type: ignore[union-attr]


def test_standby_refuses_writes_naming_the_leader(two_masters_long_lease: list[MasterServer]) -> None:
    two_masters = two_masters_long_lease
    leader = leader_of(two_masters)
    standby = next(s for s in two_masters if s is not leader)
    # sc starts at the standby; a client follows a leader only within its list
    with MasterClient(leader.address) as lc, MasterClient(f"{standby.address},{leader.address}") as sc:
        wait_until(lambda: sc.masters().leader == leader.address, 10, "the standby knows the leader")
        status = sc.masters()
        assert status.ha and status.role == "standby" and status.address == standby.address
        assert (
            status.epoch > 0
            and status.lease_ttl_s == HANDOVER_TTL_S
            and status.standbys == (standby.address,)
        )
        assert lc.masters().role == "leader" and lc.masters().epoch == status.epoch
        assert leader.master.stores.leader_epoch == status.epoch  # store orders carry it
        assert lc.evict(0.5) == (0, 0)  # a write: the leader takes it
        evict = pb.EvictRequest(fraction=0.5)
        assert refusal(standby.address, "Evict", evict) == f"not the leader (leader is {leader.address})"
        match = pb.MatchPrefixRequest(namespace=b"\0" * 16, block_hashes=[b"\1" * 16])
        assert refusal(standby.address, "MatchPrefix", match).startswith("not the leader")  # no reads either
        # no node registers with a standby: its node list is the leader's to give (routers, engines)
        nodes = pb.ListNodesRequest()
        assert refusal(standby.address, "ListNodes", nodes) == f"not the leader (leader is {leader.address})"
        with MasterClient(f"{standby.address},{leader.address}") as listed:
            assert listed.list_nodes() == [] and listed.address == leader.address
        refused = pytest.raises(Unavailable, match=f"not the leader \\(leader is {leader.address}\\)")
        with MasterClient(standby.address) as raw, raw.match_stream() as stream, refused:  # streams too
            stream.match(b"\0" * 16, [b"\1" * 16])
        assert sc.evict(0.5) == (0, 0) and sc.address == leader.address  # the client follows the leader
        assert sc.stats().num_blocks == 0  # read-only status: answered
        epoch = status.epoch
        t0 = time.monotonic()
        leader.stop()  # revokes its lease
        wait_until(lambda: sc.masters().role == "leader", HANDOVER_TTL_S / 2, "the standby takes over")
        assert time.monotonic() - t0 < HANDOVER_TTL_S / 2
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


def test_admin_and_metrics_name_the_leader(two_masters: list[MasterServer]) -> None:
    from prometheus_client import CollectorRegistry
    from typer.testing import CliRunner

    from kvpool.cli.main import app
    from kvpool.master.metrics import master_registry

    leader = leader_of(two_masters)
    standby = next(s for s in two_masters if s is not leader)
    wait_until(lambda: standby.master.election.view().leader == leader.address, 10, "the leader known")  # type: ignore[union-attr]
    runner = CliRunner()
    out = runner.invoke(app, ["admin", "--master", standby.address, "status", "--json"])
    assert out.exit_code == 0, out.output
    status = json.loads(out.output)
    assert status["leader"] == leader.address and status["standbys"] == standby.address
    assert status["epoch"] == leader.master.stores.leader_epoch and status["master"] == standby.address
    assert status["etcd"] == leader.master.election.view().endpoints[0]  # type: ignore[union-attr]
    assert "the leader is not in --master" in status["figures"]  # not called: the figures are the standby's
    listed_masters = f"127.0.0.1:1,{standby.address}"  # the first is down: the admin CLI moves on
    out = runner.invoke(app, ["admin", "--master", listed_masters, "status", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["leader"] == leader.address
    out = runner.invoke(app, ["admin", "--master", f"{standby.address},{leader.address}", "status", "--json"])
    assert out.exit_code == 0 and "figures" not in json.loads(out.output)  # listed: the leader's figures
    assert runner.invoke(app, ["admin", "--master", "127.0.0.1:1,nohost", "status"]).exit_code == 2
    out = runner.invoke(
        app, ["admin", "--master", f"{standby.address},{leader.address}", "masters", "--json"]
    )
    assert out.exit_code == 0, out.output
    listed = json.loads(out.output)
    assert listed["ha"] and listed["leader"] == leader.address and listed["lease_ttl_s"] == TTL_S
    roles = {m["address"]: m["role"] for m in listed["masters"]}
    assert roles == {leader.address: "leader", standby.address: "standby"}
    out = runner.invoke(
        app, ["admin", "--master", standby.address, "masters", "--json"]
    )  # the leader unlisted
    roles = {m["address"]: m["role"] for m in json.loads(out.output)["masters"]}
    assert roles == {leader.address: "not asked (not in --master)", standby.address: "standby"}
    out = runner.invoke(app, ["admin", "--master", standby.address, "masters"])
    assert out.exit_code == 0 and "standby" in out.output and leader.address in out.output

    def sample(registry: CollectorRegistry, name: str) -> float | None:
        return registry.get_sample_value(name)

    lr, sr = master_registry(leader.master), master_registry(standby.master)
    assert sample(lr, "kvpool_master_leader") == 1 and sample(sr, "kvpool_master_leader") == 0
    assert sample(lr, "kvpool_master_elections_total") == 1
    assert sample(sr, "kvpool_master_elections_total") == 0
    assert sample(sr, "kvpool_master_leader_epoch") == leader.master.stores.leader_epoch
    leader.stop()
    wait_until(lambda: standby.master.election.is_leader, 10, "the standby takes over")  # type: ignore[union-attr]
    assert sample(sr, "kvpool_master_leader") == 1 and sample(sr, "kvpool_master_failovers_total") == 1
    assert sample(sr, "kvpool_master_elections_total") == 1


def test_single_master_metrics_and_admin() -> None:
    from typer.testing import CliRunner

    from kvpool.cli.main import app
    from kvpool.master.metrics import master_registry

    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", layout=LAYOUT, metrics=False))
    try:
        reg = master_registry(server.master)
        assert reg.get_sample_value("kvpool_master_leader") == 1
        assert reg.get_sample_value("kvpool_master_failovers_total") == 0
        out = CliRunner().invoke(app, ["admin", "--master", server.address, "status", "--json"])
        assert out.exit_code == 0 and "leader" not in json.loads(out.output)
        out = CliRunner().invoke(app, ["admin", "--master", server.address, "masters", "--json"])
        assert json.loads(out.output) == {
            "ha": False,
            "masters": [{"address": server.address, "role": "leader", "epoch": 0}],
        }
    finally:
        server.stop()


def test_etcd_gone_the_leader_serves_reads_and_refuses_writes(etcd: ThrowawayEtcd) -> None:  # noqa: F811
    ttl_s = TTL_S
    server = ha_master(etcd.endpoint, prefix="/gone", ttl_s=ttl_s)
    election = server.master.election
    assert election is not None
    try:
        wait_until(lambda: election.is_leader, 10, "it leads")
        with MasterClient(server.address) as c:
            assert c.evict(0.5) == (0, 0)
            etcd.stop()
            t0 = time.monotonic()
            # within the lease TTL, by the instant the master's own clock deposes it (polling adds delay)
            assert election._deadline - election._margin_s <= t0 + ttl_s
            wait_until(lambda: c.masters().role == "deposed", ttl_s + 3, "it steps down")
            with pytest.raises(Unavailable, match=r"not the leader \(leader is unknown\)"):
                c.evict(0.5)
            assert c.match(b"\0" * 16, [b"\1" * 16]).num_matched == 0  # reads: still answered
            assert c.stats().num_blocks == 0
    finally:
        server.stop()
