"""The connector's decisions without a cluster: degraded mode (B19), local tier, reuse limits (B06)."""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np
import pytest

from kvpool.connector.breaker import PoolBreaker
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import RecomputeModel
from kvpool.errors import Unavailable

BLOCK, NBYTES = 4, 64
NS = b"n" * 16


class DownMaster:
    """A master that refuses every call, counting them."""

    def __init__(self) -> None:
        self.calls = 0

    def match(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise Unavailable("connection refused")

    def release_lease(self, lease_id: int) -> None:
        self.calls += 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(master: Any, *, breaker: PoolBreaker | None = None, tier_bytes: int = 0) -> KVConnector:
    return KVConnector(
        master=master, pool=None, transport=None, node_id="n1", block_size=BLOCK, block_nbytes=NBYTES,
        recompute=RecomputeModel(overhead_s=0.001, per_token_s=1e-4, per_pair_s=0.0),
        local_tier=LocalTier(tier_bytes), breaker=breaker,
    )  # fmt: skip


def test_pool_down_degrades_then_probe_restores_b19() -> None:
    clock = Clock()
    master = DownMaster()
    conn = make(master, breaker=PoolBreaker(max_failures=3, probe_interval_s=5.0, clock=clock))
    hashes = [bytes([i]) * 16 for i in range(4)]
    tokens = list(range(17))
    for _ in range(3):  # each request still completes: a miss, then recompute
        assert conn.load_prefix(NS, tokens, hashes, count_hit=True).stats.num_reused_tokens == 0
    assert master.calls == 3 and conn.breaker.degraded
    for _ in range(10):  # degraded: 0 remote calls per request
        out = conn.load_prefix(NS, tokens, hashes, count_hit=True)
        assert out.stats.decision == "degraded"
    assert master.calls == 3
    clock.now = 5.0  # one probe per interval
    conn.load_prefix(NS, tokens, hashes, count_hit=True)
    conn.load_prefix(NS, tokens, hashes, count_hit=True)
    assert master.calls == 4
    conn.master = _UpMaster()
    clock.now = 10.0
    conn.load_prefix(NS, tokens, hashes, count_hit=True)
    assert not conn.breaker.degraded


def test_the_master_back_lets_the_next_request_probe_at_once() -> None:
    """A heartbeat that reaches the master again (`MasterLink.on_reconnect`) ends the wait for the next
    probe: the pool's hits come back within a heartbeat, not a probe interval, of the master's return."""
    clock = Clock()
    master = DownMaster()
    conn = make(master, breaker=PoolBreaker(max_failures=1, probe_interval_s=5.0, clock=clock))
    hashes, tokens = [bytes([i]) * 16 for i in range(4)], list(range(17))
    conn.load_prefix(NS, tokens, hashes, count_hit=True)
    assert conn.breaker.degraded and master.calls == 1
    clock.now = 1.0
    conn.breaker.probe_soon()  # (not degraded: nothing; degraded: the next call probes)
    conn.master = _UpMaster()
    assert conn.load_prefix(NS, tokens, hashes, count_hit=True).stats.decision != "degraded"
    assert not conn.breaker.degraded
    conn.breaker.probe_soon()  # not degraded: no effect
    assert conn.breaker.allow()


class _UpMaster:
    def match(self, ns: bytes, hashes: list[bytes], **kwargs: Any) -> Any:
        from kvpool.client import Match

        return Match(num_matched=0, replicas=[], lease_id=None, nodes={})

    def release_lease(self, lease_id: int) -> None:
        pass


def test_refused_master_is_a_fast_miss_b19() -> None:
    from kvpool.client import MasterClient

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = MasterClient(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        conn = make(master)
        t0 = time.perf_counter()
        out = conn.load_prefix(NS, list(range(17)), [bytes([i]) * 16 for i in range(4)], count_hit=True)
        assert out.stats.num_reused_tokens == 0
        # a refused connection answers at once (~ms): far below the 10 s deadline it would otherwise wait out
        assert time.perf_counter() - t0 < 2.0
    finally:
        master.close()


def test_full_prompt_reuses_all_but_the_last_token_b06() -> None:
    conn = make(DownMaster())
    assert conn.max_reusable_blocks(8) == 1  # 2 full blocks: the last token is recomputed
    assert conn.max_reusable_blocks(9) == 2
    assert conn.max_reusable_blocks(3) == 0


def test_local_tier_serves_leading_run_without_the_pool() -> None:
    master = DownMaster()
    conn = make(master, breaker=PoolBreaker(max_failures=1, probe_interval_s=60), tier_bytes=10 * NBYTES)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for parent, h in zip([None, *hashes[:2]], hashes[:3], strict=True):
        conn.local_tier.put(NS, h, np.full(NBYTES, h[0], dtype=np.uint8), parent=parent)
    conn.load_prefix(NS, list(range(17)), hashes, count_hit=True)  # trips the breaker
    calls = master.calls
    out = conn.load_prefix(NS, list(range(17)), hashes, count_hit=True)
    assert master.calls == calls  # degraded: no pool call, yet the node-local tier still serves
    assert out.stats.num_local_tokens == 3 * BLOCK
    assert [b[0] for b in out.blocks] == [0, 1, 2]


def test_local_tier_is_namespaced_and_bounded() -> None:
    tier = LocalTier(2 * NBYTES)
    a, b = b"a" * 16, b"b" * 16
    tier.put(NS, a, np.zeros(NBYTES, dtype=np.uint8), parent=None)
    assert tier.get(b"x" * 16, a) is None  # another namespace (tenant, version) never sees it
    tier.put(NS, b, np.zeros(NBYTES, dtype=np.uint8), parent=None)
    tier.put(NS, b"c" * 16, np.zeros(NBYTES, dtype=np.uint8), parent=None)
    assert tier.used_bytes == 2 * NBYTES and tier.get(NS, a) is None
    block = tier.get(NS, b)
    assert block is not None and not block.flags.writeable
    with pytest.raises(ValueError):
        LocalTier(-1)


@pytest.mark.parametrize(
    ("error", "bad"),
    [
        ("checksum mismatch: got 0x1, peer sent 0x2", True),
        ("StaleGeneration: slot 3 is at generation 5, not 4", True),
        ("FailedPrecondition: slot 3 is RESERVED, not written", True),
        ("TransferError: cannot connect to 10.0.0.2:1234: timed out", False),
        ("transfer to 127.0.0.1:1 failed: deadline of 2 s passed", False),
        ("connection lost: Endpoint timeout", False),
    ],
)
def test_only_proven_bad_replicas_are_reported(error: str, bad: bool) -> None:
    from kvpool.connector.pull import is_replica_fault

    assert is_replica_fault(error) is bad


def test_unmeasured_links_are_ignored_not_divided_by() -> None:
    """A store whose probe measured no bandwidth (beta 0) gives no estimate; the others still do."""
    from transfer import LinkEstimate

    class Links:
        def link(self, peer: str) -> LinkEstimate:
            if peer == "dead:1":
                raise ConnectionError("refused")
            return LinkEstimate(1e-4, 0.0 if peer == "unprobed:1" else 1e9, 1)

    c = make(DownMaster())
    c.transport = Links()
    assert c.link_to_pool(["unprobed:1", "dead:1"]) is None
    link = c.link_to_pool(["unprobed:1", "ok:1", "dead:1"])
    assert link is not None and link.beta_bytes_per_s == 1e9


class _RecordingMaster:
    """Records `report_local` calls; `committed` is what the (fake) pool has committed so far."""

    def __init__(self) -> None:
        self.committed: set[bytes] = set()
        self.reported: list[tuple[list[bytes], list[bytes], set[bytes]]] = []

    def report_local(self, node_id: str, epoch: int, ns: bytes, *, stored: Any, removed: Any) -> None:
        self.reported.append((list(stored), list(removed), set(self.committed)))


class _Pool:
    """Commits after a heartbeat fired mid-publish (the race a new-user pass found)."""

    def __init__(self, master: _RecordingMaster, conn: Any) -> None:
        self.master, self.conn = master, conn

    def put_blocks(self, ns: bytes, parent: Any, hashes: list[bytes], blocks: Any, **kwargs: Any) -> Any:
        from kvpool.client.types import PutResult

        self.conn.report_local_events(1)  # the heartbeat thread reports while the publish is in flight
        self.master.committed.update(hashes)
        return PutResult(len(hashes), 0, 0, 1)


def test_local_copies_are_reported_only_once_the_master_holds_the_blocks() -> None:
    """A stored event the master got before the block's commit was dropped for good (the master only
    records local copies of blocks its index holds), so the router never saw the node warm."""
    master = _RecordingMaster()
    conn = make(master, tier_bytes=16 * NBYTES)
    conn.pool = _Pool(master, conn)
    hashes = [bytes([i]) * 16 for i in range(3)]
    blocks = [np.full(NBYTES, i, dtype=np.uint8) for i in range(3)]
    assert conn.publish(NS, hashes, blocks, start_block=0) == (3, 0)
    conn.report_local_events(1)
    stored = [(h, committed) for s, _, committed in master.reported for h in s]
    assert sorted(h for h, _ in stored) == sorted(hashes)  # every block reported once...
    assert all(h in committed for h, committed in stored)  # ...after its commit


def test_local_tier_events_keep_each_blocks_last_state() -> None:
    tier = LocalTier(2 * NBYTES)
    a, b, c = (bytes([i]) * 16 for i in range(3))
    tier.put(NS, a, np.zeros(NBYTES, np.uint8), parent=None)
    tier.put(NS, b, np.zeros(NBYTES, np.uint8), parent=None, report=False)
    tier.put(NS, c, np.zeros(NBYTES, np.uint8), parent=None)  # evicts a: stored then removed -> only removed
    tier.report_stored(NS, [a, b])  # a is gone: not reported as held
    [(ns, stored, removed)] = tier.drain_events()
    assert ns == NS and sorted(stored) == sorted([b, c]) and removed == [a]
    assert tier.drain_events() == []
    tier.clear()
    [(ns, stored, removed)] = tier.drain_events()
    assert ns == NS and stored == [] and sorted(removed) == sorted([b, c])


def test_kv_is_published_under_the_flush_epoch_its_load_began_with() -> None:
    """Found by a new-user pass: after `admin invalidate` under load the pool refilled within a second
    from KV computed before the flush (a node's local tier, a request in flight). A load now records the
    master's flush epoch the node knew when it began; the publish carries it, so the master refuses KV
    computed before a flush. When a heartbeat shows the epoch moved, the local tier is dropped first."""
    master = _RecordingMaster()
    conn = make(master, tier_bytes=16 * NBYTES)
    calls: list[Any] = []

    class Pool:
        def put_blocks(self, ns: bytes, parent: Any, hashes: list[bytes], blocks: Any, **kwargs: Any) -> Any:
            from kvpool.client.types import PutResult

            calls.append(kwargs.get("flush_epoch"))
            return PutResult(len(hashes), 0, 0, 1)

    conn.pool = Pool()
    h = [bytes([9, i]) * 8 for i in range(2)]
    conn.note_flush_epoch(3)
    conn.local_tier.put(NS, h[0], np.zeros(NBYTES, np.uint8), parent=None)
    loaded = conn.load_prefix(NS, list(range(3 * BLOCK)), h, count_hit=True, use_cache=False)
    assert loaded.flush_epoch == 3
    conn.note_flush_epoch(3)
    assert len(conn.local_tier) == 1  # the same epoch: nothing dropped
    conn.note_flush_epoch(4)  # a namespace was invalidated meanwhile
    assert len(conn.local_tier) == 0 and conn.flush_epoch == 4
    conn.publish(NS, h, [np.zeros(NBYTES, np.uint8)] * 2, start_block=0, flush_epoch=loaded.flush_epoch)
    assert calls == [3]  # the old epoch goes to the master, which refuses it


def test_a_nodes_metrics_say_when_it_runs_degraded() -> None:
    """Status tells the truth (issue #29): a serving node's /metrics show its degraded mode, since when,
    and the pool calls it skipped."""
    import time as _time

    from prometheus_client import generate_latest

    from kvpool.serving.metrics import ServingMetrics
    from tests.test_router_failover import _metric

    clock = Clock()
    breaker = PoolBreaker(max_failures=1, probe_interval_s=5.0, clock=clock)
    metrics = ServingMetrics("prefill")
    metrics.watch_breaker(breaker)

    def scrape(name: str) -> float:
        return _metric(generate_latest(metrics.registry).decode(), name)

    assert (
        scrape("kvpool_prefill_pool_degraded") == 0
        and scrape("kvpool_prefill_pool_degraded_since_seconds") == 0
    )
    t0 = _time.time()
    breaker.record(False)
    assert not breaker.allow() and not breaker.allow()
    assert scrape("kvpool_prefill_pool_degraded") == 1
    assert t0 - 1 <= scrape("kvpool_prefill_pool_degraded_since_seconds") <= _time.time()
    assert scrape("kvpool_prefill_pool_calls_skipped_total") == 2
    breaker.record(True)
    assert (
        scrape("kvpool_prefill_pool_degraded") == 0
        and scrape("kvpool_prefill_pool_degraded_since_seconds") == 0
    )
