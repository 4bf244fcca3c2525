"""Hypothesis state machine: RadixIndex against a brute-force reference model, invariants every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import FailedPrecondition, NotFound
from kvpool.index import RadixIndex
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId

NODES = ("n0", "n1", "n2")
NAMESPACES = (NamespaceId(b"A" * 16), NamespaceId(b"B" * 16))


@dataclass
class RefBlock:
    parent: BlockHash | None
    locations: set[Location]
    hits: int = 0
    lock: int = 0
    leases: set[int] = field(default_factory=set)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(1000)
        self.index = RadixIndex(clock=self.clock, policy="lru")
        self.blocks: dict[NamespaceId, dict[BlockHash, RefBlock]] = {ns: {} for ns in NAMESPACES}
        self.dead: set[BlockHash] = set()  # blocks of invalidated namespaces
        self.leases: dict[int, tuple[int, list[tuple[NamespaceId, BlockHash]]]] = {}
        self.locks: list[tuple[NamespaceId, list[BlockHash]]] = []
        self.next_hash = 1
        self.next_slot = 1
        for ns in NAMESPACES:
            self.index.register_namespace(ns)

    # ---- helpers --------------------------------------------------------------------------------
    def path(self, ns: NamespaceId, h: BlockHash) -> list[BlockHash]:
        out = [h]
        while (p := self.blocks[ns][out[-1]].parent) is not None:
            out.append(p)
        return out[::-1]

    def expire(self) -> None:
        now = self.clock.now_ms()
        for lid, (expiry, _) in list(self.leases.items()):
            if expiry <= now:
                self.drop_lease(lid)

    def drop_lease(self, lid: int) -> None:
        _, pinned = self.leases.pop(lid)
        for ns, h in pinned:
            b = self.blocks[ns].get(h)
            if b is not None:
                b.leases.discard(lid)

    def children(self, ns: NamespaceId, h: BlockHash) -> list[BlockHash]:
        return [k for k, b in self.blocks[ns].items() if b.parent == h]

    def drop_ref(self, ns: NamespaceId, h: BlockHash) -> set[BlockHash]:
        gone = {h}
        for ch in self.children(ns, h):
            gone |= self.drop_ref(ns, ch)
        self.blocks[ns].pop(h, None)
        return gone

    def protected_subtree(self, ns: NamespaceId, h: BlockHash) -> bool:
        b = self.blocks[ns][h]
        return bool(b.lock or b.leases) or any(self.protected_subtree(ns, ch) for ch in self.children(ns, h))

    def new_loc(self, node: str) -> Location:
        self.next_slot += 1
        return Location(node, self.next_slot, 1)

    # ---- rules ----------------------------------------------------------------------------------
    @rule(
        ns_i=st.integers(0, 1),
        pick=st.integers(0, 10**6),
        n_new=st.integers(1, 3),
        node=st.sampled_from(NODES),
        from_root=st.booleans(),
    )
    def insert(self, ns_i: int, pick: int, n_new: int, node: str, from_root: bool) -> None:
        ns = NAMESPACES[ns_i]
        existing = list(self.blocks[ns])
        prefix = [] if from_root or not existing else self.path(ns, existing[pick % len(existing)])
        new = []
        for _ in range(n_new):
            new.append(BlockHash(self.next_hash.to_bytes(16, "big")))
            self.next_hash += 1
        chain = prefix + new
        locs = [[self.new_loc(node)] for _ in chain]
        res = self.index.insert(ns, chain, parent=None, locations=locs, size_bytes=100)
        assert (res.num_existing, res.num_inserted) == (len(prefix), n_new)
        parent = None
        for h, loc in zip(chain, locs, strict=True):
            if h in self.blocks[ns]:
                self.blocks[ns][h].locations.add(loc[0])
            else:
                self.blocks[ns][h] = RefBlock(parent, {loc[0]})
            parent = h

    @rule(
        ns_i=st.integers(0, 1),
        pick=st.integers(0, 10**6),
        extra=st.booleans(),
        count_hit=st.booleans(),
        ttl=st.sampled_from([0, 0, 50, 200]),
    )
    def match(self, ns_i: int, pick: int, extra: bool, count_hit: bool, ttl: int) -> None:
        ns = NAMESPACES[ns_i]
        existing = list(self.blocks[ns])
        query = self.path(ns, existing[pick % len(existing)]) if existing else []
        if extra:
            query = [*query, BlockHash(b"\xff" * 16)]
        res = self.index.match_prefix(ns, query, count_hit=count_hit, lease_ttl_ms=ttl)
        n = len(query) - (1 if extra else 0)
        assert res.num_matched == n
        for h, locs in zip(query, res.locations, strict=False):
            assert set(locs) == self.blocks[ns][h].locations
            if count_hit:
                self.blocks[ns][h].hits += 1
        self.expire()
        if ttl and n:
            assert res.lease_id is not None
            self.leases[res.lease_id] = (self.clock.now_ms() + ttl, [(ns, h) for h in query[:n]])
            for h in query[:n]:
                self.blocks[ns][h].leases.add(res.lease_id)
        else:
            assert res.lease_id is None

    @rule(
        ns_i=st.integers(0, 1),
        picks=st.lists(st.integers(-1, 10**6), max_size=6),
        count_hit=st.booleans(),
    )
    def match_any_sequence(self, ns_i: int, picks: list[int], count_hit: bool) -> None:
        """A query that need not be a chain (blocks out of order, absent ones, other branches): the
        match is still the longest leading run that is a path from the root."""
        ns = NAMESPACES[ns_i]
        existing = list(self.blocks[ns])
        query = [
            existing[p % len(existing)] if existing and p >= 0 else BlockHash(b"\xfe" * 16) for p in picks
        ]
        expected, parent = 0, None
        for h in query:
            b = self.blocks[ns].get(h)
            if b is None or b.parent != parent:
                break
            expected, parent = expected + 1, h
        res = self.index.match_prefix(ns, tuple(query), count_hit=count_hit, lease_ttl_ms=0)
        assert res.num_matched == expected and res.lease_id is None
        for h, locs in zip(query, res.locations, strict=False):
            assert set(locs) == self.blocks[ns][h].locations
            if count_hit:
                self.blocks[ns][h].hits += 1

    @precondition(lambda self: self.leases)
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        lid = sorted(self.leases)[pick % len(self.leases)]
        self.index.release_lease(lid)
        self.drop_lease(lid)

    @rule(ms=st.integers(1, 150))
    def advance(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(ns_i=st.integers(0, 1), pick=st.integers(0, 10**6))
    def lock(self, ns_i: int, pick: int) -> None:
        ns = NAMESPACES[ns_i]
        existing = list(self.blocks[ns])
        if not existing:
            return
        chain = self.path(ns, existing[pick % len(existing)])
        self.index.lock(ns, chain)
        self.locks.append((ns, chain))
        for h in chain:
            self.blocks[ns][h].lock += 1

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 10**6))
    def unlock(self, pick: int) -> None:
        ns, chain = self.locks.pop(pick % len(self.locks))
        if all(h in self.blocks[ns] for h in chain):
            self.index.unlock(ns, chain)
            for h in chain:
                self.blocks[ns][h].lock -= 1
        else:
            try:
                self.index.unlock(ns, chain)
            except (NotFound, FailedPrecondition):
                pass
            else:
                raise AssertionError("unlock of a dropped chain succeeded")

    @rule(k=st.integers(0, 6))
    def evict(self, k: int) -> None:
        self.expire()
        evictable = sum(1 for ns in NAMESPACES for h in self.blocks[ns] if not self.protected_subtree(ns, h))
        res = self.index.evict(k)
        assert len(res.dropped) == min(k, evictable)
        assert res.shortfall == k - len(res.dropped)
        for d in res.dropped:
            b = self.blocks[d.ns][d.block_hash]
            assert not b.lock and not b.leases and not self.children(d.ns, d.block_hash)
            assert set(d.locations) == b.locations
            del self.blocks[d.ns][d.block_hash]

    @rule(k=st.integers(0, 4), node=st.sampled_from(NODES))
    def evict_node(self, k: int, node: str) -> None:
        self.expire()
        res = self.index.evict(k, node_id=node)
        assert res.shortfall == max(0, k - res.num_freed_on_node)
        for d in res.dropped:
            b = self.blocks[d.ns][d.block_hash]
            assert not b.lock and not b.leases
            if d.reason == "replica":
                (loc,) = d.locations
                assert loc.node_id == node and any(x.node_id != node for x in b.locations - {loc})
                b.locations.discard(loc)
            else:
                assert not self.children(d.ns, d.block_hash)
                del self.blocks[d.ns][d.block_hash]

    @rule(ns_i=st.integers(0, 1), pick=st.integers(0, 10**6))
    def remove_location(self, ns_i: int, pick: int) -> None:
        ns = NAMESPACES[ns_i]
        existing = list(self.blocks[ns])
        if not existing:
            return
        h = existing[pick % len(existing)]
        loc = sorted(self.blocks[ns][h].locations, key=lambda x: x.slot)[0]
        dropped = self.index.remove_location(ns, h, loc)
        self.blocks[ns][h].locations.discard(loc)
        expected: set[BlockHash] = set()
        if not self.blocks[ns][h].locations:
            expected = self.drop_ref(ns, h)
        assert {d.block_hash for d in dropped} == expected

    @rule(node=st.sampled_from(NODES))
    def remove_node(self, node: str) -> None:
        dropped = self.index.remove_node(node)
        expected: set[BlockHash] = set()
        for ns in NAMESPACES:
            for h in list(self.blocks[ns]):
                b = self.blocks[ns].get(h)
                if b is None:
                    continue
                b.locations = {x for x in b.locations if x.node_id != node}
                if not b.locations:
                    expected |= self.drop_ref(ns, h)
        assert {d.block_hash for d in dropped} - self.dead == expected
        assert self.index.num_blocks_on_node(node) == 0

    @rule(ns_i=st.integers(0, 1))
    def invalidate(self, ns_i: int) -> None:
        ns = NAMESPACES[ns_i]
        self.index.invalidate_namespace(ns)
        self.index.register_namespace(ns)
        self.dead |= set(self.blocks[ns])
        self.blocks[ns] = {}

    @rule(k=st.integers(0, 5))
    def reclaim(self, k: int) -> None:
        self.expire()
        dropped = self.index.reclaim_invalidated(k)
        assert len(dropped) <= k
        for d in dropped:
            assert d.reason == "invalidate" and d.block_hash in self.dead

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        live = sum(len(self.blocks[ns]) for ns in NAMESPACES)
        assert self.index.num_blocks - self.index.num_invalidated_blocks == live
        for ns in NAMESPACES:
            for h, b in self.blocks[ns].items():
                info = self.index.lookup(ns, h)
                assert info is not None and info.parent == b.parent and set(info.locations) == b.locations
                assert info.hit_count == b.hits and info.lock_ref == b.lock
                # chains whole (issue #26): a resident block's parent is resident, whatever the ties
                assert b.parent is None or self.index.lookup(ns, b.parent) is not None


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase
