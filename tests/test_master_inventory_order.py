"""Inventory blocks arrive in slot order, not chain order: a child listed in an earlier message than its
parent (slots reused) waits as columns and is indexed once its parent arrives; blocks of a namespace no
serving node registered yet wait for it. Real components: a store's slot table filled through its own
calls, served by the store's gRPC servicer on an ephemeral port, registered with a master over its RPC."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.client import MasterClient
from kvpool.client.types import NodeInfo
from kvpool.master import MasterSettings, serve
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.rpc.server import start_server
from kvpool.store import Segment, SlotTable
from kvpool.store.service import StoreServicer
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock, KVLayout
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

TINY = "kv1:float16:b1:l1:h1:d1"
LAY = KVLayout.from_fingerprint(TINY)
NUM_SLOTS = 64


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _commit(table: SlotTable, blocks: list[tuple[int, bytes, bytes, bytes]]) -> None:
    """(slot, namespace, hash, parent hash) each, committed at generation 1."""
    table.reserve([Reservation(s, 1, ns, h, p) for s, ns, h, p in blocks], 60_000)
    for s, *_ in blocks:
        table.begin_write(s, 1, LAY.block_nbytes)[:] = b"\x01" * LAY.block_nbytes
        table.end_write(s, 1, 7, True, landed_checksum=7)
    assert all(not err for _, _, err in table.commit((s, 1) for s, *_ in blocks))


@pytest.fixture
def master() -> Iterator[object]:
    server = serve(MasterSettings(port=0, layout=TINY, metrics=False, inventory_batch_blocks=2))
    try:
        yield server
    finally:
        server.stop()


def test_children_before_parents_and_late_namespaces(master: object) -> None:
    server = master
    m = server.master  # type: ignore[attr-defined]
    with MasterClient(server.address) as c:  # type: ignore[attr-defined]
        early, _ = c.register_namespace("early", "v1", TINY)
    other = serve(MasterSettings(port=0, layout=TINY, metrics=False))
    try:  # the digest of a namespace this master learns only after the adoption
        with MasterClient(other.address) as c:
            late, _ = c.register_namespace("late", "v1", TINY)
    finally:
        other.stop()
    # a chain 1 <- 2 <- 3 stored backwards (3 in slot 0, 2 in slot 5, 1 in slot 9): three messages of 2 apart
    table = SlotTable(Segment(NUM_SLOTS * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1))
    _commit(table, [(0, early, _h(3), _h(2)), (5, early, _h(2), _h(1)), (9, early, _h(1), b"")])
    _commit(table, [(1, late, _h(11), b""), (2, late, _h(12), _h(11))])
    servicer = StoreServicer(
        table,
        endpoint=lambda: pb.NodeEndpoint(),
        layout_fingerprint=LAY.fingerprint(),
        epoch=5,
        copy=lambda src, blocks: [],
        max_batch_slots=64,
        inflight=lambda: 0,
    )
    store = start_server(
        [(pb_grpc.add_StoreServicer_to_server, servicer, "kvpool.v1.Store")], host="127.0.0.1", port=0
    )
    try:
        with MasterClient(server.address) as c:  # type: ignore[attr-defined]
            c.register_node(
                NodeInfo("s0", "store", f"127.0.0.1:{store.port}", "127.0.0.1:1", 5),
                protocol_version=PROTOCOL_VERSION,
                layout_fingerprint=LAY.fingerprint(),
                num_slots=NUM_SLOTS,
                block_nbytes=LAY.block_nbytes,
            )
            _wait(lambda: m.st.nodes["s0"].ready, 30, "the inventory adopted")
            _wait(lambda: c.match(early, [_h(1), _h(2), _h(3)]).num_matched == 3, 10, "the chain indexed")
            assert m.st.nodes["s0"].num_allocated == 5  # every listed slot held (waiting ones too)
            info = m.index.block_meta(early, _h(3))
            assert info == (7, 1)  # its checksum and target came with it
            with m.lock:
                assert m.index.num_blocks == 3  # the late namespace's blocks wait (as columns)
            assert c.register_namespace("late", "v1", TINY)[0] == late
            _wait(lambda: c.match(late, [_h(11), _h(12)]).num_matched == 2, 10, "the late blocks indexed")
            assert m.st.nodes["s0"].num_allocated == 5
    finally:
        store.stop(0)


def test_a_restarted_store_drops_what_its_earlier_epoch_listed(master: object) -> None:
    """Blocks of an unregistered namespace wait; the store restarts (a new epoch, an empty table): once
    the namespace registers, none of the earlier epoch's slots is indexed (they are gone)."""
    server = master
    m = server.master  # type: ignore[attr-defined]
    other = serve(MasterSettings(port=0, layout=TINY, metrics=False))
    try:
        with MasterClient(other.address) as c:
            late, _ = c.register_namespace("late", "v1", TINY)
    finally:
        other.stop()
    old = SlotTable(Segment(NUM_SLOTS * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1))
    _commit(old, [(1, late, _h(11), b""), (2, late, _h(12), _h(11))])
    new = SlotTable(Segment(NUM_SLOTS * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1))
    stores = [_serve(old, 5), _serve(new, 6)]
    try:
        with MasterClient(server.address) as c:  # type: ignore[attr-defined]
            _register(c, stores[0].port, 5)
            _wait(lambda: m.st.nodes["s0"].ready, 30, "the first inventory adopted")
            _register(c, stores[1].port, 6)  # restarted: nothing committed any more
            _wait(lambda: m.st.nodes["s0"].epoch == 6 and m.st.nodes["s0"].ready, 30, "the restart adopted")
            assert c.register_namespace("late", "v1", TINY)[0] == late
            server.maintenance.tick()  # type: ignore[attr-defined]
            assert c.match(late, [_h(11), _h(12)]).num_matched == 0
            assert m.st.nodes["s0"].num_allocated == 0
    finally:
        for s in stores:
            s.stop(0)


