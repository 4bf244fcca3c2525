"""Slot table unit tests (no processes): states, generations, leases, deferred frees, sizes (B14, B16, B17, B23)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import (
    AlreadyExists,
    ChecksumMismatch,
    FailedPrecondition,
    InvalidArgument,
    LeaseExpired,
    StaleGeneration,
)
from kvpool.store import Segment, SlotState, SlotTable, parse_size
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock
from transfer import BlockRead, BlockWrite, LoopbackBlockServer, LoopbackTransport, checksum

NB = 4096
NS = b"n" * 16


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture
def table() -> tuple[SlotTable, FakeClock]:
    clock = FakeClock(1000)
    return SlotTable(Segment(8 * NB, NB, pin_memory="off"), clock), clock


def _put(t: SlotTable, slot: int, data: bytes, gen: int = 1, commit: bool = True) -> None:
    t.reserve([Reservation(slot, gen, NS, _h(slot))], 1000)
    t.begin_write(slot, gen, NB)[:] = data
    t.end_write(slot, gen, checksum(data), True)
    if commit:
        assert t.commit([(slot, gen)]) == [(slot, gen, "")]


def test_parse_size() -> None:
    assert parse_size("256MiB") == 256 << 20
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    for bad in ("", "12XB", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_two_phase_write_and_read(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    data = np.random.default_rng(0).integers(0, 256, NB, dtype=np.uint8).tobytes()
    t.reserve([Reservation(3, 1, NS, _h(3))], 1000)
    with pytest.raises(FailedPrecondition, match="not committed"):
        t.begin_read(3, 1, NB)  # reserved: invisible
    t.begin_write(3, 1, NB)[:] = data
    t.end_write(3, 1, checksum(data), True)
    assert t.state(3) == (SlotState.WRITTEN, 1)
    with pytest.raises(FailedPrecondition):
        t.begin_read(3, 1, NB)  # written, not committed: invisible
    assert t.commit([(3, 1), (3, 1)]) == [(3, 1, ""), (3, 1, "")]  # idempotent
    view, cs = t.begin_read(3, 1, NB)
    assert bytes(view) == data and cs == checksum(data)
    t.end_read(3)
    with pytest.raises(AlreadyExists):
        t.begin_write(3, 1, NB)
    [item] = t.inventory()
    assert (item.slot, item.generation, item.checksum, item.block_hash) == (3, 1, cs, _h(3))


def test_commit_errors_per_slot(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    t.reserve([Reservation(0, 1, NS, _h(0))], 1000)
    res = t.commit([(0, 1), (1, 1), (0, 2), (99, 1)])
    assert [e.split(":")[0] for _, _, e in res] == [
        "FailedPrecondition",
        "FailedPrecondition",
        "StaleGeneration",
        "InvalidArgument",
    ]


def test_writer_checksum_must_match(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    t.reserve([Reservation(1, 1, NS, _h(1))], 1000)
    t.begin_write(1, 1, NB)[:] = b"x" * NB
    with pytest.raises(ChecksumMismatch):
        t.end_write(1, 1, checksum(b"y" * NB), True)
    assert t.state(1) == (SlotState.RESERVED, 1)  # may retry within the lease
    t.begin_write(1, 1, NB)[:] = b"y" * NB
    t.end_write(1, 1, checksum(b"y" * NB), True)
    assert t.state(1) == (SlotState.WRITTEN, 1)


def test_reservation_expires_and_is_reclaimed(table: tuple[SlotTable, FakeClock]) -> None:
    t, clock = table
    t.reserve([Reservation(2, 1, NS, _h(2))], 100)
    _put(t, 4, b"a" * NB)
    clock.advance(99)
    assert t.reap_expired() == 0
    clock.advance(1)
    with pytest.raises(LeaseExpired):
        t.begin_write(2, 1, NB)
    assert t.reap_expired() == 1
    assert t.state(2) == (SlotState.FREE, 2)
    assert t.drain_freed() == [(2, 2)]
    assert t.state(4) == (SlotState.COMMITTED, 1)  # committed blocks have no write lease
    with pytest.raises(StaleGeneration):
        t.reserve([Reservation(2, 1, NS, _h(2))], 100)
    t.reserve([Reservation(2, 2, NS, _h(2))], 100)


def test_reserve_is_all_or_nothing_and_validated(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    _put(t, 0, b"a" * NB)
    with pytest.raises(FailedPrecondition):
        t.reserve([Reservation(1, 1, NS, _h(1)), Reservation(0, 1, NS, _h(9))], 100)
    assert t.state(1) == (SlotState.FREE, 1)
    with pytest.raises(InvalidArgument, match="out of range"):
        t.reserve([Reservation(8, 1, NS, _h(1))], 100)
    with pytest.raises(InvalidArgument, match="twice"):
        t.reserve([Reservation(1, 1, NS, _h(1)), Reservation(1, 1, NS, _h(1))], 100)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        t.reserve([Reservation(1, 1, NS, b"short")], 100)
    with pytest.raises(InvalidArgument):
        t.reserve([Reservation(1, 1, NS, _h(1))], 0)
    t.reserve([Reservation(1, 5, NS, _h(1))], 100)  # a generation ahead: the slot jumps forward
    assert t.state(1) == (SlotState.RESERVED, 5)


def test_free_during_read_is_deferred_b14_b16(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    data = bytes(range(256)) * (NB // 256)
    _put(t, 5, data)
    view, cs = t.begin_read(5, 1, NB)  # a reader holds the slot
    [f] = t.free([(5, 1)])
    assert f.deferred and f.new_generation == 2
    assert t.free([(5, 1)])[0].deferred  # repeated order: still deferred, not doubled
    with pytest.raises(StaleGeneration):
        t.begin_read(5, 1, NB)  # new reads are refused at once
    with pytest.raises(FailedPrecondition):
        t.reserve([Reservation(5, 2, NS, _h(5))], 100)  # not reusable before the read ends
    assert t.inventory() == []
    assert bytes(view) == data and checksum(view) == cs  # the reader sees intact bytes
    assert t.drain_freed() == []
    t.end_read(5)
    assert t.state(5) == (SlotState.FREE, 2)
    assert t.drain_freed() == [(5, 2)]
    assert t.num_used == 0
    # idempotent: an already-freed slot answers its current generation
    assert t.free([(5, 1)])[0] == type(f)(5, 2, False)


def test_free_during_write_is_deferred(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    t.reserve([Reservation(6, 1, NS, _h(6))], 1000)
    buf = t.begin_write(6, 1, NB)
    assert t.free([(6, 1)])[0].deferred
    buf[:] = b"z" * NB
    with pytest.raises(StaleGeneration):
        t.end_write(6, 1, checksum(b"z" * NB), True)
    assert t.state(6) == (SlotState.FREE, 2)


def test_stale_generation_read_refused_b17(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    _put(t, 7, b"o" * NB)
    t.free([(7, 1)])
    _put(t, 7, b"n" * NB, gen=2)
    with pytest.raises(StaleGeneration):
        t.begin_read(7, 1, NB)  # the old reader never gets the new block's bytes


def test_block_size_checked_against_layout_b23(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    _put(t, 0, b"a" * NB)
    with pytest.raises(InvalidArgument, match="layout"):
        t.begin_read(0, 1, NB // 2)  # e.g. an fp8 consumer of a bf16 producer
    t.reserve([Reservation(1, 1, NS, _h(1))], 1000)
    with pytest.raises(InvalidArgument, match="layout"):
        t.begin_write(1, 1, NB * 2)


def test_loopback_transport_round_trip(table: tuple[SlotTable, FakeClock]) -> None:
    t, _ = table
    server = LoopbackBlockServer(t)
    server.start()
    tr = LoopbackTransport()
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, NB, dtype=np.uint8) for _ in range(4)]
    t.reserve([Reservation(i, 1, NS, _h(i)) for i in range(4)], 1000)
    res = tr.write_blocks(
        server.address, [BlockWrite(i, 1, b, checksum(b)) for i, b in enumerate(blocks)], timeout_s=1
    )
    assert all(r.ok for r in res)
    t.commit([(i, 1) for i in range(4)])
    out = [memoryview(bytearray(NB)) for _ in range(5)]
    res = tr.read_blocks(
        server.address, [BlockRead(i, 1, NB) for i in range(4)] + [BlockRead(4, 1, NB)], out, timeout_s=1
    )
    assert [r.ok for r in res] == [True] * 4 + [False]
    assert all(bytes(out[i]) == blocks[i].tobytes() for i in range(4))
    t.segment.array[0] ^= 0xFF  # flip a byte in the segment
    [bad] = tr.read_blocks(server.address, [BlockRead(0, 1, NB)], out[:1], timeout_s=1)
    assert not bad.ok and "checksum" in bad.error
    server.stop()


def test_begin_reads_answers_each_read_as_begin_read_would(table: tuple[SlotTable, FakeClock]) -> None:
    """The batch grant (one lock per message, used by the UCX server) gives per read exactly what
    `begin_read` gives or raises, pins the granted slots, and `end_reads` unpins them (a deferred free then
    completes)."""
    t, _ = table
    data = [bytes([i]) * NB for i in range(3)]
    for i in range(3):
        _put(t, i, data[i])
    t.reserve([Reservation(5, 1, b"N" * 16, _h(5))], 10_000)  # reserved, not committed
    reads = [(0, 1, NB, b"", 0), (1, 2, NB, b"", 0), (99, 1, NB, b"", 0), (2, 1, NB + 1, b"", 0),
             (5, 1, NB, b"", 0), (2, 1, NB, b"", 0)]  # fmt: skip
    got = t.begin_reads(reads)
    assert [type(g).__name__ if isinstance(g, Exception) else "ok" for g in got] == [
        "ok",
        "StaleGeneration",
        "InvalidArgument",
        "InvalidArgument",
        "FailedPrecondition",
        "ok",
    ]
    for r, g in zip(reads, got, strict=True):
        if isinstance(g, Exception):
            with pytest.raises(type(g)):
                t.begin_read(*r)
        else:
            assert bytes(g[0]) == data[r[0]] and g[1] == checksum(data[r[0]])
    assert t.num_inflight == 2
    assert t.free([(0, 1)])[0].deferred  # slot 0 is being read: the free waits
    t.end_reads([0, 2])
    assert t.num_inflight == 0 and t.state(0) == (SlotState.FREE, 2)


_READ = st.tuples(
    st.one_of(st.integers(0, 9), st.integers(-2, 2**65), st.booleans()),  # slot (8 exist)
    st.one_of(st.integers(0, 3), st.just(2**64 + 1)),  # generation
    st.sampled_from([NB, NB, NB, NB - 1, 0]),  # nbytes
)


_LIKELY_GOOD = st.lists(st.tuples(st.integers(0, 7), st.just(1), st.just(NB)), min_size=8, max_size=24)
_STATE = st.sampled_from(["committed"] * 6 + ["free", "reserved", "freeing"])


@settings(max_examples=300, deadline=None)
@given(
    states=st.lists(_STATE, min_size=8, max_size=8),
    reads=st.one_of(
        st.lists(_READ, max_size=24),
        _LIKELY_GOOD,
        st.tuples(_LIKELY_GOOD, _READ).map(lambda x: [*x[0], x[1]]),
    ),
)
def test_batch_grant_equals_one_read_at_a_time(states: list[str], reads: list[tuple[int, int, int]]) -> None:
    """`begin_reads` checks a whole batch with array operations when every read would succeed; any
    batch must give exactly what the per-read path gives: the same grants, errors and pins."""

    def build() -> SlotTable:
        t = SlotTable(Segment(8 * NB, NB, pin_memory="off"), FakeClock(1000))
        for slot, state in enumerate(states):
            if state == "free":
                continue
            t.reserve([Reservation(slot, 1, NS, _h(slot))], 10_000)
            if state != "reserved":
                _put_reserved(t, slot)
            if state == "freeing":
                t.begin_read(slot, 1, NB)  # a reader holds it: the free is deferred
                assert t.free([(slot, 1)])[0].deferred
        return t

    fast, slow = build(), build()
    slow._begin_reads_at_once = lambda reads: None  # type: ignore[method-assign]
    full = [(s, g, n, b"", 0) for s, g, n in reads]
    a, b = fast.begin_reads(full), slow.begin_reads(full)
    assert [type(x) for x in a] == [type(x) for x in b]
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Exception):
            assert str(x) == str(y)
        else:
            assert not isinstance(y, Exception)
            assert bytes(x[0]) == bytes(y[0]) and x[1] == y[1]
    assert fast.num_inflight == slow.num_inflight and np.array_equal(fast._readers, slow._readers)

    # the array form (`mread`): all begun exactly when every read succeeds one at a time, else none
    arr, before = build(), build()
    if any(type(v) is not int for r in reads for v in r):  # a bool slot: only a list can carry it
        return
    try:
        rows = np.array(reads, dtype=np.uint64).reshape(-1, 3)
    except (OverflowError, TypeError, ValueError):  # not representable: the wire refuses it before
        return
    got = arr.begin_reads_array(rows)
    if got is None:
        assert not reads or any(isinstance(y, Exception) for y in b)
        assert arr.num_inflight == before.num_inflight and np.array_equal(arr._readers, before._readers)
    else:
        assert reads and not any(isinstance(y, Exception) for y in b)
        buf, starts, sums = got
        assert [bytes(buf[s : s + NB]) for s in starts.tolist()] == [bytes(y[0]) for y in b]
        assert sums.tolist() == [y[1] for y in b]
        assert arr.num_inflight == slow.num_inflight and np.array_equal(arr._readers, slow._readers)


def _put_reserved(t: SlotTable, slot: int) -> None:
    data = bytes([slot]) * NB
    t.begin_write(slot, 1, NB)[:] = data
    t.end_write(slot, 1, checksum(data), True)
    assert t.commit([(slot, 1)]) == [(slot, 1, "")]


def test_shared_slot_state_follows_every_transition() -> None:
    """What same-host readers map (transfer/slot_state.py): generation, checksum, and `readable` exactly
    while a slot is COMMITTED with no free pending; a release clears it and bumps the generation."""
    from kvpool.capability import Capabilities, CapabilityKey

    clock = FakeClock(1000)
    t = SlotTable(Segment(8 * NB, NB, pin_memory="off", share=True), clock)
    st = t.shared_state
    assert st is not None and st.num_slots == 8 and st.block_nbytes == NB
    assert st.generation.tolist() == [1] * 8 and not st.readable.any()

    def readable() -> list[int]:
        return np.flatnonzero(st.readable).tolist()

    d = [bytes([k]) * NB for k in range(3)]
    _put(t, 0, d[0], commit=False)
    assert readable() == [] and int(st.checksum[0]) == checksum(d[0])  # written, not yet visible
    assert t.commit([(0, 1)]) == [(0, 1, "")]
    _put(t, 1, d[1])
    assert readable() == [0, 1]
    t.begin_read(0, 1, NB)
    assert t.free([(0, 1)])[0].deferred
    assert readable() == [1] and int(st.generation[0]) == 1  # free pending: no longer readable
    t.end_read(0)
    assert readable() == [1] and int(st.generation[0]) == 2  # released: the generation moved on
    t.free([(1, 1)])
    assert readable() == [] and st.generation.tolist()[:2] == [2, 2]
    _put(t, 1, d[2], gen=2)
    assert readable() == [1] and int(st.checksum[1]) == checksum(d[2])
    t.reserve([Reservation(2, 1, NS, _h(2))], 10)
    clock.advance(20)
    assert t.reap_expired() == 1 and readable() == [1] and int(st.generation[2]) == 2

    # not shared: a private segment, or a store that checks capabilities (every read then shows one to it)
    assert SlotTable(Segment(8 * NB, NB, pin_memory="off"), FakeClock(1000)).shared_state is None
    caps = Capabilities(CapabilityKey(b"k" * 32), clock=FakeClock(1000), skew_ms=1000)
    shared = Segment(8 * NB, NB, pin_memory="off", share=True)
    assert SlotTable(shared, FakeClock(1000), capabilities=caps).shared_state is None


def test_metered_handler_counts_every_read_it_grants() -> None:
    """Per-block, batch and array grants are counted alike (the array grant is the `mread` path)."""
    from kvpool.store.metrics import MeteredHandler, StoreMetrics

    t = SlotTable(Segment(8 * NB, NB, pin_memory="off"), FakeClock(1000))
    for k in range(3):
        _put(t, k, bytes([k]) * NB)
    metrics = StoreMetrics(t)
    h = MeteredHandler(t, metrics)

    def counted() -> tuple[float, float, float]:
        get = metrics.registry.get_sample_value
        return (
            get("kvpool_store_blocks_served_total", {"op": "read"}) or 0.0,
            get("kvpool_store_served_bytes_total", {"op": "read"}) or 0.0,
            get("kvpool_store_transfer_errors_total", {"op": "read"}) or 0.0,
        )

    h.begin_read(0, 1, NB)
    assert h.begin_reads([(1, 1, NB, b"", 0), (5, 1, NB, b"", 0)])[1] is not None
    assert h.begin_reads_array(np.array([[0, 1, NB], [2, 1, NB]], dtype=np.uint64)) is not None
    assert h.begin_reads_array(np.array([[6, 1, NB]], dtype=np.uint64)) is None  # free: nothing begun
    assert counted() == (4.0, 4.0 * NB, 1.0)
