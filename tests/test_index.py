"""RadixIndex unit tests: eviction order per policy, leases, locks, field cases B11/B13/B17/B28, bad input."""

from __future__ import annotations

import pytest

from kvpool.errors import FailedPrecondition, InvalidArgument, LeaseExpired, NotFound
from kvpool.index import DEFAULT_POLICY, POLICY_NAMES, BeladyPolicy, RadixIndex, make_policy
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId

NS = NamespaceId(b"N" * 16)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def loc(slot: int, node: str = "s0") -> Location:
    return Location(node, slot, 1)


def make(policy: object = "lru") -> tuple[RadixIndex, FakeClock]:
    clock = FakeClock(1_000)
    index = RadixIndex(clock=clock, policy=policy)  # type: ignore[arg-type]
    index.register_namespace(NS)
    return index, clock


def put(index: RadixIndex, ids: list[int], parent: int | None = None, **kw: object) -> None:
    index.insert(
        NS,
        [h(i) for i in ids],
        parent=None if parent is None else h(parent),
        locations=[[loc(i)] for i in ids],
        size_bytes=kw.pop("size_bytes", 100),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    index.check_invariants()


def evicted(index: RadixIndex, n: int) -> list[int]:
    res = index.evict(n)
    index.check_invariants()
    return [int.from_bytes(d.block_hash, "big") for d in res.dropped]


def hit(index: RadixIndex, ids: list[int]) -> None:
    index.match_prefix(NS, [h(i) for i in ids], count_hit=True, lease_ttl_ms=0)


# ---- policies: exact eviction order -------------------------------------------------------------
def test_lru_order_and_leaf_only() -> None:
    index, clock = make("lru")
    put(index, [1, 2, 3])  # chain 1 -> 2 -> 3
    clock.advance(1)
    put(index, [4], parent=1)  # fork under 1
    clock.advance(1)
    put(index, [5])
    clock.advance(1)
    hit(index, [1, 2, 3])
    # leaves: 3 (t=1003), 4 (t=1001), 5 (t=1002); interior 2, 1 become leaves only after their children go
    assert evicted(index, 2) == [4, 5]
    assert evicted(index, 3) == [3, 2, 1]
    assert index.num_blocks == 0


def test_lfu_order() -> None:
    index, clock = make("lfu")
    for i in (1, 2, 3):
        put(index, [i])
    for _ in range(3):
        hit(index, [1])
    hit(index, [3])
    assert evicted(index, 3) == [2, 3, 1]


def test_fwlru_trades_recency_for_frequency() -> None:
    index, clock = make("fwlru")
    put(index, [1])
    put(index, [2])
    for _ in range(8):
        hit(index, [1])  # hot at t=1000
    clock.advance(10_000)
    hit(index, [2])  # touched once, 10 s later
    assert evicted(index, 1) == [2]  # 8 hits buy more than 10 s of recency (30 s per doubling)
    index2, clock2 = make("fwlru")
    put(index2, [1])
    put(index2, [2])
    hit(index2, [1])
    clock2.advance(600_000 * 20)  # hits decay (half-life 10 min) and 3.3 h of recency dominate
    hit(index2, [2])
    assert evicted(index2, 1) == [1]


def test_cost_gdsf_prefers_keeping_expensive_per_byte() -> None:
    index, _ = make("cost")
    put(index, [1], recompute_cost_s=1.0, size_bytes=100)
    put(index, [2], recompute_cost_s=1.0, size_bytes=10)
    put(index, [3], recompute_cost_s=0.1, size_bytes=100)
    assert evicted(index, 1) == [3]
    put(index, [4], recompute_cost_s=0.1, size_bytes=100)  # inflation L=0.002 lifts newcomers
    assert evicted(index, 3) == [4, 1, 2]


def test_opt_evicts_farthest_next_use() -> None:
    policy = BeladyPolicy()
    index, _ = make(policy)
    for i, nxt in ((1, 5.0), (2, 50.0), (3, 7.0)):
        policy.set_next_use(h(i), nxt)
        put(index, [i])
    put(index, [4])  # never used again
    assert evicted(index, 4) == [4, 2, 3, 1]


def test_make_policy_names() -> None:
    assert {make_policy(n).name for n in POLICY_NAMES} == set(POLICY_NAMES)
    assert make_policy("default").name == DEFAULT_POLICY == "tail"
    with pytest.raises(InvalidArgument, match="unknown eviction policy"):
        make_policy("mru")


# ---- counting and leases -------------------------------------------------------------------------
def test_peek_decode_prefill_counting() -> None:
    index, clock = make()
    put(index, [1, 2])
    clock.advance(10)
    res = index.match_prefix(NS, [h(1), h(2), h(9)], count_hit=False, lease_ttl_ms=0)
    assert (res.num_matched, res.lease_id) == (2, None)
    info = index.lookup(NS, h(2))
    assert info is not None and (info.hit_count, info.last_access_ms) == (0, 1_000)
    res = index.match_prefix(NS, [h(1), h(2)], count_hit=False, lease_ttl_ms=100)
    info = index.lookup(NS, h(2))
    assert info is not None and (info.hit_count, info.last_access_ms, info.num_leases) == (0, 1_010, 1)
    assert res.lease_expiry_ms == 1_110
    index.match_prefix(NS, [h(1), h(2)], count_hit=True, lease_ttl_ms=0)
    info = index.lookup(NS, h(1))
    assert info is not None and info.hit_count == 1
    assert (index.num_lookup_blocks, index.num_hit_blocks) == (2, 2)


def test_leased_leaf_protects_its_path_until_expiry_b17() -> None:
    index, clock = make()
    put(index, [1, 2])
    res = index.match_prefix(NS, [h(1), h(2)], count_hit=True, lease_ttl_ms=100)
    clock.advance(50)
    assert index.evict(5).shortfall == 5  # leased: neither the leaf nor its ancestor goes
    assert index.renew_lease(res.lease_id or 0, 100) == 1_150
    clock.advance(99)
    assert index.evict(5).dropped == []
    clock.advance(1)  # t = 1150: the renewed lease is over
    assert evicted(index, 5) == [2, 1]
    with pytest.raises(LeaseExpired):
        index.renew_lease(res.lease_id or 0, 100)
    index.release_lease(res.lease_id or 0)  # an expired lease: no-op
    with pytest.raises(NotFound):
        index.release_lease(12345)
    assert index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=0).num_matched == 0


