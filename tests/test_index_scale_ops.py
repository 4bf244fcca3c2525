"""The index's vectorised / incremental forms against simple references (issue #37, item 3).

`remove_node` and the watermark's spare-replica drops must leave exactly the index the old per-row
loops left (kept here verbatim as references), and the protected-block counter must equal a full scan
of the columns after any sequence of operations.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import hypothesis.strategies as st
import numpy as np
from hypothesis import example, given, settings

from kvpool.errors import FailedPrecondition, NotFound
from kvpool.index import RadixIndex
from kvpool.index import eviction as ev
from kvpool.index.columns import _COLUMNS, _RAW, NO_SEQ, seq_tag
from kvpool.index.results import DroppedBlock
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId

NODES = ("s0", "s1", "s2", "s3")
NAMESPACES = (NamespaceId(b"A" * 16), NamespaceId(b"B" * 16))
GROUPS = ("tenant-a", None)  # (a tenant's quota group, and a namespace without one)

# ---- references: the per-row loops the vectorised forms replaced ------------------------------------


def remove_node_reference(index: RadixIndex, node_id: str) -> list[DroppedBlock]:
    c, orphans = index._c, []
    for row in sorted(index._space.rows_on(node_id)):
        for loc in c.locations[row]:
            if loc.node_id == node_id:
                index._remove_location_row(row, loc)
        if not c.locations[row]:
            orphans.append(row)
    index._space.forget(node_id)
    dropped: list[DroppedBlock] = []
    for row in orphans:
        if c.alive[row]:
            dropped.extend(index._drop_subtree(row, "orphan"))
    return dropped


def drop_spare_replicas_reference(index: RadixIndex, budget: int, node_id: str) -> list[DroppedBlock]:
    c = index._c
    candidates = [
        row
        for row in index._space.rows_on(node_id)
        if c.lock_ref[row] == 0
        and c.num_leases[row] == 0
        and index._ns_valid[c.ns_slot[row]]
        and any(loc.node_id != node_id and not loc.local for loc in c.locations[row])
    ]
    if not candidates:
        return []
    rows = np.array(candidates, dtype=np.int64)
    order = rows[np.lexsort((rows, c.last_access_ms[rows]))]
    dropped: list[DroppedBlock] = []
    for row in order.tolist():
        if len(dropped) >= budget:
            break
        block_hash = c.hash_of(row)
        for loc in c.locations[row]:
            if loc.node_id == node_id and len(dropped) < budget:
                index._remove_location_row(row, loc)
                ns = index._ns_ids[int(c.ns_slot[row])]
                dropped.append(DroppedBlock(ns, block_hash, (loc,), "replica"))
    return dropped


def clone(index: RadixIndex) -> RadixIndex:
    """A deep copy whose columns are views of its own records again (deepcopy detaches views)."""
    out = copy.deepcopy(index)
    c = out._c
    c._raw = c.records.view(_RAW)
    for name in _COLUMNS:
        setattr(c, name, c.records[name])
    out._table.bind(c.h64, c.ns_slot)
    return out


def ns_maps(index: RadixIndex) -> list[dict[BlockHash, int]]:
    """Per namespace slot, each resident block's hash and the row the hash table finds for it."""
    c = index._c
    maps: list[dict[BlockHash, int]] = [{} for _ in index._ns_ids]
    for row in c.alive_rows().tolist():
        slot, h = int(c.ns_slot[row]), c.hash_of(row)
        maps[slot][h] = index._table.find(slot, h)
    return maps


def protected_scan(index: RadixIndex) -> int:
    c = index._c
    return int(np.count_nonzero(c.alive & ((c.lock_ref > 0) | (c.num_leases > 0))))


def drops(dropped: list[DroppedBlock]) -> list[tuple[bytes, bytes, tuple[Location, ...], str]]:
    """Dropped blocks in a canonical order (a node removal drops the same set, children before parents,
    in an order of its own)."""
    return sorted((bytes(d.ns), bytes(d.block_hash), d.locations, d.reason) for d in dropped)


