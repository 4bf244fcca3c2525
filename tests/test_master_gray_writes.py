"""Gray failures counted in failures, not seconds (issue #39, item 3): the master counts, at each commit, the
slots a reservation placed on a store that were not written; a store that left slots unwritten at
`fail_after` commits in a row gets no new reservation while a healthy store has room, whatever the publish
rate, while one transient error takes no store out. In-process master over gRPC, an injected clock."""

from __future__ import annotations

from kvpool.client import MasterClient
from kvpool.client.types import CommitBlock
from kvpool.hashing import hash_blocks
from kvpool.master.server import MasterServer
from kvpool.types import FakeClock
from tests.test_master_dataplane import FP, LAY, clock, server  # noqa: F401 - the fixtures


def publish(c: MasterClient, ns: bytes, seed: int, failing: set[str], replicas: int = 1) -> list[str]:
    """Reserve one block and commit it with the writes to `failing` stores lost; the stores it was
    placed on."""
    hashes = hash_blocks(ns, [seed] * LAY.block_size, LAY.block_size)
    res = c.reserve(ns, None, hashes, num_replicas=replicas, block_nbytes=LAY.block_nbytes)
    b = res.blocks[0]
    written = tuple(x for x in b.locations if x.node_id not in failing)
    c.commit(res.reservation_id, [CommitBlock(b.block_hash, 1, written)] if written else [])
    return sorted(x.node_id for x in b.locations)


def test_a_store_failing_every_write_gets_no_reservation_after_fail_after_commits(
    server: MasterServer,  # noqa: F811
) -> None:
    m = server.master
    fail_after = m.dataplane_policy.fail_after
    with MasterClient(server.address) as c:
        ns, _ = c.register_namespace("m", "v1", FP)
        placed = [publish(c, ns, seed, {"s2"}) for seed in range(12)]
    on_s2 = [i for i, nodes in enumerate(placed) if nodes == ["s2"]]
    assert len(on_s2) == fail_after, placed  # counted in commits: then none, though s2 has the most room
    with m.lock:
        health = m.st.nodes["s2"].dataplane
        assert health.num_grayed == 1 and health.num_unwritten_slots == fail_after
        assert m.st.nodes["s2"].dataplane.state == "ok"  # reads from it are not affected


def test_one_transient_error_takes_no_store_out(server: MasterServer, clock: FakeClock) -> None:  # noqa: F811
    m = server.master
    with MasterClient(server.address) as c:
        ns, _ = c.register_namespace("m", "v1", FP)
        seen: list[list[str]] = []
        failed_once = False
        for seed in range(16):
            nodes = publish(c, ns, seed, set() if failed_once else {"s2"})
            failed_once = failed_once or nodes == ["s2"]
            seen.append(nodes)
        assert failed_once
        assert sum(nodes == ["s2"] for nodes in seen) > 2  # still placed on after its one failure
        with m.lock:
            assert m.st.nodes["s2"].dataplane.num_grayed == 0  # transient_store_failed: 0
            assert m.st.nodes["s2"].dataplane.write_streak == 0


def test_a_gray_store_is_placed_on_again_after_its_backoff_and_clears_on_a_written_commit(
    server: MasterServer,  # noqa: F811
    clock: FakeClock,  # noqa: F811
) -> None:
    m = server.master
    with MasterClient(server.address) as c:
        ns, _ = c.register_namespace("m", "v1", FP)
        for seed in range(10):
            publish(c, ns, seed, {"s2"})
        with m.lock:
            assert m.st.nodes["s2"].dataplane.num_grayed == 1
        assert publish(c, ns, 100, set(), replicas=2) == ["s1", "s2"]  # a gray store: a last resort
        clock.advance(m.dataplane_policy.backoff_ms + 1)
        back = [publish(c, ns, 200 + seed, set()) for seed in range(6)]
        assert ["s2"] in back  # tried again after its back-off; the write landed
        with m.lock:
            assert m.st.nodes["s2"].dataplane.write_streak == 0
            assert m.st.nodes["s2"].dataplane.gray_until_ms == 0
