"""A dead node's replicas leave the index in bounded steps (`kvpool.index.node_removal`).

Between steps the index is consistent, no match or lookup offers a replica on the dying node (nor a block
below one it will drop), inserts below a doomed block are refused or dropped with it, and the end state is
the one the per-row reference loop leaves.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import example, given, settings

from kvpool.errors import FailedPrecondition, NotFound
from kvpool.index import RadixIndex
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId
from tests.test_index_scale_ops import _OP, NODES, Driver, clone, drops, fingerprint, remove_node_reference

NS = NamespaceId(b"N" * 16)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def chain_of(index: RadixIndex, row: int) -> tuple[NamespaceId, list[BlockHash]]:
    """The namespace and hashes from the root down to `row`."""
    c, rows = index._c, []
    while row != -1:
        rows.append(row)
        row = int(c.parent[row])
    return index._ns_ids[int(c.ns_slot[rows[0]])], [c.hash_of(r) for r in reversed(rows)]


def assert_nothing_offered_on(index: RadixIndex, node: str, doomed_hashes: set[bytes]) -> None:
    """No match of any resident chain offers a replica on `node` or a block the removal drops."""
    c = index._c
    for row in c.alive_rows().tolist():
        ns, chain = chain_of(index, row)
        if ns not in index._ns_active:
            continue
        m = index.match_prefix(ns, chain, count_hit=False, lease_ttl_ms=0)
        assert len(m.locations) == m.num_matched
        for i, locs in enumerate(m.locations):
            assert locs and all(x.node_id != node for x in locs), (i, locs)
            assert bytes(chain[i]) not in doomed_hashes
        info = index.lookup(ns, chain[-1])
        assert info is None or all(x.node_id != node for x in info.locations)


def run_in_steps(index: RadixIndex, node: str, max_rows: int, doomed: set[bytes]) -> list[Any]:
    removal = index.begin_remove_node(node)
    out: list[Any] = []
    if removal is None:
        return out
    index.check_invariants()
    assert_nothing_offered_on(index, node, doomed)
    while index.node_removals:
        rows, _ = index.remove_node_step(max_rows)
        index.check_invariants()
        assert_nothing_offered_on(index, node, doomed)
        if rows is not None:
            out.extend(rows.blocks())
    return out


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_OP, max_size=40), node=st.sampled_from(NODES), max_rows=st.integers(1, 4))
@example(ops=[("insert", 0, 0, [[("s0", False)], [("s0", False), ("s1", False)]])], node="s0", max_rows=1)
def test_removal_in_small_steps_drops_exactly_the_orphans_and_hides_them_between_steps(
    ops: list[tuple[Any, ...]], node: str, max_rows: int
) -> None:
    d = Driver()
    for op in ops:
        d.apply(op)
    ref = clone(d.index)
    want = remove_node_reference(ref, node)
    doomed = {bytes(x.block_hash) for x in want}
    got = run_in_steps(d.index, node, max_rows, doomed)
    got = [
        type(x)(x.ns, x.block_hash, tuple(y for y in x.locations if y.node_id != node), x.reason) for x in got
    ]
    assert drops(got) == drops(want)
    assert fingerprint(d.index, free_order=False) == fingerprint(ref, free_order=False)
    d.index.check_invariants()


def _tree(ix: RadixIndex) -> None:
    """r0 (s1) -> a (s0) -> b (s1) -> c (s1), and r0 -> x (s1): a's subtree is orphaned when s0 dies."""
    ix.insert(NS, [h(1)], parent=None, locations=[[Location("s1", 1, 0)]], size_bytes=8)
    ix.insert(
        NS,
        [h(2), h(3), h(4)],
        parent=h(1),
        locations=[[Location("s0", 2, 0)], [Location("s1", 3, 0)], [Location("s1", 4, 0)]],
        size_bytes=8,
    )
    ix.insert(NS, [h(5)], parent=h(1), locations=[[Location("s1", 5, 0)]], size_bytes=8)


