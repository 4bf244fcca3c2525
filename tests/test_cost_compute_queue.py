"""The compute queue in the pull decision (field case B39): a load overlaps the forwards queued ahead.

Injected clock, link and recompute model. A burst of 50 requests on one prefix: each decision sees the
pulls in flight on the link (the ledger) and the forwards queued on the model (`ComputeQueue`); where the
link queue alone makes the later requests recompute, the compute queue makes them pull, because their
loads finish while the forwards ahead run. Then the same through `KVConnector.load_prefix`.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import LinkEstimate, PullLedger, decide_reuse, load_deadline_s
from kvpool.cost.compute_queue import ComputeQueue
from kvpool.errors import InvalidArgument
from kvpool.hashing import hash_blocks
from kvpool.types import Location, Match, NodeInfo
from tests.test_cost_convoy import BLOCK, HIT, LINK, NBYTES, PEER, PROMPT, RECOMPUTE, Clock


def burst(*, with_queue: bool, n: int = 50) -> list[Any]:
    """`n` requests decide one after another while nothing ends (the clock stands still)."""
    clock = Clock()
    ledger, forwards = PullLedger(clock=clock), ComputeQueue(clock=clock)
    decisions = []
    for _ in range(n):
        wait = forwards.ahead_s() if with_queue else 0.0
        d = decide_reuse(
            HIT,
            BLOCK,
            PROMPT,
            NBYTES,
            LINK,
            RECOMPUTE,
            margin=0.1,
            queued_bytes=ledger.in_flight(PEER).nbytes,
            compute_wait_s=wait,
        )
        if d.num_load_blocks:
            ledger.register({PEER: d.num_load_blocks * NBYTES}, ttl_s=10.0)
        forwards.register(d.predicted_compute_s)
        decisions.append(d)
    return decisions


def test_the_50th_decision_waits_behind_49_forwards_and_pulls() -> None:
    plain, queued = burst(with_queue=False), burst(with_queue=True)
    # the link queue alone: the later requests recompute (their pull waits behind the others')
    assert sum(1 for d in plain if d.num_load_blocks) < 30
    # with the forwards ahead counted, every request pulls: each load is hidden by the wait
    assert all(d.num_load_blocks == HIT for d in queued)
    last = queued[-1]
    assert last.compute_wait_s == pytest.approx(sum(d.predicted_compute_s for d in queued[:-1]))
    assert last.predicted_load_s > last.predicted_recompute_all_s  # slower than a recompute alone...
    assert last.predicted_total_s < last.compute_wait_s + last.predicted_recompute_all_s  # ...yet cheaper
    # and the burst's work: 50 short forwards, not 20-odd full ones
    work = [sum(d.predicted_compute_s for d in ds) for ds in (plain, queued)]
    assert work[1] < 0.5 * work[0]


def test_a_wait_shorter_than_the_load_hides_only_its_part() -> None:
    # a 0.5-GB/s-short link: loading all 10 blocks takes ~21 ms against 8 tokens' 10 ms of compute
    slow = LinkEstimate(alpha_s=0.001, beta_bytes_per_s=1e8)  # 106 ms for 10 MiB
    idle = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, slow, RECOMPUTE, margin=0.0)
    waited = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, slow, RECOMPUTE, margin=0.0, compute_wait_s=0.05)
    assert idle.num_load_blocks == waited.num_load_blocks == HIT
    assert idle.predicted_total_s == pytest.approx(idle.predicted_load_s + idle.predicted_compute_s)
    # the load runs during the 50-ms wait: the first token comes max(load, wait) + compute after deciding
    assert waited.predicted_total_s == pytest.approx(waited.predicted_load_s + waited.predicted_compute_s)
    assert waited.predicted_saving_s == pytest.approx(idle.predicted_saving_s + 0.05)


def test_a_load_slower_than_recompute_pulls_only_when_the_wait_hides_it() -> None:
    slow = LinkEstimate(alpha_s=0.001, beta_bytes_per_s=3e7)  # ~350 ms for 10 MiB, recompute 170 ms
    assert decide_reuse(HIT, BLOCK, PROMPT, NBYTES, slow, RECOMPUTE).num_load_blocks < HIT
    d = decide_reuse(HIT, BLOCK, PROMPT, NBYTES, slow, RECOMPUTE, margin=0.1, compute_wait_s=0.5)
    assert d.num_load_blocks == HIT and d.reason == "load_all"
    # the deadline: past wait + recompute_all - compute_rest every saving is gone
    assert d.load_deadline_s == pytest.approx(0.5 + d.predicted_recompute_all_s - d.predicted_compute_s)
    assert load_deadline_s(0.1, 0.01, 0.17, compute_wait_s=0.5) == pytest.approx(0.66)


@pytest.mark.parametrize("bad", [-0.001, math.nan, math.inf])
def test_a_bad_compute_wait_is_refused(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="compute_wait_s"):
        decide_reuse(HIT, BLOCK, PROMPT, NBYTES, LINK, RECOMPUTE, compute_wait_s=bad)


def test_compute_queue_counts_registered_started_and_released_forwards() -> None:
    clock = Clock()
    q = ComputeQueue(ttl_s=5.0, clock=clock)
    a, b, c = q.register(0.04), q.register(0.03), q.register(0.02)
    assert q.ahead_s() == pytest.approx(0.09) and len(q) == 3
    q.start(a)
    clock.now += 0.01  # a has run 10 ms of its 40
    assert q.ahead_s() == pytest.approx(0.08)
    clock.now += 0.1  # a overran its prediction: it counts 0, never negative
    assert q.ahead_s() == pytest.approx(0.05)
    assert q.release(a) and not q.release(a)  # exactly once
    assert not q.release(None) and not q.release(12345)
    q.start(None)
    q.start(99999)  # unknown: nothing
    assert q.ahead_s() == pytest.approx(0.05)
    clock.now += 5.0  # b and c were never started nor released: they expire
    assert q.ahead_s() == 0.0 and len(q) == 0 and q.num_expired == 2
    assert not q.release(b) and not q.release(c)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_compute_queue_refuses_a_bad_prediction(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="predicted_s"):
        ComputeQueue().register(bad)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        ComputeQueue(ttl_s=0.0)


class _Master:
    """The master's answer for one 10-block prefix held by one store (no RPC: the decision is under test)."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes

    def match(self, ns: bytes, hashes: list[bytes], **_: Any) -> Match:
        replicas = [(Location(node_id="s1", slot=i, generation=1),) for i in range(len(hashes))]
        store = NodeInfo(node_id="s1", role="store", grpc_address="", data_address=PEER, epoch=1)
        return Match(num_matched=len(hashes), replicas=replicas, lease_id=7, nodes={"s1": store})

    def release_leases(self, ids: list[int]) -> tuple[int, int]:
        return len(ids), 0


