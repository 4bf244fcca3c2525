"""Adoption at more than a message and a slice: a store's inventory of thousands of chains, read a
thread ahead of the indexing in several messages and many lock slices while the index's hash table
grows (incrementally) underneath, ends with every block indexed once, under its parent, and every
chain matched in full. Plus the read-ahead's own contract (order, errors where they happened, a stop
ends the stream) and the slice sizing. Real components: a store's slot table filled through its own
calls, served by the store's gRPC servicer, registered with a master over its RPC."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvpool.client import MasterClient
from kvpool.client.types import NodeInfo
from kvpool.errors import Unavailable
from kvpool.index.invariants import check_invariants
from kvpool.master import MasterSettings, serve
from kvpool.master.adoption import MAX_SLICE_BLOCKS, MIN_SLICE_BLOCKS, _next_slice, _ReadAhead
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
CHAIN = 16
NUM_CHAINS = 1500  # 24,000 blocks: the table doubles five times from 1,024 positions


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_read_ahead_keeps_order_and_raises_where_the_stream_broke() -> None:
    def stream() -> Iterator[int]:
        yield from range(5)
        raise Unavailable("the store went away")

    got: list[int] = []
    reader = _ReadAhead(iter(stream()), "t")  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="went away"):
        for item in reader:
            got.append(item)  # type: ignore[arg-type]
    reader.close()
    assert got == [0, 1, 2, 3, 4]


def test_read_ahead_stopped_early_ends_the_stream() -> None:
    ended = threading.Event()
    produced: list[int] = []

    def stream() -> Iterator[int]:
        try:
            for i in range(10_000):
                produced.append(i)
                yield i
        finally:
            ended.set()  # (the inventory generator cancels its call here)

    gen = stream()  # (held here: its finally runs only if the reader closes it, not when collected)
    reader = _ReadAhead(gen, "t")  # type: ignore[arg-type]
    for item in reader:
        if item == 3:
            break
    reader.close()
    assert ended.wait(10), "the stream was left open"
    assert len(produced) < 100  # it read a few messages ahead, not the whole stream


def test_slices_move_towards_the_hold_target_within_bounds() -> None:
    assert _next_slice(4096, 0.001) == 8192  # fast: at most doubled
    assert _next_slice(4096, 1.0) == 2048  # slow: at most halved
    assert _next_slice(MIN_SLICE_BLOCKS, 1.0) == MIN_SLICE_BLOCKS
    assert _next_slice(MAX_SLICE_BLOCKS, 1e-6) == MAX_SLICE_BLOCKS


def _fill(table: SlotTable, rng: np.random.Generator, ns: bytes) -> list[list[bytes]]:
    """NUM_CHAINS chains of CHAIN blocks, committed at generation 1 in shuffled slots (a child is often
    listed before its parent, in an earlier message); returns the chains' hashes."""
    chains = [[rng.bytes(16) for _ in range(CHAIN)] for _ in range(NUM_CHAINS)]
    slots = rng.permutation(NUM_CHAINS * CHAIN).tolist()
    res = []
    for c, hashes in enumerate(chains):
        for d, h in enumerate(hashes):
            res.append(Reservation(slots[c * CHAIN + d], 1, ns, h, hashes[d - 1] if d else b""))
    table.reserve(res, 600_000)
    for r in res:
        table.begin_write(r.slot, 1, LAY.block_nbytes)[:] = r.block_hash[: LAY.block_nbytes]
        table.end_write(r.slot, 1, 7, True, landed_checksum=7)
    assert all(not err for _, _, err in table.commit((r.slot, 1) for r in res))
    return chains


def test_an_inventory_of_many_messages_and_slices_is_indexed_whole() -> None:
    settings = MasterSettings(
        port=0,
        layout=TINY,
        metrics=False,
        inventory_batch_blocks=5000,
        heartbeat_timeout_ms=600_000,
        stale_after_ms=600_000,
    )  # (this store sends no heartbeats: neither dead nor stale while the test runs)
    server = serve(settings)
    m = server.master  # type: ignore[attr-defined]
    n = NUM_CHAINS * CHAIN
    with MasterClient(server.address) as c:  # type: ignore[attr-defined]
        ns, _ = c.register_namespace("bulk", "v1", TINY)
    # twice the slots the blocks take: under the watermarks (a full store would have leaves evicted)
    table = SlotTable(Segment(2 * n * LAY.block_nbytes, LAY.block_nbytes, pin_memory="off"), FakeClock(1))
    chains = _fill(table, np.random.default_rng(11), ns)
    servicer = StoreServicer(
        table,
        endpoint=lambda: pb.NodeEndpoint(),
        layout_fingerprint=LAY.fingerprint(),
        epoch=5,
        copy=lambda src, blocks: [],
        max_batch_slots=NUM_CHAINS * CHAIN,
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
                num_slots=2 * n,
                block_nbytes=LAY.block_nbytes,
            )
            _wait(lambda: m.st.nodes["s0"].ready, 120, "the inventory adopted")
            _wait(lambda: m.index.num_blocks == n, 60, "every block indexed")
            assert len(m.adoption_stats.lock_holds_s) >= 5  # messages of 5,000, sliced
            with m.lock:
                check_invariants(m.index)
                assert m.index._table.capacity >= 32_768
            for hashes in chains[:: NUM_CHAINS // 50]:
                assert c.match(ns, hashes).num_matched == CHAIN
            assert m.st.nodes["s0"].num_allocated == n
    finally:
        store.stop(0)
        server.stop()
