"""The radix index's compact block state: the hash table, block metadata, keys per node, bulk insert,
growth past `max_blocks`, stepwise reclamation and saturating hit counts."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvpool.errors import InvalidArgument, NotFound
from kvpool.index import RadixIndex
from kvpool.index import reclaim as reclaim_mod
from kvpool.index.columns import HIT_COUNT_MAX
from kvpool.index.hashtable import HashTable
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId

NS = NamespaceId(b"N" * 16)
NS2 = NamespaceId(b"M" * 16)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def make(max_blocks: int | None = 4096) -> RadixIndex:
    index = RadixIndex(clock=FakeClock(1_000), policy="lru", max_blocks=max_blocks)
    index.register_namespace(NS)
    index.register_namespace(NS2)
    return index


def chain(
    index: RadixIndex, ids: list[int], node: str = "s0", parent: int | None = None, ns: NamespaceId = NS
) -> None:
    index.insert(
        ns,
        [h(i) for i in ids],
        parent=None if parent is None else h(parent),
        locations=[[Location(node, i, 1)] for i in ids],
        size_bytes=8,
    )


# ---- the hash table --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "del"]), st.integers(0, 2), st.integers(0, 400), st.booleans()),
        min_size=1,
        max_size=300,
    )
)
def test_hash_table_agrees_with_a_dict(ops: list[tuple[str, int, int, bool]]) -> None:
    """Inserts and deletes (small-integer and random keys, three slots) through growth, tombstones and
    rebuilds: scalar and batch lookups agree with a dict after every operation."""
    rows = 2048
    h64 = np.zeros((rows, 2), np.uint64)
    ns = np.zeros(rows, np.int32)
    table = HashTable(h64, ns)
    ref: dict[tuple[int, bytes], int] = {}
    free = list(range(rows))[::-1]
    rng = np.random.default_rng(0)
    for op, slot, i, random_key in ops:
        key = rng.bytes(16) if random_key and op == "add" else h(i)
        if op == "add" and (slot, key) not in ref:
            row = free.pop()
            h64[row] = np.frombuffer(key, "<u8")
            ns[row] = slot
            table.insert_many(np.array([row]))
            ref[(slot, key)] = row
        elif op == "del" and (slot, key) in ref:
            row = ref.pop((slot, key))
            table.delete_many(np.array([row]))
            free.append(row)
        for (s, k), r in ref.items():
            assert table.find(s, k) == r
        probe = [(s, k) for (s, k) in ref] + [(slot, h(i + 1000)), (slot + 1, key)]
        keys = np.frombuffer(b"".join(k for _, k in probe), "<u8").reshape(-1, 2)
        want = [ref.get(p, -1) for p in probe]
        assert table.find_many(np.array([s for s, _ in probe]), keys).tolist() == want
        assert table.count == len(ref)


def test_hash_table_batches_of_many_keys_with_long_probes() -> None:
    """Thousands of small-integer keys (not random: they share their low bytes) in one batch, found
    in one batch, then half deleted in one batch."""
    n = 5000
    h64 = np.frombuffer(b"".join(h(i) for i in range(n)), "<u8").reshape(-1, 2).copy()
    ns = np.zeros(n, np.int32)
    table = HashTable(h64, ns)
    table.insert_many(np.arange(n))
    assert (table.find_many(0, h64) == np.arange(n)).all()
    table.delete_many(np.arange(0, n, 2))
    want = np.where(np.arange(n) % 2 == 0, -1, np.arange(n))
    assert (table.find_many(0, h64) == want).all()
    assert all(table.find(0, h(i)) == want[i] for i in range(0, n, 97))


# ---- block metadata --------------------------------------------------------------------------------


def test_block_meta_is_set_once_unless_forced() -> None:
    index = make()
    chain(index, [1, 2, 3])
    assert index.block_meta(NS, h(1)) is None  # never set
    index.set_block_meta(NS, [h(1), h(2)], [11, 2**64 - 1], 2)
    assert index.block_meta(NS, h(1)) == (11, 2)
    assert index.block_meta(NS, h(2)) == (2**64 - 1, 2)
    assert index.block_meta(NS, h(3)) is None
    index.set_block_meta(NS, [h(1), h(3)], [99, 33], 3)  # only_unset: h(1) keeps its metadata
    assert index.block_meta(NS, h(1)) == (11, 2)
    assert index.block_meta(NS, h(3)) == (33, 3)
    index.set_block_meta(NS, [h(1)], [99], 4, only_unset=False)
    assert index.block_meta(NS, h(1)) == (99, 4)
    assert index.block_meta(NS, h(7)) is None and index.block_meta(NS2, h(1)) is None
    index.check_invariants()


def test_block_meta_leaves_with_the_block() -> None:
    """A row freed and reused by another block does not carry the old block's metadata."""
    index = make()
    chain(index, [1])
    index.set_block_meta(NS, [h(1)], [5], 1)
    index.remove_location(NS, h(1), Location("s0", 1, 1))
    chain(index, [2])
    assert index.block_meta(NS, h(2)) is None and index.block_meta(NS, h(1)) is None


