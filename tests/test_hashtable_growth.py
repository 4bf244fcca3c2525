"""The index's hash table grows incrementally: while an old table is moved into the new one a few
positions per step, inserts, deletes (scalar and batch) and lookups (scalar and batch) interleaved with
the steps agree with a dict, and no single call moves the whole old table."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.index.hashtable import EMPTY, TOMB, HashTable

ROWS = 6000


def _key(i: int, random: bool) -> bytes:
    if random:
        return np.random.default_rng(i).bytes(16)
    return i.to_bytes(16, "little")  # small integers: share their high bytes, long probe runs


class _Keys:
    """The index's columns in miniature: hashes and slots per row, rows handed out and given back."""

    def __init__(self) -> None:
        self.h64 = np.zeros((ROWS, 2), np.uint64)
        self.ns = np.zeros(ROWS, np.int32)
        self.free = list(range(ROWS))[::-1]

    def put(self, slot: int, key: bytes) -> int:
        row = self.free.pop()
        self.h64[row] = np.frombuffer(key, "<u8")
        self.ns[row] = slot
        return row


def _check(table: HashTable, ref: dict[tuple[int, bytes], int]) -> None:
    assert table.count == len(ref) == len(table.rows())
    assert sorted(table.rows().tolist()) == sorted(ref.values())
    assert table.tombs == int(np.count_nonzero(table.table == TOMB))


def _probe_all(table: HashTable, ref: dict[tuple[int, bytes], int], absent: list[tuple[int, bytes]]) -> None:
    for (s, k), r in ref.items():
        assert table.find(s, k) == r
    for s, k in absent:
        assert table.find(s, k) == -1
    probe = list(ref) + absent
    if probe:
        keys = np.frombuffer(b"".join(k for _, k in probe), "<u8").reshape(-1, 2)
        want = [ref.get(p, -1) for p in probe]
        assert table.find_many(np.array([s for s, _ in probe]), keys).tolist() == want


class GrowthMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cols = _Keys()
        self.table = HashTable(self.cols.h64, self.cols.ns, migrate_positions=32)
        self.ref: dict[tuple[int, bytes], int] = {}
        self.next = 0
        self.saw_migration = False

    @rule(n=st.integers(1, 400), slot=st.integers(0, 2), random=st.booleans())
    def insert_batch(self, n: int, slot: int, random: bool) -> None:
        n = min(n, len(self.cols.free))
        rows = []
        for _ in range(n):
            key = _key(self.next, random)
            self.next += 1
            rows.append(self.cols.put(slot, key))
            self.ref[(slot, key)] = rows[-1]
        self.table.insert_many(np.array(rows, dtype=np.int64))
        self.saw_migration |= self.table.migrating

    @rule(frac=st.floats(0.0, 1.0), single=st.booleans(), data=st.data())
    def delete(self, frac: float, single: bool, data: st.DataObject) -> None:
        keys = list(self.ref)
        if not keys:
            return
        k = 1 if single else max(1, int(len(keys) * frac))
        chosen = data.draw(st.permutations(keys))[:k]
        rows = np.array([self.ref.pop(key) for key in chosen], dtype=np.int64)
        self.table.delete_many(rows)
        self.cols.free.extend(rows.tolist())

    @rule(positions=st.integers(1, 200))
    def step(self, positions: int) -> None:
        self.table.step(positions)

    @invariant()
    def agrees_with_the_dict(self) -> None:
        _check(self.table, self.ref)
        _probe_all(self.table, self.ref, [(0, _key(10**9, False)), (3, _key(10**9 + 1, True))])


GrowthMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_growth_state_machine = GrowthMachine.TestCase


def test_growth_moves_a_bounded_number_of_positions_per_call() -> None:
    """About 100 K random keys inserted 512 at a time into a table moving 256 positions per step: every
    doubling leaves the old table in place after the insert that began it, each insert moves at most
    its budget plus one probe run, and every key is found before, during and after the migrations."""
    n, batch = 512 * 196, 512
    rng = np.random.default_rng(3)
    h64 = rng.integers(0, 2**63, (n, 2), dtype=np.int64).astype(np.uint64)
    ns = np.zeros(n, np.int32)
    table = HashTable(h64, ns, migrate_positions=256)
    growths = 0
    for lo in range(0, n, batch):
        cap, moved_before = table.capacity, table._moved if table.migrating else None
        table.insert_many(np.arange(lo, lo + batch))
        if table.capacity != cap:
            growths += 1
            assert table.migrating, "a doubling moved the whole old table in one call"
            assert table._moved <= 256 + 64
        elif moved_before is not None and table.migrating:
            assert table._moved - moved_before <= 16 * batch + 64
        sample = rng.integers(0, lo + batch, 200)
        assert (table.find_many(0, h64[sample]) == sample).all()
        assert all(table.find(0, h64[r].tobytes()) == r for r in sample[:20].tolist())
    assert growths >= 6
    while table.step():
        pass
    assert not table.migrating
    assert (table.find_many(0, h64) == np.arange(n)).all()
    assert table.count == n and int(np.count_nonzero(table.table >= 0)) == n


def test_deletes_reach_entries_still_in_the_old_table() -> None:
    """Rows deleted while they are still in the old table are gone from both lookups, and are not
    moved into the new table afterwards."""
    n = 3000
    rng = np.random.default_rng(9)
    h64 = rng.integers(0, 2**63, (n, 2), dtype=np.int64).astype(np.uint64)
    ns = np.zeros(n, np.int32)
    table = HashTable(h64, ns, migrate_positions=8)
    table.insert_many(np.arange(650))
    table.insert_many(np.arange(650, 750))  # past 0.7 of 1024: a doubling begins
    assert table.migrating
    old = table._old
    assert old is not None
    in_old = np.intersect1d(old[old >= 0], np.arange(750))
    assert len(in_old) > 100
    gone = in_old[::2]
    table.delete_many(gone[:10])  # the scalar path
    table.delete_many(gone[10:])  # the batch path
    while table.step(8):
        pass
    want = np.where(np.isin(np.arange(750), gone), -1, np.arange(750))
    assert (table.find_many(0, h64[:750]) == want).all()
    assert all(table.find(0, h64[r].tobytes()) == -1 for r in gone[:30].tolist())
    assert table.count == 750 - len(gone) == int(np.count_nonzero(table.table >= 0))
    assert not np.isin(gone, table.table).any()
    assert int(np.count_nonzero(table.table == EMPTY)) > 0
