"""Pull convoys (field case B39): a decision sees the bytes already committed to pulls on its link.

Injected clock and link: 50 requests on one prefix decide one after another while no pull ends; the 50th
sees 49 in flight, and the decisions flip to recompute once the queue makes pulling slower. Releases
(success, failure, cancel, a lost plan's expiry) bring the decision back to pull.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import LinkEstimate, PullLedger, RecomputeModel, decide_reuse
from kvpool.errors import InvalidArgument
from kvpool.types import Location

BLOCK, NBYTES, HIT = 16, 1 << 20, 10  # a 10-block prefix of 1 MiB blocks
PROMPT = HIT * BLOCK + 8
LINK = LinkEstimate(alpha_s=0.001, beta_bytes_per_s=1e9)  # 1 ms + ~1 ms per block
RECOMPUTE = RecomputeModel(overhead_s=0.002, per_token_s=1e-3, per_pair_s=0.0)  # 170 ms for the prompt
PEER = "store-a:1"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def decide(ledger: PullLedger, *, margin: float = 0.1) -> tuple[Any, Any]:
    """One request's decision against the ledger's queue on PEER; registers the pull when it pulls."""
    q = ledger.in_flight(PEER)
    d = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, margin=margin, queued_bytes=q.nbytes)
    ticket = ledger.register({PEER: d.num_load_blocks * NBYTES}, ttl_s=10.0) if d.num_load_blocks else None
    return q, d, ticket


def test_the_50th_decision_sees_49_pulls_in_flight_and_recomputes() -> None:
    ledger = PullLedger(clock=Clock())
    seen, decisions, tickets = [], [], []
    for _ in range(50):  # the clock never moves, no pull ends: every pull is still queued
        q, d, t = decide(ledger, margin=0.0)
        seen.append(q)
        decisions.append(d)
        tickets.append(t)
    pulls = [d for d in decisions if d.num_load_blocks]
    # recompute 170 ms vs (queued + 10 MiB)/1 GB/s + 1 ms + 8 tokens: about 15 pulls fit
    assert 5 <= len(pulls) < 50
    first_recompute = next(i for i, d in enumerate(decisions) if d.num_load_blocks == 0)
    assert all(d.num_load_blocks == HIT for d in decisions[:first_recompute])  # a prefix of pulls, then
    assert all(d.reason == "recompute_cheaper" for d in decisions[first_recompute:])  # recompute only
    assert seen[first_recompute].num_pulls == first_recompute
    assert decisions[first_recompute].predicted_load_s == 0.0  # nothing loaded, nothing predicted
    assert seen[-1].num_pulls == len(pulls)  # the 50th sees every pull decided before it
    # had all 50 pulled (no recompute option), the 50th would see 49 in flight and their bytes
    forced = PullLedger(clock=Clock())
    for _ in range(49):
        forced.register({PEER: HIT * NBYTES}, ttl_s=10.0)
    q50 = forced.in_flight(PEER)
    assert (q50.num_pulls, q50.nbytes) == (49, 49 * HIT * NBYTES)
    d50 = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, margin=0.0, queued_bytes=q50.nbytes)
    alone = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, margin=0.0)
    assert d50.num_load_blocks == 0 and alone.num_load_blocks == HIT
    assert d50.queued_bytes == 49 * HIT * NBYTES
    # releases bring the decision back to pull
    for t in tickets:
        if t is not None:
            assert t.release()
    assert ledger.in_flight(PEER) == ledger.in_flight("nobody")  # empty
    assert decide(ledger)[1].num_load_blocks == HIT


def test_predicted_pull_time_is_monotone_in_bytes_in_flight() -> None:
    prev_total = prev_load = -1.0
    for queued in [0, 1, 1000, NBYTES, 5 * NBYTES, 49 * HIT * NBYTES, 10**12]:
        d = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, queued_bytes=queued)
        assert d.predicted_total_s >= prev_total  # the best option never gets cheaper as the queue grows
        prev_total = d.predicted_total_s
        if d.num_remote_used:  # a pull's predicted time waits behind the whole queue, strictly growing
            assert d.predicted_load_s == pytest.approx(
                LINK.alpha_s + (queued + d.num_remote_used * NBYTES) / LINK.beta_bytes_per_s
            )
            assert d.predicted_load_s > prev_load
            prev_load = d.predicted_load_s
    # the decision itself never pulls more as the queue grows
    ks = [
        decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, queued_bytes=q).num_load_blocks
        for q in range(0, 400 * NBYTES, NBYTES)
    ]
    assert ks == sorted(ks, reverse=True) and ks[0] == HIT and ks[-1] == 0
    with pytest.raises(InvalidArgument):
        decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, queued_bytes=-1)


def test_local_blocks_wait_behind_no_queue() -> None:
    d = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, num_local_blocks=HIT, queued_bytes=10**12)
    assert d.num_load_blocks == HIT and d.predicted_load_s == 0.0


def test_ledger_releases_exactly_once_and_expires() -> None:
    clock = Clock()
    ledger = PullLedger(clock=clock)
    with ledger.register({PEER: 100, "b:1": 50}, ttl_s=5.0) as t:
        assert ledger.in_flight(PEER).num_pulls == 1 and ledger.in_flight("b:1").nbytes == 50
    assert not t.release() and not ledger.release(t.id) and not ledger.release(None)  # once only
    assert ledger.in_flight(PEER).num_pulls == 0
    with pytest.raises(RuntimeError), ledger.register({PEER: 100}, ttl_s=5.0):  # a failing pull still ends
        raise RuntimeError("pull failed")
    assert ledger.in_flight(PEER).nbytes == 0
    lost = ledger.register({PEER: 100}, ttl_s=5.0)  # never released (its plan was lost)
    clock.now += 4.9
    assert ledger.in_flight(PEER).nbytes == 100
    clock.now += 0.2
    assert ledger.in_flight(PEER).nbytes == 0 and ledger.num_expired == 1
    assert not lost.release()
    with pytest.raises(InvalidArgument):
        ledger.register({PEER: -1}, ttl_s=1.0)
    with pytest.raises(InvalidArgument):
        ledger.register({PEER: 1}, ttl_s=0.0)


def test_a_contended_pull_teaches_its_link_the_throughput_it_really_got() -> None:
    ledger = PullLedger(clock=Clock())
    first = ledger.register({PEER: 10 * NBYTES}, ttl_s=5.0)
    second = ledger.register({PEER: 10 * NBYTES, "b:1": NBYTES}, ttl_s=5.0)  # behind the first on PEER
    ledger.release(first.id, elapsed_s=0.1)  # it waited behind nothing: a single-stream figure, not learned
    assert ledger.in_flight(PEER).bytes_per_s == 0.0
    ledger.release(second.id, elapsed_s=0.5)  # 20 MiB drained from PEER before it ended
    assert ledger.in_flight(PEER).bytes_per_s == pytest.approx(20 * NBYTES / 0.5)
    assert ledger.in_flight("b:1").bytes_per_s == 0.0  # nothing queued there before it
    third, fourth = (ledger.register({PEER: NBYTES}, ttl_s=5.0) for _ in range(2))
    ledger.release(third.id)  # released without a time (cancelled): teaches nothing
    ledger.release(fourth.id, elapsed_s=1.0)  # queued 1 MiB behind: 2 MiB/s, weighted in
    want = 40 * NBYTES + 0.3 * (2 * NBYTES - 40 * NBYTES)
    assert ledger.in_flight(PEER).bytes_per_s == pytest.approx(want)
    assert ledger.contended_rates() == {PEER: pytest.approx(want)}


def test_a_learned_contended_throughput_makes_the_next_decision_recompute() -> None:
    """One pull in flight: with the single-stream link (1 GB/s) pulling behind it still wins; with the
    throughput contended pulls were seen to get (42 MB/s), the same decision recomputes."""
    naive = _connector()
    naive.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)  # in flight, never released
    assert naive.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True).stats.decision == "pull"

    taught = _connector()
    a = taught.pulls.register({PEER: HIT * NBYTES}, ttl_s=10.0)
    b = taught.pulls.register({PEER: HIT * NBYTES}, ttl_s=10.0)
    taught.pulls.release(a.id, elapsed_s=0.25)
    taught.pulls.release(b.id, elapsed_s=0.5)  # 20 MiB in 0.5 s
    taught.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)  # one in flight again
    stats = taught.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True).stats
    assert stats.decision == "recompute" and stats.num_pulls_in_flight == 1


def test_a_pull_that_shared_its_time_with_others_is_overlapped() -> None:
    ledger = PullLedger(clock=Clock())
    a = ledger.register({PEER: 1}, ttl_s=5.0)
    assert not ledger.overlapped(a.id) and not ledger.overlapped(None) and not ledger.overlapped("x-1")
    b = ledger.register({"b:1": 1}, ttl_s=5.0)  # another store: still the same host's CPU
    assert ledger.overlapped(a.id) and ledger.overlapped(b.id)
    a.release()
    b.release()
    c = ledger.register({PEER: 1}, ttl_s=5.0)
    assert not ledger.overlapped(c.id)


def test_only_a_pull_that_ran_alone_corrects_the_link_estimate() -> None:
    conn = _connector()
    first = conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)
    second = conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)
    assert first.stats.decision == second.stats.decision == "pull"
    conn.pull(first)
    conn.pull(second)
    assert conn.calibration.num_pull_observations == 0  # a convoy: its times are the ledger's
    conn.release(first)
    conn.release(second)
    alone = conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)
    conn.pull(alone)
    conn.release(alone)
    assert conn.calibration.num_pull_observations == 1


def test_ledger_is_thread_safe() -> None:
    ledger = PullLedger(clock=Clock())

    def work() -> None:
        for _ in range(500):
            ledger.register({PEER: 7}, ttl_s=1.0).release()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.in_flight(PEER) == ledger.in_flight("x") and ledger.num_released == 4000


# ---- the connector registers each pull it decides and releases it once, on every path ------------------


class _Match:
    def __init__(self, n: int) -> None:
        from types import SimpleNamespace

        self.lease_id = 7
        self.num_matched = n
        self.replicas = [(Location(node_id="s1", slot=i, generation=1),) for i in range(n)]
        self.nodes = {"s1": SimpleNamespace(data_address=PEER)}


class _Master:
    def __init__(self) -> None:
        self.released: list[int] = []

    def match(self, ns: bytes, hashes: list[bytes], **kwargs: Any) -> _Match:
        return _Match(len(hashes))

    def release_lease(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def release_leases(self, lease_ids: list[int]) -> tuple[int, int]:
        self.released += lease_ids
        return len(lease_ids), 0

    def report_bad_replica(self, *args: Any) -> None:
        pass


class _Transport:
    """Answers reads intact, failing, or raising; `inflight` is the connector's queue seen mid-pull."""

    def __init__(self, conn: Any, mode: str = "ok") -> None:
        self.conn, self.mode, self.seen = conn, mode, []

    def link(self, peer: str) -> LinkEstimate:
        return LINK

    def read_blocks(self, peer: str, reads: Any, outs: Any, *, timeout_s: float) -> list[Any]:
        from types import SimpleNamespace

        self.seen.append(self.conn.pulls.in_flight(peer).num_pulls)
        if self.mode == "raise":
            raise ConnectionError("store gone")
        return [SimpleNamespace(ok=self.mode == "ok", error="checksum mismatch") for _ in reads]


def _connector(mode: str = "ok") -> KVConnector:
    conn = KVConnector(
        master=_Master(),
        pool=None,
        transport=None,
        node_id="n1",
        block_size=BLOCK,
        block_nbytes=NBYTES,
        recompute=RECOMPUTE,
        local_tier=LocalTier(0),
        margin=0.0,
    )
    conn.transport = _Transport(conn, mode)
    conn.pulls = PullLedger(clock=Clock())  # time stands still: nothing drains
    return conn


TOKENS = list(range(PROMPT))
HASHES = [bytes([i]) * 16 for i in range(HIT)]


@pytest.mark.parametrize("mode", ["ok", "fail", "raise"])
def test_load_prefix_releases_its_pull_on_success_and_failure(mode: str) -> None:
    conn = _connector(mode)
    loaded = conn.load_prefix(b"n" * 16, TOKENS, HASHES, count_hit=True)
    assert conn.transport.seen and conn.transport.seen[0] == 1  # registered while the pull ran
    assert conn.pulls.in_flight(PEER).num_pulls == 0  # and released after, whatever happened
    assert conn.pulls.num_registered == conn.pulls.num_released == 1
    assert loaded.stats.num_reused_tokens == (HIT * BLOCK if mode == "ok" else 0)


def test_plans_queue_then_recompute_and_cancel_releases() -> None:
    conn = _connector()
    plans = [conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True) for _ in range(50)]
    stats = [p.stats for p in plans]
    n_pull = sum(s.decision == "pull" for s in stats)
    assert 5 <= n_pull < 50 and stats[-1].decision == "recompute"
    assert stats[-1].num_pulls_in_flight == n_pull and stats[-1].queued_bytes == n_pull * HIT * NBYTES
    assert [s.num_pulls_in_flight for s in stats[:n_pull]] == list(range(n_pull))
    predicted = [s.predicted_pull_s for s in stats[:n_pull]]
    assert predicted == sorted(predicted) and len(set(predicted)) == n_pull  # strictly growing with the queue
    assert all(p.pull_ticket is None for p in plans if p.stats.decision == "recompute")
    for p in plans:  # cancel (an aborted request): release without pulling; twice is harmless
        conn.release(p)
        conn.release(p)
    assert conn.pulls.in_flight(PEER).num_pulls == 0 and conn.pulls.num_released == n_pull
    assert conn.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True).stats.decision == "pull"


def test_a_plan_copied_to_another_process_releases_nothing_there() -> None:
    """vLLM: the worker releases its copy of the plan in its own connector; the scheduler's ledger keeps
    the entry until its own release or the entry's expiry, never double counts or goes negative."""
    import pickle

    sched, worker = _connector(), _connector()
    plan = sched.plan_load(b"n" * 16, TOKENS, HASHES, count_hit=True)
    copy = pickle.loads(pickle.dumps(plan))
    worker.release(copy)
    assert worker.pulls.num_released == 0 and sched.pulls.in_flight(PEER).num_pulls == 1
    sched.release(plan)
    assert sched.pulls.in_flight(PEER).num_pulls == 0