def test_set_block_meta_refuses_bad_input_before_changing_anything() -> None:
    index = make()
    chain(index, [1, 2])
    with pytest.raises(NotFound):
        index.set_block_meta(NS, [h(1), h(9)], [1, 2], 1)
    assert index.block_meta(NS, h(1)) is None
    for args in (
        ([h(1)], [1, 2], 1),  # lengths differ
        ([h(1)], [-1], 1),
        ([h(1)], [2**64], 1),
        ([h(1)], [1], 0),
        ([h(1)], [1], 256),
        ([b"short"], [1], 1),
    ):
        with pytest.raises(InvalidArgument):
            index.set_block_meta(NS, *args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        index.set_block_meta(NamespaceId(b"Z" * 16), [h(1)], [1], 1)


# ---- keys per node ---------------------------------------------------------------------------------


def test_keys_on_node_from_first_and_extra_replicas() -> None:
    index = make()
    chain(index, [1, 2, 3], node="a")
    chain(index, [4], node="b", ns=NS2)
    index.add_location(NS, h(2), Location("b", 20, 1))  # h(2) on a (first) and b (extra)
    assert sorted(index.keys_on_node("a")) == [(NS, h(1)), (NS, h(2)), (NS, h(3))]
    assert sorted(index.keys_on_node("b")) == sorted([(NS, h(2)), (NS2, h(4))])
    assert index.keys_on_node("a", multi_replica_only=True) == [(NS, h(2))]
    assert index.keys_on_node("b", multi_replica_only=True) == [(NS, h(2))]
    assert len(index.keys_on_node("a", limit=2)) == 2
    assert index.keys_on_node("a", limit=0) == [] and index.keys_on_node("nobody") == []
    index.remove_node("a")  # h(1) is orphaned: dropped with its descendants, h(2)'s copy on b too
    assert index.keys_on_node("b") == [(NS2, h(4))]
    assert index.keys_on_node("a") == []
    with pytest.raises(InvalidArgument):
        index.keys_on_node("b", limit=-1)


# ---- bulk insert -----------------------------------------------------------------------------------


def _batch(
    blocks: list[tuple[int, int | None]], slot0: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(block id, parent id or None) pairs -> insert_bulk's columns."""
    n = len(blocks)
    bh = np.frombuffer(b"".join(h(b) for b, _ in blocks), np.uint8).reshape(n, 16).copy()
    ph = np.frombuffer(b"".join(h(p or 0) for _, p in blocks), np.uint8).reshape(n, 16).copy()
    has = np.array([p is not None for _, p in blocks], dtype=np.bool_)
    slots = np.arange(slot0, slot0 + n, dtype=np.uint64)
    gens = np.full(n, 7, dtype=np.uint64)
    sums = np.array([1000 + b for b, _ in blocks], dtype=np.uint64)
    return bh, ph, has, slots, gens, sums


def bulk(index: RadixIndex, blocks: list[tuple[int, int | None]], node: str = "s0", slot0: int = 0):  # type: ignore[no-untyped-def]
    bh, ph, has, slots, gens, sums = _batch(blocks, slot0)
    return index.insert_bulk(NS, bh, ph, has, node, slots, gens, 8, sums, 2)


def test_insert_bulk_outcomes() -> None:
    index = make()
    chain(index, [1, 2])  # 1 -> 2 present on s0
    out = bulk(
        index,
        [
            (12, 11),  # parent 11 comes later in the batch: inserted
            (2, 1),  # present under the same parent: merged (s1 replica added)
            (11, 2),  # below a present block: inserted
            (1, 50),  # present under another parent: refused
            (30, 40),  # parent nowhere: waiting
            (31, 30),  # below a waiting block: waiting
            (60, 61),  # a cycle of the batch: waiting
            (61, 60),
            (11, 2),  # a repeat: refused
            (70, None),  # a new root
        ],
        node="s1",
    )
    assert out.inserted.tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 0, 1]
    assert out.merged.tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    assert out.waiting.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert out.refused.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 1, 0]
    index.check_invariants()
    info = index.lookup(NS, h(12))
    assert info is not None and info.parent == h(11) and info.locations == (Location("s1", 0, 7),)
    assert index.lookup(NS, h(2)).locations == (Location("s0", 2, 1), Location("s1", 1, 7))  # type: ignore[union-attr]
    assert index.lookup(NS, h(70)).parent is None  # type: ignore[union-attr]
    assert index.block_meta(NS, h(12)) == (1012, 2) and index.block_meta(NS, h(2)) == (1002, 2)
    assert index.num_blocks_on_node("s1") == 4 and index.bytes_on_node("s1") == 32
    assert (
        index.match_prefix(NS, [h(1), h(2), h(11), h(12)], count_hit=False, lease_ttl_ms=0).num_matched == 4
    )
    again = bulk(index, [(40, None), (30, 40), (31, 30)], node="s1", slot0=100)  # the waiting ones, later
    assert again.inserted.all()
    index.check_invariants()