def fingerprint(index: RadixIndex, *, free_order: bool = True) -> tuple[Any, ...]:
    """Everything the index holds (rows, maps, accounting, free list, the eviction heap's live entries in
    heap order); a free row's fields other than those read before its reuse are blanked; a row without replicas (`rep_node` -1) has no meaningful slot, generation or local
    flag, so those are blanked; heap sequence numbers are compared by their order only (a bulk drop
    does not spend them on pushes of rows it drops next)."""
    c, n = index._c, index._c._next_row
    records = c.records[:n].copy()
    for name in ("rep_slot", "rep_gen", "rep_local"):
        records[name][records["rep_node"] < 0] = 0
    free = records[~records["alive"]]  # a free row keeps only what its next life reads (all else is reset)
    keep = {"alive", "gen", "rep_node", "has_extra", "heap_seq"}
    for name in set(_COLUMNS) - keep:
        free[name] = 0
    records[~records["alive"]] = free
    records["heap_seq"] = records["heap_seq"] != NO_SEQ  # (numbers compared by order, in the heap below)
    return (
        [records[name].tobytes() for name in _COLUMNS],  # (field by field: padding bytes are not state)
        c.h64[:n][c.alive[:n]].tobytes(),
        dict(c.extra),
        c._free[: c._num_free].tolist() if free_order else sorted(c._free[: c._num_free].tolist()),
        c.num_alive,
        c.num_protected,
        dict(index._space._slots),
        dict(index._space._bytes),
        ns_maps(index),
        list(index._ns_count),
        dict(index._group_blocks),
        [
            (key, last_ms, row)
            for key, last_ms, seq, row in sorted(index._heap)
            if c.heap_seq[row] == seq_tag(seq)
        ],
    )


# ---- random indexes -----------------------------------------------------------------------------

_OP = st.one_of(
    st.tuples(
        st.just("insert"),
        st.integers(0, 1),
        st.integers(-1, 10**6),
        st.lists(
            st.lists(st.tuples(st.sampled_from(NODES), st.booleans()), min_size=1, max_size=3),
            min_size=1,
            max_size=4,
        ),
    ),
    st.tuples(st.just("lock"), st.integers(0, 1), st.integers(0, 10**6)),
    st.tuples(st.just("unlock"), st.integers(0, 10**6)),
    st.tuples(st.just("lease"), st.integers(0, 1), st.integers(0, 10**6), st.integers(0, 100)),
    st.tuples(st.just("release"), st.integers(0, 10**6)),
    st.tuples(st.just("advance"), st.integers(1, 80)),
    st.tuples(st.just("remove_location"), st.integers(0, 1), st.integers(0, 10**6)),
    st.tuples(st.just("remove_node"), st.sampled_from(NODES)),
    st.tuples(st.just("evict"), st.integers(0, 4), st.sampled_from((None, *NODES))),
    st.tuples(st.just("invalidate"), st.integers(0, 1)),
    st.tuples(st.just("reclaim"), st.integers(0, 4)),
)


