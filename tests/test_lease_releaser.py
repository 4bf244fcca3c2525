"""Read leases are released off the request path (`kvpool.connector.releaser`), in batches, against a real
master over gRPC (an in-process server on 127.0.0.1:0; its blocks put straight into the index).

A "paused" master is the real one with its state lock held by the test, as a long maintenance pass holds
it: every `ReleaseLeases` waits on it, matches already answered keep their leases.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from kvpool.client import MasterClient
from kvpool.connector.connector import FORCE_DECISION_ENV, KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.connector.plan import LoadPlan
from kvpool.connector.recent import RecentMatches
from kvpool.cost import RecomputeModel
from kvpool.master.server import MasterServer, serve
from kvpool.rpc.server import channel
from kvpool.types import FakeClock
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.test_master_bounded_state import FP, LAY, chain, put, settings

NUM_BLOCKS = 4
TOKENS = list(range(NUM_BLOCKS * LAY.block_size + 1))
TTL_MS = 10_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000)


@pytest.fixture
def server(clock: FakeClock) -> Iterator[MasterServer]:
    s = serve(settings(), clock=clock)
    try:
        yield s
    finally:
        s.stop()


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def connector(master: MasterClient) -> KVConnector:
    return KVConnector(
        master=master, pool=None, transport=None, node_id="p1", block_size=LAY.block_size,  # type: ignore[arg-type]
        block_nbytes=LAY.block_nbytes, local_tier=LocalTier(0), lease_ttl_ms=TTL_MS,
        recompute=RecomputeModel(overhead_s=0.001, per_token_s=1e-3, per_pair_s=0.0),
    )  # fmt: skip


def leased_plans(
    server: MasterServer, c: MasterClient, conn: KVConnector, n: int, monkeypatch: pytest.MonkeyPatch
) -> list[LoadPlan]:
    """`n` plans that each hold a read lease (decided to pull, the pull not run yet)."""
    ns, _ = c.register_namespace("m", "v1", FP)
    hashes = chain(ns, 0, NUM_BLOCKS)
    put(server.master, ns, hashes)
    monkeypatch.setenv(FORCE_DECISION_ENV, "pull")
    plans = [conn.plan_load(ns, TOKENS, hashes, count_hit=True) for _ in range(n)]
    assert all(p.lease_id for p in plans) and c.stats().num_live_leases == n
    return plans


def test_a_release_never_waits_for_a_paused_master_and_goes_out_batched(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 30
    with MasterClient(server.address, timeout_s=1.0) as c:
        conn = connector(c)
        plans = leased_plans(server, c, conn, n, monkeypatch)
        m = server.master
        with m.lock:  # the master paused: a ReleaseLeases waits for it
            t0 = time.perf_counter()
            for p in plans:
                conn.release(p)
            elapsed_s = time.perf_counter() - t0
            time.sleep(0.3)  # the releaser is blocked on the master meanwhile
            assert m.index.num_live_leases == n
        assert elapsed_s < 3.0, (
            f"{n} releases took {elapsed_s:.3f} s on the request path"
        )  # queued: ~1 ms in all; sync: >= 1 s each (the client's timeout), 30 s in all
        assert wait_until(lambda: c.stats().num_live_leases == 0), "the leases were never released"
        assert conn.releaser.num_sent == n and conn.releaser.num_failed == 0
        assert conn.releaser.num_batches <= 2  # the first id alone, the rest queued behind it: one call
        conn.close()


def test_the_recompute_path_releases_through_the_releaser(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A match answered and then recomputed (most of a burst) releases its lease in `plan_load`."""
    with MasterClient(server.address) as c:
        conn = connector(c)
        conn.recent = RecentMatches(ttl_s=0)  # every request asks the master (none shares an answer)
        ns, _ = c.register_namespace("m", "v1", FP)
        hashes = chain(ns, 0, NUM_BLOCKS)
        put(server.master, ns, hashes)
        monkeypatch.setenv(FORCE_DECISION_ENV, "recompute")
        for _ in range(5):
            plan = conn.plan_load(ns, TOKENS, hashes, count_hit=True)
            assert plan.stats.num_pool_blocks == NUM_BLOCKS and plan.num_load_blocks == 0
            assert plan.lease_id is None  # handed to the releaser
        assert wait_until(lambda: c.stats().num_live_leases == 0)
        assert conn.releaser.num_sent == 5
        conn.close()