def test_insert_bulk_same_replica_twice_is_merged_without_a_second_copy() -> None:
    index = make()
    first = bulk(index, [(1, None), (2, 1)])
    second = bulk(index, [(1, None), (2, 1)])
    assert first.inserted.all() and second.merged.all()
    assert index.lookup(NS, h(2)).locations == (Location("s0", 1, 7),)  # type: ignore[union-attr]
    assert index.num_blocks_on_node("s0") == 2
    index.check_invariants()


@settings(max_examples=40, deadline=None)
@given(
    parents=st.lists(st.integers(-1, 60), min_size=1, max_size=60),
    order_seed=st.integers(0, 2**32 - 1),
    split=st.integers(0, 60),
    max_blocks=st.sampled_from([8, 4096]),
)
def test_insert_bulk_builds_the_same_tree_as_inserts(
    parents: list[int], order_seed: int, split: int, max_blocks: int
) -> None:
    """A random forest (block i's parent is an earlier block, or none), sent shuffled in two batches
    (the second repeats the first's waiting blocks): the same blocks, parents and replicas as inserting
    each chain in order, the invariants hold, and every block's chain matches whole."""
    par = [p if 0 <= p < i else None for i, p in enumerate(parents)]
    blocks = [(i + 1, None if p is None else p + 1) for i, p in enumerate(par)]
    perm = np.random.default_rng(order_seed).permutation(len(blocks))
    shuffled = [blocks[i] for i in perm]
    index = make(max_blocks)
    out = bulk(index, shuffled[:split])
    index.check_invariants()
    assert not out.refused.any() and not out.merged.any()
    rest = [b for b, w in zip(shuffled[:split], out.waiting, strict=True) if w] + shuffled[split:]
    out2 = bulk(index, rest, slot0=1000)
    assert out2.inserted.all()
    index.check_invariants()
    ref = make()
    for b, p in blocks:
        index_slot = next(s for s, x in enumerate(shuffled) if x[0] == b)
        del index_slot
        ref.insert(
            NS, [h(b)], parent=None if p is None else h(p), locations=[[Location("s0", 0, 7)]], size_bytes=8
        )
    assert index.num_blocks == ref.num_blocks == len(blocks)
    for b, p in blocks:
        info = index.lookup(NS, h(b))
        assert info is not None and info.parent == (None if p is None else h(p))
        path = [b]
        while par[path[-1] - 1] is not None:
            path.append(par[path[-1] - 1] + 1)  # type: ignore[operator]
        got = index.match_prefix(NS, [h(x) for x in reversed(path)], count_hit=True, lease_ttl_ms=0)
        assert got.num_matched == len(path)
    index.check_invariants()


def test_insert_bulk_keeps_chains_in_runs() -> None:
    """A batch of whole chains, shuffled, lands as one run of rows per chain (the match path's fast
    case): each chain's last row heads back to its first."""
    index = make()
    blocks = [(c * 100 + j, None if j == 1 else c * 100 + j - 1) for c in range(1, 6) for j in range(1, 21)]
    perm = np.random.default_rng(3).permutation(len(blocks))
    bulk(index, [blocks[i] for i in perm])
    index.check_invariants()
    c = index._c
    for ch in range(1, 6):
        first, last = index._table.find(0, h(ch * 100 + 1)), index._table.find(0, h(ch * 100 + 20))
        assert last - first == 19 and c.run_head[last] == first