def _serve(table: SlotTable, epoch: int) -> object:
    servicer = StoreServicer(
        table,
        endpoint=lambda: pb.NodeEndpoint(),
        layout_fingerprint=LAY.fingerprint(),
        epoch=epoch,
        copy=lambda src, blocks: [],
        max_batch_slots=64,
        inflight=lambda: 0,
    )
    return start_server(
        [(pb_grpc.add_StoreServicer_to_server, servicer, "kvpool.v1.Store")], host="127.0.0.1", port=0
    )


def _register(c: MasterClient, port: int, epoch: int) -> None:
    c.register_node(
        NodeInfo("s0", "store", f"127.0.0.1:{port}", "127.0.0.1:1", epoch),
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=LAY.fingerprint(),
        num_slots=NUM_SLOTS,
        block_nbytes=LAY.block_nbytes,
    )


class _SlowInventory(StoreServicer):
    """A store whose inventory stream starts `delay_s` late (a large store whose listing takes a while)."""

    def __init__(self, *args: object, delay_s: float, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.delay_s = delay_s

    def Inventory(self, request: pb.InventoryRequest, context: object) -> Iterator[object]:  # noqa: N802
        time.sleep(self.delay_s)
        yield from super().Inventory(request, context)  # type: ignore[arg-type]


def test_a_child_waits_for_a_parent_in_a_store_adopted_after_the_grace() -> None:
    """Store s0 lists a child whose parent only s1 holds; s1 registers just after s0 was adopted and its
    inventory takes longer than `rebuild_grace_ms`: the parent's arrival makes the child worth another try
    before its grace is judged, so both are indexed and nothing is freed."""
    server = serve(
        MasterSettings(port=0, layout=TINY, metrics=False, rebuild_grace_ms=1_000, stale_after_ms=60_000)
    )
    m = server.master  # type: ignore[attr-defined]
    with MasterClient(server.address) as c:  # type: ignore[attr-defined]
        ns, _ = c.register_namespace("graced", "v1", TINY)
    child = SlotTable(Segment(NUM_SLOTS * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1))
    _commit(child, [(3, ns, _h(2), _h(1))])
    parent = SlotTable(
        Segment(NUM_SLOTS * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1)
    )
    _commit(parent, [(4, ns, _h(1), b"")])
    slow = _SlowInventory(
        parent,
        endpoint=lambda: pb.NodeEndpoint(),
        layout_fingerprint=LAY.fingerprint(),
        epoch=7,
        copy=lambda src, blocks: [],
        max_batch_slots=64,
        inflight=lambda: 0,
        delay_s=2.5,
    )
    stores = [
        _serve(child, 5),
        start_server(
            [(pb_grpc.add_StoreServicer_to_server, slow, "kvpool.v1.Store")], host="127.0.0.1", port=0
        ),
    ]
    try:
        with MasterClient(server.address) as c:  # type: ignore[attr-defined]
            for node_id, store, epoch in (("s0", stores[0], 5), ("s1", stores[1], 7)):
                if node_id == "s1":
                    _wait(lambda: m.st.nodes["s0"].ready, 30, "s0 adopted (its child waiting)")
                c.register_node(
                    NodeInfo(node_id, "store", f"127.0.0.1:{store.port}", "127.0.0.1:1", epoch),  # type: ignore[attr-defined]
                    protocol_version=PROTOCOL_VERSION,
                    layout_fingerprint=LAY.fingerprint(),
                    num_slots=NUM_SLOTS,
                    block_nbytes=LAY.block_nbytes,
                )
            _wait(lambda: m.st.nodes["s1"].ready, 30, "the slow inventory adopted")
            _wait(
                lambda: c.match(ns, [_h(1), _h(2)]).num_matched == 2, 10, "the child indexed below its parent"
            )
            assert m.st.nodes["s0"].num_allocated == 1  # its slot still held, never freed
    finally:
        for s in stores:
            s.stop(0)  # type: ignore[attr-defined]
        server.stop()