class _Transport:
    def link(self, address: str) -> LinkEstimate:
        return LinkEstimate(alpha_s=0.001, beta_bytes_per_s=3e7)  # slower than recompute alone


def _connector(forwards: ComputeQueue | None, hashes: list[bytes]) -> KVConnector:
    return KVConnector(
        master=_Master(hashes),  # type: ignore[arg-type]
        pool=None,
        transport=_Transport(),  # type: ignore[arg-type]
        node_id="n1",
        block_size=BLOCK,
        block_nbytes=NBYTES,
        recompute=RECOMPUTE,
        local_tier=LocalTier(0),
        margin=0.1,
        forwards=forwards,
    )


NS = b"\x01" * 16
TOKENS = list(range(3, 3 + PROMPT))


def test_the_connector_decides_with_the_forwards_queued_on_its_model() -> None:
    ns, tokens, hashes = NS, TOKENS, hash_blocks(NS, TOKENS, BLOCK)
    forwards = ComputeQueue()
    conn = _connector(forwards, hashes)
    try:
        first = conn.plan_load(ns, tokens, hashes, count_hit=True)
        assert first.num_load_blocks < HIT and first.stats.compute_wait_s == 0.0  # idle: a plain choice
        conn.release(first)
        for _ in range(3):  # three full forwards queued ahead (170 ms each)
            forwards.register(RECOMPUTE.t_recompute_s(PROMPT, 0))
        plan = conn.plan_load(ns, tokens, hashes, count_hit=True)
        assert plan.stats.compute_wait_s == pytest.approx(3 * RECOMPUTE.t_recompute_s(PROMPT, 0))
        assert plan.num_load_blocks == HIT and plan.stats.decision == "pull"
        conn.release(plan)
    finally:
        conn.close()
    plain = _connector(None, hashes)  # a connector with no compute queue decides as before
    try:
        plan = plain.plan_load(ns, tokens, hashes, count_hit=True)
        assert plan.num_load_blocks < HIT and plan.stats.compute_wait_s == 0.0
        plain.release(plan)
    finally:
        plain.close()


def test_a_load_that_raises_takes_its_forward_out_of_the_queue() -> None:
    ns, tokens, hashes = NS, TOKENS, hash_blocks(NS, TOKENS, BLOCK)
    forwards = ComputeQueue()
    conn = _connector(forwards, hashes)

    def broken_pull(*args: Any, **kwargs: Any) -> list[Any]:
        raise RuntimeError("a bug in the transfer half")  # a pool failure never raises; a bug may

    conn.pull = broken_pull  # type: ignore[method-assign]
    try:
        ahead = forwards.register(1.0)  # queued ahead: this load pulls
        with pytest.raises(RuntimeError, match="a bug"):
            conn.load_prefix(ns, tokens, hashes, count_hit=True)
        assert len(forwards) == 1 and forwards.release(ahead)  # only the one queued ahead was left
        assert conn.pulls.in_flight(PEER).num_pulls == 0
    finally:
        conn.close()
