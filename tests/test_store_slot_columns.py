"""The slot table's columns (no processes): inventory batches and their cursor, write leases past the
uint32 base, namespaces past 255, and no Python object per slot."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidArgument, LeaseExpired, StaleGeneration
from kvpool.store import Segment, SlotState, SlotTable
from kvpool.store.slot_columns import MAX_WRITE_LEASE_MS
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock, InventoryBatch, InventoryItem
from transfer import checksum

NB = 64


def _h(i: int, salt: int = 0) -> bytes:
    return (i + (salt << 64)).to_bytes(16, "big")


def _ns(k: int) -> bytes:
    return k.to_bytes(16, "little")


def _table(n: int = 32, clock: FakeClock | None = None) -> SlotTable:
    return SlotTable(Segment(n * NB, NB, pin_memory="off"), clock or FakeClock(1000))


def _put(t: SlotTable, slot: int, gen: int = 1, *, ns: int = 0, parent: bytes = b"", salt: int = 0) -> int:
    """Reserve, write and commit one block; returns its checksum."""
    t.reserve([Reservation(slot, gen, _ns(ns), _h(slot, salt), parent)], 1000)
    data = bytes([slot % 251, salt % 251]) * (NB // 2)
    t.begin_write(slot, gen, NB)[:] = data
    t.end_write(slot, gen, checksum(data), True)
    assert t.commit([(slot, gen)]) == [(slot, gen, "")]
    return checksum(data)


def _rows(b: InventoryBatch) -> list[InventoryItem]:
    """A batch's entries as items (checks the batch's shapes and dtypes on the way)."""
    n = len(b)
    assert b.block_hashes.shape == b.parent_hashes.shape == (n, 16) and b.block_hashes.dtype == np.uint8
    for col in (b.slots, b.generations, b.checksums, b.size_bytes):
        assert col.shape == (n,) and col.dtype == np.uint64
    assert b.ns_index.dtype == np.int32 and b.has_parent.dtype == np.bool_
    assert len(set(b.namespaces)) == len(b.namespaces)  # distinct
    assert not b.parent_hashes[~b.has_parent].any()  # a first block's parent row is zeros
    return [
        InventoryItem(
            b.namespaces[int(b.ns_index[i])],
            b.block_hashes[i].tobytes(),
            b.parent_hashes[i].tobytes() if b.has_parent[i] else b"",
            int(b.slots[i]),
            int(b.generations[i]),
            int(b.checksums[i]),
            int(b.size_bytes[i]),
        )
        for i in range(n)
    ]


def _stream(t: SlotTable, limit: int) -> list[InventoryItem]:
    out: list[InventoryItem] = []
    cursor = 0
    while cursor != -1:
        b = t.inventory_batch(cursor, limit)
        assert len(b) <= limit and b.slots.tolist() == sorted(b.slots.tolist())
        assert all(s >= cursor for s in b.slots.tolist())
        if b.next_slot != -1:
            assert len(b) == limit and b.next_slot == int(b.slots[-1]) + 1
        out += _rows(b)
        cursor = b.next_slot
    return out


def test_inventory_batch_columns_and_cursor() -> None:
    t = _table()
    sums = {s: _put(t, s, ns=s % 3, parent=_h(s - 1) if s % 4 else b"") for s in (1, 2, 5, 6, 7, 20, 31)}
    t.reserve([Reservation(9, 1, _ns(0), _h(9))], 1000)  # reserved, not committed: not listed
    items = t.inventory()
    assert [i.slot for i in items] == [1, 2, 5, 6, 7, 20, 31]
    for i in items:
        assert (i.namespace, i.block_hash, i.generation, i.checksum, i.size_bytes) == (
            _ns(i.slot % 3),
            _h(i.slot),
            1,
            sums[i.slot],
            NB,
        )
        assert i.parent_hash == (_h(i.slot - 1) if i.slot % 4 else b"")
    for limit in (1, 2, 3, 7, 8, 100):
        assert _stream(t, limit) == items
    b = t.inventory_batch(0, 3)
    assert b.slots.tolist() == [1, 2, 5] and b.next_slot == 6
    assert b.namespaces == [_ns(1), _ns(2)] and b.ns_index.tolist() == [0, 1, 1]  # this batch's only
    assert b.has_parent.tolist() == [True, True, True]
    assert t.inventory_batch(6, 5).next_slot == -1  # 6, 7, 20, 31: nothing after them
    assert t.inventory_batch(0, 7).next_slot == -1  # exactly the last one: nothing follows
    assert t.inventory_batch(21, 1).slots.tolist() == [31] and t.inventory_batch(21, 1).next_slot == -1
    assert t.inventory_batch(32, 1).next_slot == -1 and len(t.inventory_batch(10**9, 4)) == 0
    for bad in ((-1, 4), (0, 0), (0, -3), (True, 4), (0, 2.0)):
        with pytest.raises(InvalidArgument):
            t.inventory_batch(*bad)  # type: ignore[arg-type]


def test_inventory_batch_resumes_across_commits_and_frees() -> None:
    """Between two batches blocks are committed, freed (at once, or deferred by a reader) and re-used;
    the next batch from the cursor shows the table as it is then, never a freed block."""
    t = _table()
    for s in range(10):
        _put(t, s, parent=_h(s, 1))
    first = t.inventory_batch(0, 4)
    assert first.slots.tolist() == [0, 1, 2, 3] and first.next_slot == 4
    t.free([(4, 1), (2, 1)])  # one ahead of the cursor, one behind it
    t.begin_read(5, 1, NB)
    assert t.free([(5, 1)])[0].deferred  # a free pending: no longer listed
    _put(t, 12)  # committed ahead of the cursor
    t.reserve([Reservation(13, 1, _ns(0), _h(13))], 1000)  # reserved only
    second = t.inventory_batch(first.next_slot, 4)
    assert second.slots.tolist() == [6, 7, 8, 9] and second.next_slot == 10
    t.free([(12, 1)])
    _put(t, 4, gen=2, salt=7)  # the freed slot 4 holds a new block (a first one), behind the cursor now
    third = t.inventory_batch(second.next_slot, 4)
    assert len(third) == 0 and third.next_slot == -1
    t.end_read(5)
    assert [(i.slot, i.generation, i.block_hash, i.parent_hash) for i in t.inventory()] == [
        (s, 2, _h(4, 7), b"") if s == 4 else (s, 1, _h(s), _h(s, 1)) for s in (0, 1, 3, 4, 6, 7, 8, 9)
    ]


def test_inventory_batch_scans_a_sparse_table_in_windows() -> None:
    """A table larger than one scan window with few committed blocks far apart: each batch finds them
    across windows and in order, at any limit."""
    t = SlotTable(Segment(300_000 * 4, 4, pin_memory="off"), FakeClock(1000))
    where = [5, 65_535, 65_536, 140_001, 262_143, 299_999]
    for s in where:
        t.reserve([Reservation(s, 1, _ns(s % 2), _h(s))], 1000)
        t.begin_write(s, 1, 4)[:] = b"abcd"
        t.end_write(s, 1, checksum(b"abcd"), True)
        t.commit([(s, 1)])
    for limit in (1, 2, 4, 6, 100_000):
        got = []
        cursor = 0
        while cursor != -1:
            b = t.inventory_batch(cursor, limit)
            got += b.slots.tolist()
            assert [x.block_hash for x in _rows(b)] == [_h(s) for s in b.slots.tolist()]
            cursor = b.next_slot
        assert got == where
    assert t.inventory_batch(140_002, 1).slots.tolist() == [262_143]
    assert t.inventory_batch(262_144, 1).next_slot == -1


_OP = st.tuples(st.sampled_from(["put", "free", "read", "end", "reserve", "reap"]), st.integers(0, 23))


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_OP, max_size=60), limit=st.integers(1, 9), ns_count=st.integers(1, 4))
def test_inventory_is_the_committed_blocks_after_any_history(
    ops: list[tuple[str, int]], limit: int, ns_count: int
) -> None:
    """After any history of puts, frees (deferred or not), reads, reservations and lease reaps, the
    batches read from cursor to end equal a plain model of the committed blocks (`inventory()` too)."""
    clock = FakeClock(1000)
    t = _table(24, clock)
    model: dict[int, tuple[bytes, bytes, bytes, int]] = {}  # slot -> (namespace, hash, parent, generation)
    readers: dict[int, int] = {}
    freeing: set[int] = set()
    for step, (op, slot) in enumerate(ops):
        state, gen = t.state(slot)
        if op in ("put", "reserve") and state == SlotState.FREE:
            ns, parent = step % ns_count, _h(step, 1) if step % 2 else b""
            if op == "reserve":
                t.reserve([Reservation(slot, gen, _ns(ns), _h(slot, step), parent)], 5)
                continue
            t.reserve([Reservation(slot, gen, _ns(ns), _h(slot, step), parent)], 1000)
            data = bytes([step % 256]) * NB
            t.begin_write(slot, gen, NB)[:] = data
            t.end_write(slot, gen, checksum(data), True)
            t.commit([(slot, gen)])
            model[slot] = (_ns(ns), _h(slot, step), parent, gen)
        elif op == "free" and state != SlotState.FREE:
            t.free([(slot, gen)])
            model.pop(slot, None)
            if readers.get(slot):
                freeing.add(slot)
        elif op == "read" and slot in model and slot not in freeing:
            t.begin_read(slot, gen, NB)
            readers[slot] = readers.get(slot, 0) + 1
        elif op == "end" and readers.get(slot):
            t.end_read(slot)
            readers[slot] -= 1
            if not readers[slot]:
                freeing.discard(slot)
        elif op == "reap":
            clock.advance(slot)
            t.reap_expired()
    want = [(s, *model[s]) for s in sorted(model)]

    def seen(items: list[InventoryItem]) -> list[tuple[int, bytes, bytes, bytes, int]]:
        return [(i.slot, i.namespace, i.block_hash, i.parent_hash, i.generation) for i in items]

    assert seen(_stream(t, limit)) == want
    assert seen(t.inventory()) == want
    assert t.num_used == sum(t.state(s)[0] != SlotState.FREE for s in range(24))


def test_namespaces_past_255_and_65535_keep_their_blocks() -> None:
    """The namespace column widens (1, then 2, then 4 bytes a slot) without losing a slot's namespace."""
    t = _table(8)
    cols = t._cols
    first = [_ns(k) for k in range(300)]
    for k, ns in enumerate(first):
        slot = k % 8
        if t.state(slot)[0] != SlotState.FREE:
            t.free([(slot, t.state(slot)[1])])
        t.reserve([Reservation(slot, t.state(slot)[1], ns, _h(k))], 1000)
    assert cols.ns.dtype == np.uint16
    for k in range(300, 66_000):  # names only: the table grows past 65,535 entries
        cols.ns_id(_ns(k))
    assert cols.ns.dtype == np.uint32
    gen = t.state(0)[1]
    t.free([(0, gen)])
    _put(t, 0, gen + 1, ns=65_999)
    items = {i.slot: i for i in t.inventory()}
    assert items[0].namespace == _ns(65_999)
    assert cols.block_of(1) == (first[297], _h(297))  # slot 1's last reservation: k = 297