def test_b13_unreleased_leases_expire_and_pool_still_evicts() -> None:
    index, clock = make()
    put(index, [1, 2])
    for _ in range(1_000):
        index.match_prefix(NS, [h(1), h(2)], count_hit=True, lease_ttl_ms=100)
    assert index.num_live_leases == 1_000
    info = index.lookup(NS, h(2))
    assert info is not None and info.num_leases == 1_000
    clock.advance(100)
    assert index.num_live_leases == 0
    assert index.num_leases_expired == 1_000
    assert evicted(index, 2) == [2, 1]


def test_release_returns_pin_count_to_zero() -> None:
    index, _ = make()
    put(index, [1, 2])
    res = index.match_prefix(NS, [h(1), h(2)], count_hit=True, lease_ttl_ms=1_000)
    index.release_lease(res.lease_id or 0)
    index.check_invariants()
    info = index.lookup(NS, h(1))
    assert info is not None and info.num_leases == 0
    with pytest.raises(NotFound):
        index.release_lease(res.lease_id or 0)
    assert evicted(index, 2) == [2, 1]


# ---- B11: locks ----------------------------------------------------------------------------------
def test_b11_lock_protects_matched_node_itself() -> None:
    index, _ = make()
    put(index, [1, 2])  # root -> A -> B
    index.lock(NS, [h(1), h(2)])
    assert index.lookup(NS, h(2)).lock_ref == 1  # type: ignore[union-attr]
    res = index.evict(2)
    assert res.dropped == [] and res.shortfall == 2
    assert index.num_protected_blocks + index.num_unprotected_blocks == index.num_blocks == 2
    index.unlock(NS, [h(1), h(2)])
    with pytest.raises(FailedPrecondition):
        index.unlock(NS, [h(2)])
    assert index.lookup(NS, h(2)).lock_ref == 0  # type: ignore[union-attr]
    assert index.num_protected_blocks == 0 and index.num_unprotected_blocks == 2
    index.check_invariants()


def test_lock_of_a_deep_block_pins_its_ancestors() -> None:
    index, _ = make()
    put(index, [1, 2, 3])
    put(index, [4], parent=2)
    index.lock(NS, [h(3)])
    assert evicted(index, 4) == [4]
    assert index.lookup(NS, h(1)).lock_ref == 1  # type: ignore[union-attr]
    index.unlock(NS, [h(3)])
    assert evicted(index, 4) == [3, 2, 1]