class Driver:
    """Applies random operations to an index, keeping what it needs to pick valid arguments."""

    def __init__(self) -> None:
        self.clock = FakeClock(1000)
        self.index = RadixIndex(clock=self.clock, policy="lru", max_blocks=4096)
        self.next_id = 1
        self.locks: list[tuple[NamespaceId, list[BlockHash]]] = []
        self.leases: list[int] = []
        for ns, group in zip(NAMESPACES, GROUPS, strict=True):
            self.index.register_namespace(ns, group)

    def blocks(self, ns: NamespaceId) -> list[BlockHash]:
        slot, c = self.index._ns_active[ns], self.index._c
        return c.hashes_of(np.flatnonzero(c.alive[: c.high_water] & (c.ns_slot[: c.high_water] == slot)))

    def chain_to(self, ns: NamespaceId, h: BlockHash) -> list[BlockHash]:
        out = [h]
        while (info := self.index.lookup(ns, out[-1])) is not None and info.parent is not None:
            out.append(info.parent)
        return out[::-1]

    def apply(self, op: tuple[Any, ...]) -> None:  # noqa: C901 (one branch per operation)
        ix, kind = self.index, op[0]
        if kind == "insert":
            _, ns_i, pick, reps = op
            ns = NAMESPACES[int(ns_i)]
            existing = self.blocks(ns)
            parent = existing[int(pick) % len(existing)] if existing and int(pick) >= 0 else None
            hashes, locs = [], []
            for block_reps in reps:
                hashes.append(BlockHash(self.next_id.to_bytes(16, "big")))
                row_locs = []
                for node, local in block_reps:
                    row_locs.append(
                        Location(node, 0 if local else self.next_id * 10 + len(row_locs), 0, local)
                    )
                locs.append(list(dict.fromkeys(row_locs)))
                self.next_id += 1
            ix.insert(ns, hashes, parent=parent, locations=locs, size_bytes=64)
        elif kind in ("lock", "lease"):
            ns = NAMESPACES[int(op[1])]
            existing = self.blocks(ns)
            if not existing:
                return
            chain = self.chain_to(ns, existing[int(op[2]) % len(existing)])
            if kind == "lock":
                ix.lock(ns, chain)
                self.locks.append((ns, chain))
            else:
                res = ix.match_prefix(ns, chain, count_hit=True, lease_ttl_ms=int(op[3]))
                if res.lease_id is not None:
                    self.leases.append(res.lease_id)
        elif kind == "unlock" and self.locks:
            ns, chain = self.locks.pop(int(op[1]) % len(self.locks))
            with contextlib.suppress(NotFound, FailedPrecondition):
                ix.unlock(ns, chain)
        elif kind == "release" and self.leases:
            ix.release_lease(self.leases.pop(int(op[1]) % len(self.leases)))
        elif kind == "advance":
            self.clock.advance(int(op[1]))
        elif kind == "remove_location":
            ns = NAMESPACES[int(op[1])]
            existing = self.blocks(ns)
            if existing:
                h = existing[int(op[2]) % len(existing)]
                info = ix.lookup(ns, h)
                assert info is not None
                ix.remove_location(ns, h, info.locations[0])
        elif kind == "remove_node":
            ix.remove_node(str(op[1]))
        elif kind == "evict":
            ix.evict(int(op[1]), node_id=op[2])
        elif kind == "invalidate":
            ns = NAMESPACES[int(op[1])]
            ix.invalidate_namespace(ns)
            ix.register_namespace(ns, GROUPS[int(op[1])])
        elif kind == "reclaim":
            ix.reclaim_invalidated(int(op[1]))


# ---- tests --------------------------------------------------------------------------------------


_INSERT = ("insert", 0, -1, [[("s0", False)], [("s1", False)]])


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(_OP, max_size=40))
@example(ops=[_INSERT, ("lock", 0, 1), ("lock", 0, 0), ("unlock", 0), ("unlock", 0)])
@example(
    ops=[
        _INSERT,
        ("lease", 0, 1, 50),
        ("lease", 0, 0, 0),
        ("release", 0),
        ("lease", 0, 1, 20),
        ("advance", 30),
    ]
)
@example(ops=[_INSERT, ("lock", 0, 1), ("lease", 0, 1, 50), ("remove_node", "s0")])
def test_protected_counter_equals_a_full_scan_after_every_operation(ops: list[tuple[Any, ...]]) -> None:
    d = Driver()
    for op in ops:
        d.apply(op)
        assert d.index._c.num_protected == protected_scan(d.index)
        assert d.index.num_protected_blocks == protected_scan(d.index)  # (after expiring due leases)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_OP, max_size=40), node=st.sampled_from(NODES))
def test_remove_node_leaves_what_the_per_row_loop_left(ops: list[tuple[Any, ...]], node: str) -> None:
    d = Driver()
    for op in ops:
        d.apply(op)
    ref = clone(d.index)
    got = d.index.remove_node(node)
    want = remove_node_reference(ref, node)
    assert drops(got) == drops(want)
    assert fingerprint(d.index, free_order=False) == fingerprint(ref, free_order=False)
    d.index.check_invariants()
    # and they go on alike: evict everything evictable
    assert drops(d.index.evict(10**6).dropped) == drops(ref.evict(10**6).dropped)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_OP, max_size=40), node=st.sampled_from(NODES), budget=st.integers(0, 8))