def test_write_lease_survives_the_base_moving_forward() -> None:
    """Leases are stored as uint32 ms after a base that moves forward before a lease would overflow;
    a live lease keeps its expiry to the millisecond across the move, and an ancient one stays ended."""
    clock = FakeClock(0)
    t = _table(4, clock)
    t.reserve([Reservation(3, 1, _ns(0), _h(3))], 1)  # ends at 1 ms: reaped only much later
    clock.set((1 << 30) - 5)
    t.reserve([Reservation(0, 1, _ns(0), _h(0))], MAX_WRITE_LEASE_MS)  # ends at 2^31 - 5
    clock.set((1 << 30) + 10)
    t.reserve([Reservation(1, 1, _ns(0), _h(1))], MAX_WRITE_LEASE_MS)  # past 2^31 after the base: moves
    assert t._cols.lease_base_ms == (1 << 30) + 10
    clock.set((1 << 31) - 6)
    t.begin_write(0, 1, NB)  # one ms left
    t.end_write(0, 1, 0, False)
    clock.set((1 << 31) - 5)
    with pytest.raises(LeaseExpired):
        t.begin_write(0, 1, NB)
    assert t.reap_expired() == 2 and sorted(t.drain_freed()) == [(0, 2), (3, 2)]
    assert t.state(1) == (SlotState.RESERVED, 1)
    clock.set((1 << 30) + 10 + MAX_WRITE_LEASE_MS - 1)
    assert t.reap_expired() == 0
    clock.advance(1)
    assert t.reap_expired() == 1
    clock.advance(1 << 33)  # more than uint32 ms after the base
    t.reserve([Reservation(2, 1, _ns(0), _h(2))], 50)
    assert t.reap_expired() == 0 and t.state(2) == (SlotState.RESERVED, 1)
    clock.advance(50)
    assert t.reap_expired() == 1
    with pytest.raises(InvalidArgument):
        t.reserve([Reservation(2, 2, _ns(0), _h(2))], MAX_WRITE_LEASE_MS + 1)


