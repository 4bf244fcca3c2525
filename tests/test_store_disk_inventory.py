"""A store's inventory with a disk tier, read by today's master: the stream lists memory blocks, then disk
blocks with `medium` disk, resumable from any cursor; the master adopts the memory rows and leaves the disk
rows alone (its disk-aware adoption comes with its side of the tier, docs/disk_tier.md). Real components:
a slot table with a disk tier filled through its own calls, its gRPC servicer, a master over its RPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.client import MasterClient
from kvpool.client import convert as cv
from kvpool.master import MasterSettings, serve
from kvpool.rpc.server import channel
from kvpool.store import Segment, SlotTable
from kvpool.store.disk_tier import DiskTier
from kvpool.store.node import DISK_FIRST_SLOT
from kvpool.store.slots import Reservation
from kvpool.types import MEDIUM_DISK, MEDIUM_MEMORY, FakeClock
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.test_master_inventory_order import LAY, NUM_SLOTS, TINY, _h, _register, _serve, _wait
from transfer.xxh3 import checksum

F = DISK_FIRST_SLOT
NB = LAY.block_nbytes


def _commit(table: SlotTable, gen: int, blocks: list[tuple[int, bytes, bytes, bytes]]) -> None:
    """(slot, namespace, hash, parent hash) each, written and committed at `gen` (memory or disk slots)."""
    table.reserve([Reservation(s, gen, ns, h, p) for s, ns, h, p in blocks], 60_000)
    for s, *_ in blocks:
        data = bytes([s % 251 + 1]) * NB
        table.begin_write(s, gen, NB)[:] = data
        table.end_write(s, gen, checksum(data), True)
    assert all(not err for _, _, err in table.commit([(s, gen) for s, *_ in blocks]))


@pytest.fixture
def table(tmp_path: Path) -> Iterator[SlotTable]:
    tier = DiskTier.open(tmp_path, 64 * 4096, NB, first_slot=F)
    yield SlotTable(Segment(NUM_SLOTS * NB, NB, pin_memory="off"), FakeClock(1), disk=tier)
    tier.close()


def test_the_inventory_lists_disk_blocks_after_memory_ones_and_resumes(table: SlotTable) -> None:
    assert table.disk is not None
    g, ns = table.disk.tier.first_generation, b"n" * 16
    _commit(table, 1, [(3, ns, _h(1), b""), (9, ns, _h(2), _h(1))])
    _commit(table, g, [(F + 5, ns, _h(3), _h(2)), (F + 1, ns, _h(4), b"")])
    b = table.inventory_batch(0, 10)
    assert b.slots.tolist() == [3, 9] and b.medium.tolist() == [MEDIUM_MEMORY] * 2 and b.next_slot == F
    b = table.inventory_batch(b.next_slot, 1)  # a batch of one: the cursor resumes inside the disk part
    assert b.slots.tolist() == [F + 1] and b.medium.tolist() == [MEDIUM_DISK] and b.next_slot == F + 2
    b = table.inventory_batch(b.next_slot, 10)
    assert b.slots.tolist() == [F + 5] and b.generations.tolist() == [g] and b.next_slot == -1
    assert b.block_hashes[0].tobytes() == _h(3) and b.has_parent.tolist() == [True]
    assert b.parent_hashes[0].tobytes() == _h(2)
    wire = cv.inventory_batch(cv.inventory_batch_pb(b, 5))  # the medium column crosses the wire
    assert wire.medium is not None and wire.medium.tolist() == [MEDIUM_DISK]


def test_todays_master_adopts_the_memory_rows_and_leaves_the_disk_rows(table: SlotTable) -> None:
    server = serve(MasterSettings(port=0, layout=TINY, metrics=False, inventory_batch_blocks=2))
    m = server.master  # type: ignore[attr-defined]
    store = None
    try:
        with MasterClient(server.address) as c:  # type: ignore[attr-defined]
            ns, _ = c.register_namespace("m", "v1", TINY)
        assert table.disk is not None
        g = table.disk.tier.first_generation
        _commit(table, 1, [(3, ns, _h(1), b""), (9, ns, _h(2), _h(1))])
        _commit(table, g, [(F + 5, ns, _h(3), _h(2)), (F + 1, ns, _h(4), b"")])  # disk: not adopted yet
        store = _serve(table, 5)
        with channel(f"127.0.0.1:{store.port}") as ch:  # type: ignore[attr-defined]
            listed = list(pb_grpc.StoreStub(ch).Inventory(pb.InventoryRequest(max_entries=2), timeout=10))
        media = np.concatenate([np.frombuffer(r.medium, dtype=np.uint8) for r in listed])
        assert media.tolist() == [0, 0, 1, 1]
        with MasterClient(server.address) as c:  # type: ignore[attr-defined]
            _register(c, store.port, 5)  # type: ignore[attr-defined]
            _wait(lambda: m.st.nodes["s0"].ready, 30, "the inventory adopted")
            assert c.match(ns, [_h(1), _h(2), _h(3)]).num_matched == 2  # the disk child is not indexed
            assert c.match(ns, [_h(4)]).num_matched == 0
            assert m.st.nodes["s0"].num_allocated == 2  # only the memory slots held
    finally:
        if store is not None:
            store.stop(0)  # type: ignore[attr-defined]
        server.stop()