# ---- replicas, nodes -----------------------------------------------------------------------------
def test_remove_location_orphans_descendants() -> None:
    index, _ = make()
    put(index, [1, 2, 3])
    index.add_location(NS, h(2), loc(20, "s1"))
    assert index.remove_location(NS, h(2), loc(2)) == []
    dropped = index.remove_location(NS, h(2), loc(20, "s1"))
    assert [(int.from_bytes(d.block_hash, "big"), d.reason) for d in dropped] == [
        (3, "orphan"),
        (2, "orphan"),
    ]
    assert dropped[0].locations == (loc(3),)
    assert index.num_blocks == 1 and index.num_blocks_on_node("s0") == 1
    index.check_invariants()


def test_evict_per_node_prefers_spare_replicas() -> None:
    index, _ = make()
    put(index, [1, 2])
    put(index, [3])
    index.add_location(NS, h(1), loc(10, "s1"))  # interior block 1 has a replica elsewhere
    res = index.evict(2, node_id="s0")
    index.check_invariants()
    assert [(int.from_bytes(d.block_hash, "big"), d.reason) for d in res.dropped] == [
        (1, "replica"),
        (2, "evict"),
    ]
    assert (res.num_freed_on_node, res.shortfall) == (2, 0)
    assert index.lookup(NS, h(1)).locations == (loc(10, "s1"),)  # type: ignore[union-attr]
    assert index.num_blocks_on_node("s0") == 1 and index.bytes_on_node("s0") == 100


def test_remove_node() -> None:
    index, _ = make()
    put(index, [1, 2])
    index.insert(NS, [h(3)], parent=h(2), locations=[[loc(3, "s1")]], size_bytes=100)
    index.add_location(NS, h(1), loc(11, "s1"))
    dropped = index.remove_node("s0")
    assert [(int.from_bytes(d.block_hash, "big"), d.locations) for d in dropped] == [
        (3, (loc(3, "s1"),)),
        (2, ()),
    ]
    assert index.num_blocks == 1 and index.num_blocks_on_node("s0") == 0
    index.check_invariants()


# ---- B28: namespace invalidation ------------------------------------------------------------------
def test_b28_invalidate_misses_at_once_and_reclaims_later() -> None:
    index, clock = make()
    put(index, [1, 2, 3])
    lease = index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=100).lease_id
    index.invalidate_namespace(NS)
    assert index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=0).num_matched == 0
    assert index.lookup(NS, h(1)) is None
    with pytest.raises(InvalidArgument, match="not registered"):
        put(index, [7])
    index.register_namespace(NS)  # v2 under the same id starts empty
    assert index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=0).num_matched == 0
    assert index.evict(10).dropped == []  # invalidated blocks are reclamation's business
    dropped = index.reclaim_invalidated(1)
    assert [d.reason for d in dropped] == ["invalidate"] and index.num_blocks == 2
    assert len(index.reclaim_invalidated(10)) == 1  # block 1 is leased: it waits
    assert index.num_invalidated_blocks == 1 and lease is not None
    clock.advance(100)
    assert len(index.reclaim_invalidated(10)) == 1
    assert index.num_blocks == 0 and index.num_invalidated_blocks == 0
    index.check_invariants()


# ---- bad input: clear errors, nothing half-applied -----------------------------------------------
def test_bad_input() -> None:
    index, _ = make()
    put(index, [1])
    with pytest.raises(InvalidArgument, match=r"block_hashes\[1\] must be 16 bytes"):
        index.insert(
            NS, [h(2), BlockHash(b"short")], parent=h(1), locations=[[loc(2)], [loc(3)]], size_bytes=1
        )
    with pytest.raises(InvalidArgument, match="not registered"):
        index.insert(NamespaceId(b"X" * 16), [h(2)], parent=None, locations=[[loc(2)]], size_bytes=1)
    with pytest.raises(NotFound, match="parent"):
        index.insert(NS, [h(2)], parent=h(99), locations=[[loc(2)]], size_bytes=1)
    with pytest.raises(InvalidArgument, match="size_bytes"):
        index.insert(NS, [h(2)], parent=h(1), locations=[[loc(2)]], size_bytes=-5)
    with pytest.raises(InvalidArgument, match=r"locations\[0\] is empty"):
        index.insert(NS, [h(2)], parent=h(1), locations=[[]], size_bytes=1)
    with pytest.raises(InvalidArgument, match="another parent"):
        index.insert(NS, [h(2), h(1)], parent=None, locations=[[loc(2)], [loc(1)]], size_bytes=1)
    with pytest.raises(InvalidArgument, match="lease_ttl_ms"):
        index.match_prefix(NS, [h(1)], count_hit=True, lease_ttl_ms=-1)
    with pytest.raises(InvalidArgument, match="num_blocks"):
        index.evict(-1)
    with pytest.raises(InvalidArgument, match="ttl_ms"):
        index.renew_lease(1, 0)
    assert index.num_blocks == 1 and index.num_blocks_on_node("s0") == 1
    index.check_invariants()
    assert (
        index.match_prefix(NamespaceId(b"Z" * 16), [h(1)], count_hit=True, lease_ttl_ms=10).num_matched == 0
    )