def test_insert_bulk_refuses_bad_input() -> None:
    index = make()
    bh, ph, has, slots, gens, sums = _batch([(1, None), (2, 1)])
    good = dict(
        block_hashes=bh,
        parent_hashes=ph,
        has_parent=has,
        node_id="s0",
        slots=slots,
        generations=gens,
        size_bytes=8,
        checksums=sums,
        target_replicas=1,
    )
    bad: list[dict[str, object]] = [
        {"block_hashes": bh[:, :8].copy()},
        {"block_hashes": bh.astype(np.int16)},
        {"parent_hashes": ph[:1]},
        {"has_parent": has.astype(np.uint8)},
        {"slots": np.array([0, 2**32], dtype=np.uint64)},
        {"slots": np.array([-1, 0], dtype=np.int64)},
        {"generations": slots[:1]},
        {"checksums": np.array([0.5, 1.0])},
        {"size_bytes": 0},
        {"size_bytes": 2**32},
        {"target_replicas": 0},
        {"node_id": ""},
    ]
    for change in bad:
        with pytest.raises(InvalidArgument):
            index.insert_bulk(NS, **{**good, **change})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        index.insert_bulk(NamespaceId(b"Z" * 16), **good)  # type: ignore[arg-type]
    assert index.num_blocks == 0
    index.check_invariants()


# ---- growth, reclamation, counters -----------------------------------------------------------------


def test_rows_past_max_blocks_still_fit() -> None:
    index = make(max_blocks=4)
    for c in range(10):
        chain(index, [c * 10 + j for j in range(1, 8)])
    index.check_invariants()
    assert index.num_blocks == 70
    assert (
        index.match_prefix(NS, [h(91 + j) for j in range(7)], count_hit=False, lease_ttl_ms=0).num_matched
        == 7
    )


def test_reclaim_scans_a_namespace_in_bounded_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two namespaces' rows interleaved; the invalidated one is found window by window (8 rows, 2
    windows a call) and reclaimed whole, leaves first, the other left as it was."""
    monkeypatch.setattr(reclaim_mod, "_SCAN_ROWS", 8)
    monkeypatch.setattr(reclaim_mod, "_SCAN_STEPS", 2)
    index = make()
    for c in range(6):
        chain(index, [c * 10 + j for j in range(1, 6)], ns=NS)
        chain(index, [500 + c * 10 + j for j in range(1, 4)], ns=NS2)
    index.invalidate_namespace(NS)
    assert index.num_invalidated_blocks == 30
    dropped = []
    for _ in range(100):
        got = index.reclaim_invalidated(4)
        assert len(got) <= 4
        dropped += got
        index.check_invariants()
        if index.num_invalidated_blocks == 0:
            break
    assert len(dropped) == 30 and {d.reason for d in dropped} == {"invalidate"}
    assert index.num_blocks == 18 and index.num_blocks_in(NS2) == 18
    assert index.num_free_namespace_slots == 1


def test_hit_count_saturates() -> None:
    index = make()
    chain(index, [1, 2])
    rows = [index._table.find(0, h(1)), index._table.find(0, h(2))]
    index._c.hit_count[rows] = HIT_COUNT_MAX - 1
    for _ in range(3):
        index.match_prefix(NS, [h(1), h(2)], count_hit=True, lease_ttl_ms=0)
        index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=0)
    assert index.lookup(NS, h(1)).hit_count == HIT_COUNT_MAX  # type: ignore[union-attr]
    assert index.lookup(NS, h(2)).hit_count == HIT_COUNT_MAX  # type: ignore[union-attr]


def test_narrow_columns_refuse_what_they_cannot_hold() -> None:
    index = make()
    with pytest.raises(InvalidArgument):
        index.insert(NS, [h(1)], parent=None, locations=[[Location("s0", 2**32, 1)]], size_bytes=8)
    with pytest.raises(InvalidArgument):
        index.insert(NS, [h(1)], parent=None, locations=[[Location("s0", 1, 1)]], size_bytes=2**32)
    chain(index, [1])
    big_gen = Location("s0", 2**32 - 1, 2**62)
    index.add_location(NS, h(1), big_gen)
    assert big_gen in index.lookup(NS, h(1)).locations  # type: ignore[union-attr]


def test_hash_table_single_deletes_keep_later_probes_reachable() -> None:
    """A table near its maximum load (long probe runs), emptied one key at a time (the scalar path):
    every key still in it is found after each delete, by both lookups."""
    n = 700  # of 1024 positions
    rng = np.random.default_rng(5)
    h64 = rng.integers(0, 2**63, (n, 2), dtype=np.int64).astype(np.uint64)
    ns = np.zeros(n, np.int32)
    table = HashTable(h64, ns)
    table.insert_many(np.arange(n))
    assert table.capacity == 1024
    left = set(range(n))
    for row in rng.permutation(n)[: n - 50].tolist():
        table.delete_many(np.array([row]))
        left.discard(row)
        assert all(table.find(0, h64[r].tobytes()) == r for r in left)
    assert (table.find_many(0, h64) == np.where(np.isin(np.arange(n), list(left)), np.arange(n), -1)).all()
