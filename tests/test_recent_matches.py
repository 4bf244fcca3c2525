"""Shared recent match answers (`kvpool.connector.recent`): a burst on one prefix costs one `MatchPrefix`
when the decision is not to pull, a pull always asks the master for its own lease, a stale or failed
answer is not shared, and a prompt held whole by the node-local tier asks nothing. Against a real master
over gRPC (in-process, 127.0.0.1:0), its blocks put straight into the index."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.client import MasterClient
from kvpool.connector.connector import FORCE_DECISION_ENV, KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.plan import LoadPlan
from kvpool.connector.recent import RecentMatches, prefix_key
from kvpool.master.server import MasterServer, serve
from kvpool.types import FakeClock, Match
from tests.test_lease_releaser import NUM_BLOCKS, TOKENS, connector, wait_until
from tests.test_master_bounded_state import FP, LAY, chain, put, settings


@pytest.fixture
def server() -> Iterator[MasterServer]:
    s = serve(settings(), clock=FakeClock(1_000_000))
    try:
        yield s
    finally:
        s.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(server: MasterServer, c: MasterClient) -> tuple[bytes, list[bytes]]:
    ns, _ = c.register_namespace("m", "v1", FP)
    hashes = chain(ns, 0, NUM_BLOCKS)
    put(server.master, ns, hashes)
    return ns, hashes


def burst(conn: KVConnector, ns: bytes, hashes: list[bytes], n: int) -> list[LoadPlan]:
    """`n` requests deciding at once (their threads released together)."""
    start = threading.Barrier(n)
    plans: list[LoadPlan | None] = [None] * n

    def one(i: int) -> None:
        start.wait()
        plans[i] = conn.plan_load(ns, TOKENS, hashes, count_hit=True, request_id=f"r{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert all(p is not None for p in plans)
    return [p for p in plans if p is not None]


def test_a_burst_that_recomputes_costs_one_match(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_DECISION_ENV, "recompute")  # as a burst behind a busy link decides
    with MasterClient(server.address) as c:
        conn = connector(c)
        conn.recent = RecentMatches(wait_s=30.0)  # a loaded host: the followers still wait for the leader
        ns, hashes = setup(server, c)
        before = c.stats().num_match_requests
        plans = burst(conn, ns, hashes, 40)
        assert c.stats().num_match_requests - before == 1
        assert conn.recent.num_shared == 39 and sum(p.stats.shared_match for p in plans) == 39
        for p in plans:  # each saw the pool's hit, decided, and holds nothing
            assert p.stats.num_pool_blocks == NUM_BLOCKS and p.num_load_blocks == 0
            assert p.stats.decision == "recompute" and p.lease_id is None and p.pull_ticket is None
        assert wait_until(lambda: c.stats().num_live_leases == 0)  # the leader's, released once
        assert conn.releaser.num_sent == 1 and conn.pulls.num_registered == 0
        conn.close()


def test_a_pull_always_asks_the_master_for_its_own_lease(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FORCE_DECISION_ENV, "pull")
    with MasterClient(server.address) as c:
        conn = connector(c)
        ns, hashes = setup(server, c)
        before = c.stats().num_match_requests
        plans = burst(conn, ns, hashes, 12)
        assert c.stats().num_match_requests - before == 12
        leases = [p.lease_id for p in plans]
        assert None not in leases and len(set(leases)) == 12 and c.stats().num_live_leases == 12
        assert not any(p.stats.shared_match for p in plans)
        assert conn.pulls.num_registered == 12  # every pull in the ledger, once
        for p in plans:
            conn.release(p)
        assert wait_until(lambda: c.stats().num_live_leases == 0)
        conn.close()


def test_an_answer_is_shared_for_its_ttl_only(server: MasterServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORCE_DECISION_ENV, "recompute")
    clock = Clock()
    with MasterClient(server.address) as c:
        conn = connector(c)
        conn.recent = RecentMatches(ttl_s=1.0, clock=clock)
        ns, hashes = setup(server, c)
        before = c.stats().num_match_requests

        def asked() -> int:
            return c.stats().num_match_requests - before

        conn.plan_load(ns, TOKENS, hashes, count_hit=True)
        clock.now = 0.9
        assert conn.plan_load(ns, TOKENS, hashes, count_hit=True).stats.shared_match and asked() == 1
        clock.now = 1.2  # stale: asked again
        assert not conn.plan_load(ns, TOKENS, hashes, count_hit=True).stats.shared_match and asked() == 2
        other = chain(ns, 1000, NUM_BLOCKS)  # another prefix: its own answer (a miss, shared as well)
        assert conn.plan_load(ns, TOKENS, other, count_hit=True).stats.num_pool_blocks == 0 and asked() == 3
        assert conn.plan_load(ns, TOKENS, other, count_hit=True).stats.shared_match and asked() == 3
        conn.close()


def test_a_failed_or_slow_leader_leaves_each_follower_to_ask() -> None:
    recent = RecentMatches(ttl_s=10.0, wait_s=5.0)
    key = prefix_key(b"n" * 16, [b"h" * 32])
    shared, lead = recent.claim(key)
    assert shared is None and lead is not None
    got: list[object] = []
    follower = threading.Thread(target=lambda: got.append(recent.claim(key)))
    follower.start()
    follower.join(0.2)
    assert follower.is_alive()  # waiting for the leader's answer
    recent.publish(lead, None)  # the leader's call failed
    follower.join(5.0)
    assert got == [(None, None)]  # not shared: it asks for itself
    shared, lead2 = recent.claim(key)  # and the next request leads again
    assert shared is None and lead2 is not None
    answer = Match(num_matched=0, replicas=[], lease_id=None, nodes={})
    recent.publish(lead2, answer)
    assert recent.claim(key) == (answer, None)
    slow = RecentMatches(ttl_s=10.0, wait_s=0.05)
    _, lead3 = slow.claim(key)
    assert lead3 is not None and slow.claim(key) == (None, None)  # the leader is late: ask yourself


def test_a_prompt_the_local_tier_holds_whole_asks_the_master_nothing(server: MasterServer) -> None:
    with MasterClient(server.address) as c:
        conn = connector(c)
        conn.local_tier = LocalTier(8 * NUM_BLOCKS * LAY.block_nbytes)
        ns, hashes = setup(server, c)
        blocks = list(np.zeros((NUM_BLOCKS, LAY.block_nbytes), dtype=np.uint8))
        conn.local_tier.put_chain(ns, None, hashes, blocks)
        before = c.stats().num_match_requests
        plan = conn.plan_load(ns, TOKENS, hashes, count_hit=True)
        assert plan.num_local_blocks == NUM_BLOCKS and plan.stats.decision == "local"
        assert plan.num_load_blocks == NUM_BLOCKS and plan.lease_id is None
        assert c.stats().num_match_requests == before
        conn.close()


def test_a_publish_by_this_node_drops_the_answers_it_changes(server: MasterServer) -> None:
    """A miss shared for the TTL would hide the blocks this node publishes right after: `publish` drops
    the answers of every prefix of its chain, whatever the publish's outcome."""
    with MasterClient(server.address) as c:
        conn = connector(c)
        conn.recent = RecentMatches(ttl_s=60.0)
        ns, _ = c.register_namespace("m", "v1", FP)
        fresh = chain(ns, 5000, NUM_BLOCKS)
        assert conn.plan_load(ns, TOKENS, fresh, count_hit=True).stats.num_pool_blocks == 0
        assert conn.plan_load(ns, TOKENS, fresh, count_hit=True).stats.shared_match  # the miss, shared
        put(server.master, ns, fresh)  # another writer's commit: unseen for the TTL
        assert conn.plan_load(ns, TOKENS, fresh, count_hit=True).stats.num_pool_blocks == 0
        blocks = list(np.zeros((NUM_BLOCKS, LAY.block_nbytes), dtype=np.uint8))
        with contextlib.suppress(Exception):  # this connector has no pool client: the publish fails
            conn.publish(ns, fresh, blocks, start_block=0)
        plan = conn.plan_load(ns, TOKENS, fresh, count_hit=True)
        assert plan.stats.num_pool_blocks == NUM_BLOCKS and not plan.stats.shared_match
        conn.release(plan)
        conn.close()


def test_a_burst_asks_the_master_once_per_pull_it_makes() -> None:
    """The cost model on a burst (test_cost_convoy's link and frozen ledger): the followers of one match
    decide on its answer, each pull they choose stays registered while that request asks for its own
    lease, so the requests after it see it coming; every recompute is decided without a call."""
    from tests.test_cost_convoy import HASHES, PEER, TOKENS, _connector, _Master

    class Gated(_Master):
        def __init__(self) -> None:
            super().__init__()
            self.calls, self.gate, self.lock = 0, threading.Event(), threading.Lock()

        def match(self, ns: bytes, hashes: list[bytes], **kwargs: object) -> object:
            with self.lock:
                self.calls += 1
            self.gate.wait(10.0)
            time.sleep(0.02)  # a round trip: the requests woken together decide while calls are out
            return super().match(ns, hashes, **kwargs)

    conn = _connector()
    master = Gated()
    conn.master = master  # type: ignore[assignment]
    conn.recent = RecentMatches(wait_s=30.0)
    n = 40
    plans: list[LoadPlan | None] = [None] * n

    def one(i: int) -> None:
        plans[i] = conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    assert wait_until(lambda: master.calls == 1)
    time.sleep(0.2)
    assert master.calls == 1  # the others wait for the leader's answer
    master.gate.set()
    for t in threads:
        t.join(10.0)
    done = [p for p in plans if p is not None]
    assert len(done) == n
    n_pull = sum(p.stats.decision == "pull" for p in done)
    n_shared = sum(p.stats.shared_match for p in done)
    assert 5 <= n_pull < n and master.calls + n_shared == n  # each request asked, or shared an answer
    assert master.calls <= n_pull + 5  # the leader's and about one per pull (without: one per request)
    assert conn.pulls.in_flight(PEER).num_pulls == n_pull == conn.pulls.num_registered
    for p in done:
        assert (p.pull_ticket is not None) == (p.stats.decision == "pull")
        conn.release(p)
    assert conn.pulls.in_flight(PEER).num_pulls == 0 and conn.pulls.num_released == n_pull
    conn.close()
