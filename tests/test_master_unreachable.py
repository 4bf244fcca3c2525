"""A store node that stops answering but is not (yet) dead: the master places new blocks elsewhere.

Real master and store processes on 127.0.0.1; the store is frozen with SIGSTOP (it holds its sockets but
answers nothing: the shape of a node cut off the network). The heartbeat timeout is long, so it stays
alive in the registry the whole time; placement must go around it anyway, and come back once it answers.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start, start_store
from tests.capabilities import require_ucx
from tests.test_master_cluster import LAY, blocks_for, wait_stores

transfer = pytest.importorskip("transfer")


@pytest.fixture
def cluster() -> Iterator[tuple[Proc, list[Proc]]]:
    require_ucx()
    master = start(
        ["master", "--port", "0", "--layout", LAYOUT, "--heartbeat-timeout-ms", "60000"],
        env={"KVPOOL_STORE_TIMEOUT_S": "1.0"},
    )
    stores: list[Proc] = []
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(2)]
        wait_stores(master.grpc_address, 2)
        yield master, stores
    finally:
        for s in stores:
            s.popen.send_signal(signal.SIGCONT)
            s.kill()
        master.kill()


def _publish_one(pool: PoolClient, master: MasterClient, ns: bytes, seed: int) -> str:
    """Publish one single-block prompt; the node its replica landed on ("" when the publish failed)."""
    hashes = hash_blocks(ns, [seed] * LAY.block_size, LAY.block_size)
    put = pool.put_blocks(ns, None, hashes, blocks_for(1, seed))
    if put.num_committed != 1:
        return ""
    m = master.match(ns, hashes)
    assert m.num_matched == 1
    return m.replicas[0][0].node_id


def test_a_silent_store_gets_no_new_blocks_until_it_answers_again(cluster, transport) -> None:
    master, stores = cluster
    with (
        MasterClient(master.grpc_address) as mc,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool,
    ):
        ns, _ = mc.register_namespace("unreachable", "v1", LAYOUT)
        before: set[str] = set()
        for seed in range(40):  # spread over both while both answer (s1 may be adopted a tick later)
            before.add(_publish_one(pool, mc, ns, seed))
            if before == {"s0", "s1"}:
                break
            time.sleep(0.1)
        assert before == {"s0", "s1"}

        stores[1].popen.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # > the master's stale_after_ms (2 s): no heartbeat from s1 since
        during = [_publish_one(pool, mc, ns, 100 + seed) for seed in range(8)]
        assert during == ["s0"] * 8, during  # none placed on the frozen node, none failed
        assert {n.node.node_id for n in mc.list_nodes() if n.alive} >= {"s0", "s1"}  # still alive

        stores[1].popen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        after: list[str] = []
        while "s1" not in after and time.monotonic() < deadline:
            time.sleep(0.5)
            after.append(_publish_one(pool, mc, ns, 200 + len(after)))
        assert "s1" in after, after  # placements come back once it heartbeats again


@pytest.fixture
def transport() -> Iterator[object]:
    t = transfer.UcxTransport()
    yield t
    t.close()


def test_a_connect_to_a_frozen_store_times_out_and_its_late_answer_is_harmless(cluster, transport) -> None:
    """The data-plane connect to a store that does not answer gives up after its timeout; when the store
    wakes, ucxx finishes that abandoned handshake late. That must not write into freed memory (it did:
    ucxx's own peer-info timeout freed the receive buffer, `transfer.ucx_runtime.connect_endpoint`) and
    the next read over a fresh connection returns the right bytes."""
    master, stores = cluster
    with MasterClient(master.grpc_address) as mc:
        ns, _ = mc.register_namespace("late-connect", "v1", LAYOUT)
    hashes = hash_blocks(ns, list(range(LAY.block_size * 4)), LAY.block_size)
    data = blocks_for(4, 7)
    with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool:
        assert pool.put_blocks(ns, None, hashes, data, num_replicas=2).num_committed == 4
    fresh = transfer.UcxTransport(connect_timeout_s=0.5, probe_bytes=0, probe_pings=1)
    try:
        with PoolClient(
            master.grpc_address, fresh, block_nbytes=LAY.block_nbytes, transfer_timeout_s=1.0
        ) as reader:
            for s in stores:
                s.popen.send_signal(signal.SIGSTOP)
            try:
                cut = reader.get_blocks(ns, hashes, count_hit=False)
                assert cut.num_ok == 0  # nothing read, nothing wrong: the caller recomputes
                assert len(fresh.backoff.peers_down()) == 2  # both stores: skipped for a while
                again = reader.get_blocks(ns, hashes, count_hit=False)  # fails at once, no timeout
                assert again.num_ok == 0 and "backing off" in again.blocks[0].error, again.blocks[0]
            finally:
                for s in stores:
                    s.popen.send_signal(signal.SIGCONT)
            time.sleep(1.5)  # the stores answer the abandoned handshakes; the back-off (1 s) has passed
            for _ in range(3):
                got = reader.get_blocks(ns, hashes, count_hit=False)
                assert got.num_ok == 4
                assert all(b.data == d.tobytes() for b, d in zip(got.blocks, data, strict=True))
    finally:
        fresh.close()


def test_a_silent_store_is_not_offered_to_readers_until_it_heartbeats(cluster, transport) -> None:
    """Silence means out of matches too (issue #39): a store paused past `stale_after_ms` is not named in
    match answers (a block with a replica elsewhere is read from there, one only on the paused store ends
    the match: recomputed), and it is offered again from its next heartbeat."""
    master, stores = cluster
    with (
        MasterClient(master.grpc_address) as mc,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool,
    ):
        ns, _ = mc.register_namespace("silent-reads", "v1", LAYOUT)
        both = hash_blocks(ns, list(range(LAY.block_size * 3)), LAY.block_size)
        data = blocks_for(3, 5)
        assert pool.put_blocks(ns, None, both, data, num_replicas=2).num_committed == 3
        only_s1: list[bytes] = []
        for seed in range(40):  # a single-replica block that landed on s1
            hashes = hash_blocks(ns, [1000 + seed] * LAY.block_size, LAY.block_size)
            assert pool.put_blocks(ns, None, hashes, blocks_for(1, seed)).num_committed == 1
            if mc.match(ns, hashes).replicas[0][0].node_id == "s1":
                only_s1 = hashes
                break
            time.sleep(0.1)
        assert only_s1
        assert {x.node_id for locs in mc.match(ns, both).replicas for x in locs} == {"s0", "s1"}

        stores[1].popen.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.5)  # > the master's stale_after_ms (2 s): no heartbeat from s1 since
            m = mc.match(ns, both)
            assert m.num_matched == 3
            assert {x.node_id for locs in m.replicas for x in locs} == {"s0"}
            assert mc.match(ns, only_s1).num_matched == 0  # recomputed, not read from a paused store
            got = pool.get_blocks(ns, both, count_hit=False)
            assert got.num_ok == 3 and [b.data for b in got.blocks] == [bytes(x) for x in data]
        finally:
            stores[1].popen.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while mc.match(ns, only_s1).num_matched == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mc.match(ns, only_s1).num_matched == 1  # back from its next heartbeat
        assert {x.node_id for locs in mc.match(ns, both).replicas for x in locs} == {"s0", "s1"}