def test_reap_skips_only_while_no_lease_can_have_ended() -> None:
    """`reap_expired` skips its scan until the earliest expiry; a shorter lease granted after a scan
    moves that time earlier."""
    clock = FakeClock(1000)
    t = _table(4, clock)
    t.reserve([Reservation(0, 1, _ns(0), _h(0))], 1000)  # ends at 2000
    t.reserve([Reservation(1, 1, _ns(0), _h(1))], 10)  # ends at 1010
    clock.set(1010)
    assert t.reap_expired() == 1  # scans: the next expiry is 2000 now
    clock.set(1500)
    t.reserve([Reservation(2, 1, _ns(0), _h(2))], 100)  # ends at 1600, before 2000
    clock.set(1600)
    assert t.reap_expired() == 1 and t.drain_freed() == [(1, 2), (2, 2)]
    clock.set(2000)
    assert t.reap_expired() == 1 and t.state(0) == (SlotState.FREE, 2)


def test_an_expired_lease_waits_for_the_write_in_flight() -> None:
    """A reservation whose lease ends while its write is in flight is reclaimed when the write ends (its
    bytes are not kept), not under the writer; others that ended are reclaimed at once."""
    clock = FakeClock(1000)
    t = _table(4, clock)
    t.reserve([Reservation(s, 1, _ns(0), _h(s)) for s in (0, 1, 2)], 100)
    buf = t.begin_write(1, 1, NB)
    clock.advance(100)
    assert t.reap_expired() == 2 and sorted(t.drain_freed()) == [(0, 2), (2, 2)]
    assert t.state(1) == (SlotState.RESERVED, 1)  # the writer still holds it
    assert t.reap_expired() == 0 and t.drain_freed() == []  # asked again: still waiting, not doubled
    buf[:] = b"w" * NB
    with pytest.raises(StaleGeneration):
        t.end_write(1, 1, checksum(b"w" * NB), True)
    assert t.state(1) == (SlotState.FREE, 2) and t.drain_freed() == [(1, 2)] and t.num_used == 0


