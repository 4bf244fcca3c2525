"""Fencing from every answer (issue #39, item 1): a store raises its leader-epoch fence on a master's
heartbeat answer (not only on an order), on a valid capability of a newer epoch, and a leader whose lease
is not renewed sends no order at all once it no longer surely leads."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.capability import Capabilities, CapabilityKey, WallClock
from kvpool.client import MasterClient
from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import FailedPrecondition, PermissionDenied, Unavailable
from kvpool.master.procs import LAYOUT, Proc, start_store
from kvpool.membership import leader_proof
from kvpool.store.fence import EpochFence
from kvpool.store.segment import Segment
from kvpool.store.slots import Reservation, SlotTable
from tests.capabilities import require_ucx
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until
from tests.test_ha_fencing import order, store_metrics
from tests.test_ha_master import ha_master

pytestmark = pytest.mark.timeout(90)
NS, H = b"\x11" * 16, b"\x22" * 16
SECRET = b"s" * 32


def accepted_at(metrics_address: str, epoch: int) -> float:
    """The store's `orders_accepted` counter for leader `epoch` (0 when it took none)."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvpool_store_orders_accepted_total" and s.labels.get("epoch") == str(epoch)
    )


@pytest.fixture
def stores() -> Iterator[list[Proc]]:
    require_ucx()
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def test_answers_raise_the_fence_never_lower_it() -> None:
    fence = EpochFence()
    assert fence.observe(7) and fence.highest == 7
    assert not fence.observe(5) and fence.highest == 7  # an older answer changes nothing
    with pytest.raises(FailedPrecondition, match="fenced: epoch 5 < 7"):
        fence.check(5)
    fence.check(7)
    fence.check(0)
    assert fence.accepted_by_epoch() == {7: 1, 0: 1} and fence.num_refused == 1


def test_a_secured_fence_rises_only_with_the_leaders_proof() -> None:
    key = Capabilities(CapabilityKey(SECRET))
    fence = EpochFence(key)
    assert not fence.observe(9, "forged.127.0.0.1:1") and fence.highest == 0
    assert fence.observe(9, leader_proof(key, "127.0.0.1:1", 9)) and fence.highest == 9
    assert fence.num_raised_by_answers == 1


def test_a_valid_capability_of_a_newer_epoch_raises_the_fence() -> None:
    """A reader's capability from a match (or a writer's from a reserve) minted by the leader at epoch 8
    fences a store that never heard of epoch 8: an order at epoch 5 is refused afterwards."""
    key = Capabilities(CapabilityKey(SECRET), clock=WallClock())
    table = SlotTable(Segment(1 << 20, 4096), capabilities=key, node_id="s0")
    table.fence.check(5, leader_proof(key, "127.0.0.1:1", 5))
    table.reserve([Reservation(0, 1, NS, H, b"")], 30_000)
    expiry = WallClock().now_ms() + 30_000
    cap = key.sign("write", NS, H, "s0", 0, 1, expiry, 8)
    with pytest.raises(PermissionDenied):  # a forged one (wrong MAC) proves nothing
        table.begin_write(0, 1, 4096, b"\0" * len(cap), expiry)
    assert table.fence.highest == 5
    table.begin_write(0, 1, 4096, cap, expiry)
    assert table.fence.highest == 8
    with pytest.raises(FailedPrecondition, match="fenced: epoch 5 < 8"):
        table.fence.check(5, "")


def test_a_heartbeat_answer_fences_the_deposed_leader(etcd: ThrowawayEtcd, stores: list[Proc]) -> None:  # noqa: F811
    """A leads; the store follows B once B leads; B never orders the store anything: A's order (one that
    passed its own leadership check just before it paused) is refused all the same."""
    a = ha_master(etcd.endpoint, prefix="/answers")
    b = None
    try:
        ea = a.master.election
        assert ea is not None
        wait_until(lambda: ea.is_leader, 10, "a leads")
        b = ha_master(etcd.endpoint, prefix="/answers")
        eb = b.master.election
        assert eb is not None
        stores.append(start_store(f"{a.address},{b.address}", "s0", extra=("--metrics-port", "0")))
        store = stores[0].grpc_address
        wait_until(lambda: "s0" in a.master.st.nodes, 10, "s0 registers with a")
        e1 = a.master.stores.leader_epoch
        a.master.stores.reserve(store, order(5), 30_000)
        wait_until(lambda: eb.view().leader == a.address, 10, "b sees a")
        ea._loop.call_soon_threadsafe(time.sleep, 4.0)  # a stalls: its lease lapses, b takes over
        wait_until(lambda: eb.is_leader, 15, "b takes over")
        e2 = b.master.stores.leader_epoch
        assert e2 > e1
        wait_until(lambda: "s0" in b.master.st.nodes and b.master.st.nodes["s0"].alive, 15, "s0 follows b")
        metrics = str(stores[0].ready["metrics_address"])
        wait_until(lambda: store_metrics(metrics)["kvpool_store_leader_epoch"] == e2, 10, "the fence rises")
        assert b.master.stores.num_withheld == 0
        with MasterClient(b.address) as c:  # a reader's and a writer's answers carry the epoch too
            ns, _ = c.register_namespace("m", "v1", LAYOUT)
            assert c.leader_epoch == 0
            c.match(ns, [H])
            assert c.leader_epoch == e2
        a.master.stores.leading = lambda: True  # the order passed a's check, then a paused
        with pytest.raises(FailedPrecondition, match=f"fenced: epoch {e1} < {e2}"):
            a.master.stores.free(store, [(5, 1)])
        assert store_metrics(metrics)["kvpool_store_fenced_orders_total"] == 1
        assert accepted_at(metrics, e1) == 1  # the reserve before the pause only
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_leader_without_renewal_sends_no_order(etcd: ThrowawayEtcd, stores: list[Proc]) -> None:  # noqa: F811
    """The leader's election thread stalls (no keep-alive): it withholds its orders before its lease can
    have expired at etcd, so before any other master can lead."""
    a = ha_master(etcd.endpoint, prefix="/withhold")
    b = None
    try:
        ea = a.master.election
        assert ea is not None
        wait_until(lambda: ea.is_leader, 10, "a leads")
        b = ha_master(etcd.endpoint, prefix="/withhold")
        eb = b.master.election
        assert eb is not None
        stores.append(start_store(a.address, "s0"))
        store = stores[0].grpc_address
        a.master.stores.reserve(store, order(5), 30_000)
        wait_until(lambda: eb.view().leader == a.address, 10, "b sees a")
        ea._loop.call_soon_threadsafe(time.sleep, 4.0)
        withheld = None
        deadline = time.monotonic() + 20
        while withheld is None and time.monotonic() < deadline:
            b_leads = eb.is_leader  # read first: b must not lead yet when a's next order is withheld
            try:
                a.master.stores.free(store, [])
            except Unavailable as exc:
                assert "withheld" in str(exc)
                withheld = not b_leads
            time.sleep(0.01)
        assert withheld is not None, "a kept sending orders with its lease lapsed"
        assert withheld, "b led before a stopped ordering"
        assert a.master.stores.num_withheld == 1
    finally:
        a.stop()
        if b is not None:
            b.stop()