def test_close_flushes_the_queued_releases_and_later_ones_go_out_at_once(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MasterClient(server.address, timeout_s=5.0) as c:
        conn = connector(c)
        plans = leased_plans(server, c, conn, 11, monkeypatch)
        m = server.master
        closer = threading.Thread(target=conn.close, kwargs={"timeout_s": 5.0})
        with m.lock:
            for p in plans[:10]:
                conn.release(p)
            closer.start()
            time.sleep(0.3)
            assert closer.is_alive(), "close returned before the queued releases were sent"
        closer.join(5.0)
        assert not closer.is_alive()
        with m.lock:
            assert m.index.num_live_leases == 1  # no waiting: close sent the ten
        conn.release(plans[10])  # after close: sent in the caller's thread
        with m.lock:
            assert m.index.num_live_leases == 0
        assert conn.releaser.num_sent == 11


def test_close_gives_up_at_its_timeout_and_starts_no_call_after(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master that does not answer cannot hold a node's shutdown: what is still queued at the timeout is
    left to expire, and no call starts after `close` returned (the master link may then be closed)."""
    with MasterClient(server.address, timeout_s=5.0) as c:
        conn = connector(c)
        plans = leased_plans(server, c, conn, 6, monkeypatch)
        m = server.master
        with m.lock:
            conn.release(plans[0])
            time.sleep(0.2)  # its call is out, waiting on the master
            for p in plans[1:]:
                conn.release(p)
            t0 = time.perf_counter()
            conn.close(timeout_s=0.3)
            assert time.perf_counter() - t0 < 1.5  # 5x its timeout; waiting for the 5 queued calls: >= 5 s
            assert conn.releaser.num_failed == 5
        assert wait_until(lambda: conn.releaser.num_sent == 1)  # the call in flight completes
        time.sleep(0.2)
        assert conn.releaser.num_batches == 1 and c.stats().num_live_leases == 5  # and no other started


def test_a_failed_release_is_logged_once_and_the_lease_expires(
    server: MasterServer, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with MasterClient(server.address) as c:
        conn = connector(c)
        plans = leased_plans(server, c, conn, 3, monkeypatch)
        with socket.socket() as s:  # the master's link lost: a port with nothing listening
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        conn.master = MasterClient(f"127.0.0.1:{port}", timeout_s=0.5)
        try:
            with caplog.at_level(logging.WARNING, logger="kvpool.connector.releaser"):
                for p in plans:
                    conn.release(p)
                assert conn.releaser.flush(10.0)
        finally:
            conn.master.close()
        warned = [r for r in caplog.records if "expire at their TTL" in r.getMessage()]
        assert 1 <= len(warned) <= conn.releaser.num_batches <= 3  # one line per failed batch, not per retry
        assert conn.releaser.num_failed == 3 and conn.releaser.num_sent == 0
        assert c.stats().num_live_leases == 3
        clock.advance(TTL_MS + 1)
        assert c.stats().num_live_leases == 0  # each lease ended on its own
        conn.close()


def test_release_leases_rpc_validates_and_counts(
    server: MasterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with MasterClient(server.address) as c:
        conn = connector(c)
        plans = leased_plans(server, c, conn, 3, monkeypatch)
        ids = [p.lease_id for p in plans if p.lease_id]
        assert c.release_leases([*ids[:2], 987_654]) == (2, 1)  # an unknown id is counted, the others end
        assert c.release_leases([ids[0], ids[2]]) == (1, 1)  # released before: counted, not an error
        assert c.stats().num_live_leases == 0
        conn.close()
    ch = channel(server.address)
    try:
        stub = pb_grpc.MasterStub(ch)
        for bad, words in (([], "1..1024"), ([1] * 1025, "1..1024"), ([5, 0], "> 0")):
            with pytest.raises(grpc.RpcError) as err:
                stub.ReleaseLeases(pb.ReleaseLeasesRequest(lease_ids=bad), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    finally:
        ch.close()