def test_a_child_committed_below_a_doomed_block_during_the_steps_does_not_survive_orphaned() -> None:
    ix = RadixIndex(clock=FakeClock())
    ix.register_namespace(NS)
    _tree(ix)
    ix.begin_remove_node("s0")
    with pytest.raises(NotFound):  # below the block whose only replica was on s0
        ix.insert(NS, [h(10)], parent=h(2), locations=[[Location("s1", 10, 0)]], size_bytes=8)
    with pytest.raises(FailedPrecondition):  # a new replica on the dying node
        ix.insert(NS, [h(11)], parent=h(5), locations=[[Location("s0", 11, 0)]], size_bytes=8)
    accepted, n = [], 100
    while ix.node_removals:
        n += 1
        try:  # below the deepest block of the doomed subtree, at every step
            ix.insert(NS, [h(n)], parent=h(4), locations=[[Location("s1", n, 0)]], size_bytes=8)
            accepted.append(h(n))
        except NotFound:
            pass
        ix.remove_node_step(1)
        ix.check_invariants()
    assert accepted, "the first steps (the scan) come before the subtree is marked: a child joins it"
    for x in [h(2), h(3), h(4), *accepted]:
        assert ix.lookup(NS, x) is None
    assert ix.lookup(NS, h(1)) is not None and ix.lookup(NS, h(5)) is not None
    assert ix.num_blocks == 2
    ix.check_invariants()


def test_a_block_with_a_replica_elsewhere_keeps_it_and_is_reported_as_a_survivor() -> None:
    ix = RadixIndex(clock=FakeClock())
    ix.register_namespace(NS)
    a0, a1 = Location("s0", 1, 0), Location("s1", 2, 0)
    ix.insert(NS, [h(1)], parent=None, locations=[[a0, a1]], size_bytes=8)
    ix.begin_remove_node("s0")
    m = ix.match_prefix(NS, [h(1)], count_hit=False, lease_ttl_ms=0)
    assert m.num_matched == 1 and m.locations == [(a1,)]  # hidden before any step ran
    survivors = []
    while ix.node_removals:
        _, s = ix.remove_node_step()
        if s is not None:
            survivors.extend(s.keys())
    assert survivors == [(bytes(NS), bytes(h(1)))]
    assert ix.lookup(NS, h(1)).locations == (a1,)
    ix.check_invariants()


def test_a_wide_and_deep_subtree_leaves_in_steps_no_larger_than_asked() -> None:
    """A removal's steps stay bounded: 2,000 orphans in chains below one root, 64 rows per step."""
    ix = RadixIndex(clock=FakeClock())
    ix.register_namespace(NS)
    ix.insert(NS, [h(1)], parent=None, locations=[[Location("s0", 1, 0)]], size_bytes=8)
    k = 2
    for _ in range(100):
        chain = [h(k + j) for j in range(20)]
        ix.insert(
            NS, chain, parent=h(1), locations=[[Location("s1", k + j, 0)] for j in range(20)], size_bytes=8
        )
        k += 20
    ix.begin_remove_node("s0")
    sizes = []
    while ix.node_removals:
        rows, _ = ix.remove_node_step(64)
        if rows is not None:
            sizes.append(len(rows))
    assert sum(sizes) == 2001 and max(sizes) <= 100  # (a step never splits one parent's children: 100 here)
    assert ix.num_blocks == 0
    ix.check_invariants()


def test_dropped_rows_carry_the_slots_to_free_by_store() -> None:
    ix = RadixIndex(clock=FakeClock())
    ix.register_namespace(NS)
    _tree(ix)
    ix.begin_remove_node("s0")
    frees: dict[str, list[int]] = {}
    while ix.node_removals:
        rows, _ = ix.remove_node_step()
        if rows is not None:
            for node, slots, gens in rows.store_frees():
                frees.setdefault(node, []).extend(slots.tolist())
                assert gens.dtype == np.uint64
    assert {n: sorted(s) for n, s in frees.items()} == {"s0": [2], "s1": [3, 4]}


def test_an_adoption_below_a_doomed_block_waits_until_the_removal_ends() -> None:
    """A store's inventory adopted in bulk while a removal runs is refused whole (the adoption keeps it
    for its next claim): a child could otherwise land below a block dropped after its closure was taken."""
    from tests.test_index_compact import NS as CNS
    from tests.test_index_compact import bulk

    ix = RadixIndex(clock=FakeClock())
    ix.register_namespace(CNS)
    bulk(ix, [(1, None), (2, 1)], node="s0")
    ix.begin_remove_node("s0")
    with pytest.raises(FailedPrecondition):
        bulk(ix, [(3, 2)], node="s1", slot0=10)
    while ix.node_removals:
        ix.remove_node_step(1)
        ix.check_invariants()
    assert ix.num_blocks == 0
    res = bulk(ix, [(3, 2)], node="s1", slot0=10)  # its parent is gone now: it waits
    assert res.waiting.tolist() == [True]
    ix.check_invariants()