def test_capabilities_are_checked_against_the_block_a_slot_last_held() -> None:
    """With capabilities, a freed slot still knows its last block: a capability for it at the old
    generation is valid and the read is refused as stale; a slot that never held a block refuses every
    capability as invalid, so a caller without one learns nothing of either."""
    from kvpool.capability import READ, Capabilities, CapabilityKey
    from kvpool.errors import PermissionDenied

    clock = FakeClock(10_000)
    caps = Capabilities(CapabilityKey(b"k" * 32), clock=clock, skew_ms=1000)
    t = SlotTable(Segment(4 * NB, NB, pin_memory="off"), clock, capabilities=caps, node_id="s")
    t.reserve([Reservation(1, 1, _ns(5), _h(1))], 1000)
    t.begin_copy_write(1, 1, NB)[:] = b"a" * NB
    t.end_write(1, 1, checksum(b"a" * NB), True)
    assert t.commit([(1, 1)]) == [(1, 1, "")]
    exp = 20_000
    good = caps.sign(READ, _ns(5), _h(1), "s", 1, 1, exp)
    t.begin_read(1, 1, NB, good, exp)
    t.end_read(1)
    t.free([(1, 1)])
    with pytest.raises(StaleGeneration):
        t.begin_read(1, 1, NB, good, exp)
    with pytest.raises(PermissionDenied, match="invalid"):
        t.begin_read(1, 1, NB, caps.sign(READ, _ns(6), _h(1), "s", 1, 1, exp), exp)  # another namespace's
    for ns, h in ((b"", b""), (_ns(5), bytes(16)), (_ns(5), _h(2))):  # slot 2 never held a block
        with pytest.raises(PermissionDenied, match="invalid"):
            t.begin_read(2, 1, NB, caps.sign(READ, ns, h, "s", 2, 1, exp) if ns else b"x" * 16, exp)


def test_no_python_object_per_slot() -> None:
    """Filling every slot allocates no Python memory per slot (the columns are allocated up front), and
    the columns cost at most 60 bytes a slot."""
    n = 20_000
    t = SlotTable(Segment(n * 4, 4, pin_memory="off"), FakeClock(1000))
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for start in range(0, n, 1000):
            slots = range(start, start + 1000)
            t.reserve([Reservation(s, 1, _ns(s % 3), _h(s), _h(s - 1) if s else b"") for s in slots], 1000)
            for s in slots:
                t.begin_write(s, 1, 4)[:] = b"abcd"
                t.end_write(s, 1, 7, True, landed_checksum=7)
            t.commit((s, 1) for s in slots)
        gc.collect()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert t.num_used == n and len(t.inventory_batch(0, n)) == n
    assert grown - base < n // 2  # under half a byte a slot: nothing kept per slot
    cols = t._cols
    per_slot = [t._gen, t._checksum, t._readable, t._state, t._flags, t._readers]
    per_slot += [cols.ns, cols.block_hash, cols.parent_hash, cols.lease]
    assert sum(a.nbytes for a in per_slot) <= 60 * n
