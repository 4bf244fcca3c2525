"""The node-local tier keeps chains whole (issue #26 item 4) and stops serving a namespace the master
made unreachable (item 5: a version switch or a flush).

The state machine drives `LocalTier` with random put/lookup/discard/clear/drain sequences over a small
trie of chains sharing prefixes in two namespaces, every block the same size and a capacity of a few
blocks (so nearly every put evicts, among many equally old candidates), and checks after every step that
each resident block's parent is resident, the bytes stay bounded, lookups return resident leading runs
only, and the drained events give the master exactly the resident set.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.connector.local_tier import LocalTier

NBYTES = 8
NAMESPACES = (b"A" * 16, b"B" * 16)
DEPTH, FANOUT = 5, 2
PATHS = st.lists(st.integers(0, FANOUT - 1), min_size=1, max_size=DEPTH).map(tuple)


def block_hash(ns: bytes, path: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(ns + bytes(path), digest_size=16).digest()


def chain(ns: bytes, path: tuple[int, ...]) -> list[bytes]:
    return [block_hash(ns, path[: i + 1]) for i in range(len(path))]


def payload(h: bytes) -> np.ndarray:
    return np.frombuffer(h[:NBYTES], dtype=np.uint8)


PARENT: dict[tuple[bytes, bytes], bytes | None] = {}  # every block of the trie -> its parent hash


def _trie(path: tuple[int, ...] = ()) -> Iterator[tuple[int, ...]]:
    if len(path) < DEPTH:
        for b in range(FANOUT):
            yield path + (b,)
            yield from _trie(path + (b,))


for _ns in NAMESPACES:
    for _p in _trie():
        PARENT[(_ns, block_hash(_ns, _p))] = block_hash(_ns, _p[:-1]) if len(_p) > 1 else None


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = LocalTier(4 * NBYTES)
        self.master: set[tuple[bytes, bytes]] = set()  # what the drained events told the master

    def resident(self) -> set[tuple[bytes, bytes]]:
        return {key for key in PARENT if key in self.tier}

    @rule(ns=st.sampled_from(NAMESPACES), path=PATHS, start=st.integers(0, DEPTH), report=st.booleans())
    def put_chain(self, ns: bytes, path: tuple[int, ...], start: int, report: bool) -> None:
        """As `publish` and `keep_pulled` do: blocks `start..` of a chain, each below the one before."""
        hashes = chain(ns, path)
        start = min(start, len(hashes) - 1)
        for i in range(start, len(hashes)):
            h, parent = hashes[i], hashes[i - 1] if i else None
            parent_there = parent is None or (ns, parent) in self.tier
            ok = self.tier.put(ns, h, payload(h), parent=parent, report=report)
            assert ok == ((ns, h) in self.tier)
            if not parent_there:
                assert not ok  # an orphan is refused, as the index refuses it
            if not ok:
                break
        if not report:
            self.tier.report_stored(ns, hashes)  # as `publish` does once the master holds the blocks

    @rule(ns=st.sampled_from(NAMESPACES), path=PATHS)
    def lookup(self, ns: bytes, path: tuple[int, ...]) -> None:
        hashes = chain(ns, path)
        n = self.tier.leading_run(ns, hashes)
        expected = 0
        while expected < len(hashes) and (ns, hashes[expected]) in self.tier:
            expected += 1
        assert n == expected
        for h in hashes[:n]:  # the connector's reads: each touches recency
            got = self.tier.get(ns, h)
            assert got is not None and bytes(got) == bytes(payload(h)) and not got.flags.writeable

    @rule(ns=st.sampled_from(NAMESPACES), path=PATHS)
    def discard(self, ns: bytes, path: tuple[int, ...]) -> None:
        h = chain(ns, path)[-1]
        before = self.resident()
        self.tier.discard(ns, [h])
        below = {k for k in before if self._descends(k, (ns, h))}
        assert self.resident() == before - below

    @rule()
    def clear(self) -> None:
        self.tier.clear()
        assert len(self.tier) == 0 and self.tier.used_bytes == 0

    @rule()
    def drain(self) -> None:
        for ns, stored, removed in self.tier.drain_events():
            assert not set(stored) & set(removed)
            self.master |= {(ns, h) for h in stored}
            self.master -= {(ns, h) for h in removed}
        assert self.master == self.resident()

    def _descends(self, key: tuple[bytes, bytes], root: tuple[bytes, bytes]) -> bool:
        while key != root:
            parent = PARENT[key]
            if parent is None:
                return False
            key = (key[0], parent)
        return True

    @invariant()
    def chains_are_whole(self) -> None:
        resident = self.resident()
        assert len(resident) == len(self.tier)
        for ns, h in resident:
            parent = PARENT[(ns, h)]
            assert parent is None or (ns, parent) in self.tier, "a resident block's parent left"
        assert self.tier.used_bytes == len(resident) * NBYTES <= self.tier.capacity_bytes


TierMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestTierMachine = TierMachine.TestCase


def test_a_chain_longer_than_the_tier_keeps_its_leading_blocks() -> None:
    """The old LRU kept a long prompt's tail, which no lookup can reach; now the head stays."""
    tier, ns = LocalTier(3 * NBYTES), NAMESPACES[0]
    hashes = chain(ns, (0, 1, 0, 1, 0))
    parents = [None, *hashes[:-1]]
    kept = [tier.put(ns, h, payload(h), parent=p) for h, p in zip(hashes, parents, strict=True)]
    assert kept == [True, True, True, False, False]
    assert tier.leading_run(ns, hashes) == 3
    other = chain(ns, (1,))
    assert tier.put(ns, other[0], payload(other[0]), parent=None)  # evicts the leaf hashes[2] only
    assert tier.leading_run(ns, hashes) == 2 and tier.parent_of(ns, hashes[1]) == hashes[0]


def test_discard_drops_the_blocks_below() -> None:
    tier, ns = LocalTier(16 * NBYTES), NAMESPACES[0]
    for path in ((0, 0, 0), (0, 1)):
        hashes = chain(ns, path)
        assert tier.put_chain(ns, None, hashes, [payload(h) for h in hashes]) == len(hashes)
    assert tier.discard(ns, [block_hash(ns, (0, 0))]) == 2
    assert len(tier) == 2 and tier.leading_run(ns, chain(ns, (0, 1))) == 2


def test_concurrent_puts_and_reads_keep_chains_whole() -> None:
    tier = LocalTier(6 * NBYTES)
    paths = list(_trie())

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            ns = NAMESPACES[int(rng.integers(2))]
            hashes = chain(ns, paths[int(rng.integers(len(paths)))])
            for h, p in zip(hashes, [None, *hashes[:-1]], strict=True):
                tier.put(ns, h, payload(h), parent=p)
            for h in hashes[: tier.leading_run(ns, hashes)]:
                tier.get(ns, h)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (ns, h), parent in PARENT.items():
        if (ns, h) in tier:
            assert parent is None or (ns, parent) in tier
    assert tier.used_bytes == len(tier) * NBYTES <= tier.capacity_bytes
