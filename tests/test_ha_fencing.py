"""Fencing on a real store process: once a store took an order from a new leader's epoch, the orders of the
old leader (its epoch still on its store calls: a deposed or partitioned master) are refused,
FAILED_PRECONDITION "fenced: epoch N < M", and change nothing; a single master's epoch 0 is never fenced."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.errors import FailedPrecondition, Unavailable
from kvpool.master import MasterSettings, serve
from kvpool.master.procs import LAYOUT, Proc, start_store
from kvpool.master.stores import SlotOrder
from kvpool.rpc.server import channel
from kvpool.types import Location
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.capabilities import require_ucx
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until
from tests.test_ha_master import ha_master

pytestmark = pytest.mark.timeout(90)
transfer = pytest.importorskip("transfer")
NS, H = b"\x11" * 16, b"\x22" * 16


def order(slot: int) -> list[SlotOrder]:
    return [SlotOrder(slot=slot, generation=1, namespace=NS, block_hash=H, parent_hash=b"")]


def used_slots(store: str) -> int:
    """The store's own count of reserved or held slots (its GetInfo)."""
    with channel(store) as ch:
        return int(pb_grpc.StoreStub(ch).GetInfo(pb.GetInfoRequest(), timeout=5).num_used_slots)


def store_metrics(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def store_of() -> Iterator[list[Proc]]:
    require_ucx()
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def test_old_leader_orders_are_fenced_by_a_real_store(etcd: ThrowawayEtcd, store_of: list[Proc]) -> None:  # noqa: F811
    old = ha_master(etcd.endpoint, prefix="/fence")
    new = None
    try:
        wait_until(lambda: old.master.election.is_leader, 10, "the first master leads")  # type: ignore[union-attr]
        store_of.append(start_store(old.address, "s0"))
        store = store_of[0].grpc_address
        e1 = old.master.stores.leader_epoch
        assert e1 > 0
        old.master.stores.reserve(store, order(5), 30_000)  # accepted: epoch e1 is the newest seen
        new = ha_master(etcd.endpoint, prefix="/fence")
        wait_until(
            lambda: new.master.election.view().leader == old.address, 10, "the standby sees the leader"
        )  # type: ignore[union-attr]
        old.master.election.stop()  # deposed (its store calls keep epoch e1, as a partitioned leader's)
        with pytest.raises(Unavailable, match="withheld"):  # it knows it no longer leads: it sends nothing
            old.master.stores.reserve(store, order(6), 30_000)
        old.master.stores.leading = lambda: True  # orders that passed that check before a pause still come
        wait_until(lambda: new.master.election.is_leader, 10, "the standby takes over")  # type: ignore[union-attr]
        e2 = new.master.stores.leader_epoch
        assert e2 > e1
        freed = new.master.stores.free(store, [(5, 1)])  # the new leader's order: accepted
        assert [(s, d) for s, _, d in freed] == [(5, False)]
        assert used_slots(store) == 0
        fenced = f"fenced: epoch {e1} < {e2}"
        with pytest.raises(FailedPrecondition, match=fenced):
            old.master.stores.reserve(store, order(6), 30_000)
        with pytest.raises(FailedPrecondition, match=fenced):
            old.master.stores.commit(store, [Location(node_id="s0", slot=6, generation=1)])
        with pytest.raises(FailedPrecondition, match=fenced):
            old.master.stores.free(store, [(6, 1)])
        with pytest.raises(FailedPrecondition, match=fenced):
            old.master.stores.copy(store, "127.0.0.1:1", [])
        assert used_slots(store) == 0  # the refused reservation took no slot
        seen = store_metrics(str(store_of[0].ready["metrics_address"]))  # the store's own record
        assert seen["kvpool_store_fenced_orders_total"] == 4 and seen["kvpool_store_leader_epoch"] == e2
        new.master.stores.reserve(store, order(6), 30_000)  # the new epoch still is
        assert used_slots(store) == 1
    finally:
        old.stop()
        if new is not None:
            new.stop()


def test_single_master_epoch_zero_is_not_fenced(store_of: list[Proc]) -> None:
    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", layout=LAYOUT, metrics=False))
    try:
        store_of.append(start_store(server.address, "s0"))
        store = store_of[0].grpc_address
        server.master.stores.reserve(store, order(3), 30_000)
        assert server.master.stores.free(store, [(3, 1)])[0][0] == 3
    finally:
        server.stop()


def test_a_master_leading_again_forgets_the_previous_term(etcd: ThrowawayEtcd, store_of: list[Proc]) -> None:  # noqa: F811
    """A leads, the store registers; A stalls and B leads (the store follows B); B stops and A leads again
    with a newer epoch: A forgot its old node records, so the store re-registers and is adopted afresh."""
    a = ha_master(etcd.endpoint, prefix="/again")
    b = None
    try:
        ea = a.master.election
        assert ea is not None
        wait_until(lambda: ea.is_leader, 10, "a leads")
        b = ha_master(etcd.endpoint, prefix="/again")
        eb = b.master.election
        assert eb is not None
        # the store's list names both: a client follows a leader only within its list
        store_of.append(start_store(f"{a.address},{b.address}", "s0"))
        wait_until(lambda: "s0" in a.master.st.nodes and a.master.st.nodes["s0"].alive, 10, "s0 registers")
        first = a.master.st.nodes["s0"].registered_ms
        e1 = a.master.stores.leader_epoch
        wait_until(lambda: eb.view().leader == a.address, 10, "b sees a")
        ea._loop.call_soon_threadsafe(time.sleep, 3.5)  # a stalls: its lease lapses
        wait_until(lambda: eb.is_leader, 10, "b takes over")
        wait_until(lambda: "s0" in b.master.st.nodes and b.master.st.nodes["s0"].alive, 10, "s0 follows b")
        b.stop()
        b = None
        wait_until(lambda: ea.is_leader, 10, "a leads again")
        assert a.master.stores.leader_epoch > e1
        wait_until(
            lambda: a.master.st.nodes["s0"].alive and a.master.st.nodes["s0"].registered_ms > first,
            10,
            "s0 re-registers with a",
        )
    finally:
        a.stop()
        if b is not None:
            b.stop()