def test_insert_is_idempotent_and_adds_replicas() -> None:
    index, _ = make()
    put(index, [1, 2])
    res = index.insert(
        NS, [h(1), h(2), h(3)], parent=None, locations=[[loc(1)], [loc(22, "s1")], [loc(3)]], size_bytes=100
    )
    assert (res.num_existing, res.num_inserted) == (2, 1)
    assert index.lookup(NS, h(2)).locations == (loc(2), loc(22, "s1"))  # type: ignore[union-attr]
    assert index.num_blocks_on_node("s0") == 3 and index.num_blocks_on_node("s1") == 1
    index.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICY_NAMES))
def test_heap_compaction_keeps_eviction_order(policy: str) -> None:
    """Many re-pushes trigger the heap's compaction; eviction afterwards still works (was an IndexError)."""
    index, clock = make(policy)
    if isinstance(index.policy, BeladyPolicy):
        for i in range(1, 6):
            index.policy.set_next_use(h(i), 100 - i)
    put(index, [1])
    for i in range(2, 6):
        put(index, [i], parent=1)
    for _ in range(3000):  # each unlock re-enters the leaf into the heap
        index.lock(NS, [h(5)])
        index.unlock(NS, [h(5)])
    index._rebuild_heap()
    index.check_invariants()
    assert sorted(evicted(index, 5)) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("pieces", [1, 3, 40])
def test_match_over_runs_and_fragmented_rows(pieces: int) -> None:
    """Chains whose rows are one run, a few runs, or one row per run (past the walk's limit) match the
    same: count, locations, hits, recency, and a lease over exactly the matched blocks."""
    index, clock = make("lru")
    ids_a, ids_b = list(range(1, 41)), list(range(101, 141))
    step = 40 // pieces
    for lo in range(0, 40, step):  # interleave the two chains' pieces so their rows alternate
        for ids in (ids_a, ids_b):
            put(index, ids[lo : lo + step], parent=ids[lo - 1] if lo else None)
    clock.advance(5)
    query = [h(i) for i in ids_a[:30]] + [h(999)]
    res = index.match_prefix(NS, query, count_hit=True, lease_ttl_ms=100)
    assert res.num_matched == 30 and res.lease_id is not None
    assert res.locations == [(loc(i),) for i in ids_a[:30]]
    index.check_invariants()
    for i in (1, 30):
        info = index.lookup(NS, h(i))
        assert info is not None and (info.hit_count, info.last_access_ms, info.num_leases) == (1, 1_005, 1)
    info = index.lookup(NS, h(31))
    assert info is not None and (info.hit_count, info.num_leases) == (0, 0)
    assert index.match_prefix(NS, [h(i) for i in ids_b], count_hit=False, lease_ttl_ms=0).num_matched == 40
    assert index.match_prefix(NS, [h(1), h(102)], count_hit=False, lease_ttl_ms=0).num_matched == 1
    assert index.match_prefix(NS, [h(2), h(3)], count_hit=False, lease_ttl_ms=0).num_matched == 0
    index.release_lease(res.lease_id)
    index.check_invariants()


def test_peek_changes_nothing_and_extra_replicas_come_back() -> None:
    index, clock = make("fwlru")
    put(index, [1, 2, 3])
    index.add_location(NS, h(2), loc(77, "s1"))
    clock.advance(10)
    before = [index.lookup(NS, h(i)) for i in (1, 2, 3)]
    res = index.match_prefix(NS, (h(1), h(2), h(3)), count_hit=False, lease_ttl_ms=0)
    assert res.num_matched == 3 and res.locations[1] == (loc(2), loc(77, "s1"))
    assert [index.lookup(NS, h(i)) for i in (1, 2, 3)] == before