def test_spare_replica_drops_match_the_per_row_loop(
    ops: list[tuple[Any, ...]], node: str, budget: int
) -> None:
    d = Driver()
    for op in ops:
        d.apply(op)
    ref = clone(d.index)
    got = ev._drop_spare_replicas(d.index, budget, node)
    want = drop_spare_replicas_reference(ref, budget, node)
    assert got == want
    assert fingerprint(d.index) == fingerprint(ref)
    d.index.check_invariants()


def test_remove_node_of_a_replicated_store_keeps_the_other_replicas_in_order() -> None:
    """Multi-replica rows (the Python path of `remove_node`) beside single-replica ones."""
    d = Driver()
    ns = NAMESPACES[0]
    a, b, c = (Location(n, s, 0) for n, s in (("s0", 1), ("s1", 2), ("s2", 3)))
    hs = [BlockHash(i.to_bytes(16, "big")) for i in (1, 2, 3)]
    d.index.insert(
        ns,
        hs,
        parent=None,
        locations=[[a, b, c], [b, Location("s0", 4, 0)], [Location("s0", 5, 0)]],
        size_bytes=8,
    )
    ref = clone(d.index)
    got = d.index.remove_node("s0")
    assert drops(got) == drops(remove_node_reference(ref, "s0"))
    assert [x.block_hash for x in got] == [hs[2]]
    assert d.index.lookup(ns, hs[0]).locations == (b, c)
    assert d.index.lookup(ns, hs[1]).locations == (b,)
    assert fingerprint(d.index, free_order=False) == fingerprint(ref, free_order=False)


def test_remove_node_drops_a_reused_lower_row_below_its_parent_once() -> None:
    """Rows are reused, so an orphan may sit below another orphan with a higher row number: the
    sorted walk meets the child first, and the parent's subtree must not drop it again."""
    d = Driver()
    ns, ix = NAMESPACES[0], d.index
    a, p, q = (BlockHash(i.to_bytes(16, "big")) for i in (1, 2, 3))
    ix.insert(ns, [a], parent=None, locations=[[Location("s1", 1, 0)]], size_bytes=8)  # row 0
    ix.insert(ns, [p], parent=None, locations=[[Location("s0", 2, 0)]], size_bytes=8)  # row 1
    ix.remove_location(ns, a, Location("s1", 1, 0))  # row 0 is free again
    ix.insert(ns, [q], parent=p, locations=[[Location("s0", 3, 0)]], size_bytes=8)  # row 0, below row 1
    assert ns_maps(ix)[ix._ns_active[ns]] == {p: 1, q: 0}
    ref = clone(ix)
    got = ix.remove_node("s0")
    assert drops(got) == drops(remove_node_reference(ref, "s0"))
    assert [x.block_hash for x in got] == [q, p]
    assert fingerprint(ix, free_order=False) == fingerprint(ref, free_order=False) and ix.num_blocks == 0
    ix.check_invariants()


def test_remove_node_of_an_invalidated_namespace_keeps_its_group_count() -> None:
    """Blocks awaiting reclamation no longer count for their group; a node death drops them anyway."""
    d = Driver()
    ns, ix = NAMESPACES[0], d.index
    hs = [BlockHash(i.to_bytes(16, "big")) for i in (1, 2)]
    ix.insert(ns, hs, parent=None, locations=[[Location("s0", 1, 0)], [Location("s0", 2, 0)]], size_bytes=8)
    ix.invalidate_namespace(ns)
    ix.register_namespace(ns, GROUPS[0])
    ix.insert(ns, hs[:1], parent=None, locations=[[Location("s1", 3, 0)]], size_bytes=8)
    ref = clone(ix)
    got = ix.remove_node("s0")
    assert drops(got) == drops(remove_node_reference(ref, "s0")) and len(got) == 2
    assert ix.num_blocks_in_group(GROUPS[0]) == 1
    assert fingerprint(ix, free_order=False) == fingerprint(ref, free_order=False)
    ix.check_invariants()
