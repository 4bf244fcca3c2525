"""A real master and two real store nodes on 127.0.0.1: publish, match, read back, versions, leases, admin."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import MasterClient, PoolClient
from kvpool.errors import FailedPrecondition, VersionFenced
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from kvpool.types import KVLayout
from tests.capabilities import require_ucx

LAY = KVLayout.from_fingerprint(LAYOUT)
transfer = pytest.importorskip("transfer")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, list[Proc]]]:
    require_ucx()
    master = start_master("--heartbeat-timeout-ms", "3000")
    stores: list[Proc] = []
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(2)]
        wait_stores(master.grpc_address, 2)
        yield master, stores
    finally:
        for s in stores:
            s.kill()
        master.kill()


def wait_stores(address: str, n: int, timeout_s: float = 20.0) -> None:
    """Wait until `n` store nodes are alive and accept placements."""
    deadline = time.monotonic() + timeout_s
    with MasterClient(address) as c:
        while time.monotonic() < deadline:
            alive = [x for x in c.list_nodes() if x.alive and x.node.role == "store"]
            if len(alive) >= n:
                time.sleep(0.3)  # inventories adopted on the next maintenance tick
                return
            time.sleep(0.05)
    raise TimeoutError(f"{n} store nodes did not register")


def blocks_for(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, LAY.block_nbytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture(scope="module")
def transport() -> Iterator[object]:
    t = transfer.UcxTransport()
    yield t
    t.close()


def test_publish_then_match_from_another_client_reads_bit_exact(cluster, transport) -> None:
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, active = c.register_namespace("exact", "v1", LAYOUT)
    assert active == "v1"
    hashes = hash_blocks(ns, list(range(64 * 5)), LAY.block_size)
    data = blocks_for(5, 1)
    with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as writer:
        put = writer.put_blocks(ns, None, hashes, data)
        assert (put.num_committed, put.num_existing, put.num_failed) == (5, 0, 0)
        assert writer.put_blocks(ns, None, hashes, data).num_existing == 5  # idempotent
    with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as reader:
        got = reader.get_blocks(ns, [*hashes, b"\x01" * 16], num_prompt_tokens=64 * 6 + 3)
        assert got.num_matched == 5 and got.num_ok == 5
        assert all(b.data == d.tobytes() for b, d in zip(got.blocks, data, strict=True))
        assert reader.exists(ns, hashes) == 5
    with MasterClient(master.grpc_address) as c:
        s = c.stats()
        assert s.requested_tokens >= 64 * 6 + 3 and s.hit_tokens >= 64 * 5
        assert s.num_live_leases == 0  # get_blocks released its lease


def test_two_replicas_land_on_distinct_nodes(cluster, transport) -> None:
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("repl", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64 * 3)), LAY.block_size)
        with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pc:
            put = pc.put_blocks(ns, None, hashes, blocks_for(3, 2), num_replicas=2)
        assert put.num_replicas_placed == 2 and put.num_committed == 3
        m = c.match(ns, hashes)
        assert m.num_matched == 3
        for replicas in m.replicas:
            assert len({loc.node_id for loc in replicas}) == 2
        assert set(m.nodes) == {"s0", "s1"} and all(n.data_address for n in m.nodes.values())
        # asking for more replicas than nodes exist places fewer, and says so
        more = hash_blocks(ns, list(range(1000, 1064)), LAY.block_size)
        res = c.reserve(ns, None, more, num_replicas=5)
        assert res.num_replicas_placed == 2
        c.abort(res.reservation_id)


def test_version_switch_fences_old_namespace(cluster, transport) -> None:
    master, _ = cluster
    with (
        MasterClient(master.grpc_address) as c,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pc,
    ):
        v1, _ = c.register_namespace("llm", "v1", LAYOUT)
        hashes = hash_blocks(v1, list(range(64 * 2)), LAY.block_size)
        assert pc.put_blocks(v1, None, hashes, blocks_for(2, 3)).num_committed == 2
        late = hash_blocks(v1, list(range(500, 564)), LAY.block_size)
        res = c.reserve(v1, None, late)  # a v1 writer starts a publish before the switch
        assert c.set_model_version("llm", "v2", force=True) == ("v1", 1, 2)  # 2 blocks unreachable
        v2, active = c.register_namespace("llm", "v2", LAYOUT)
        assert active == "v2" and v2 != v1
        assert c.match(v1, hashes).num_matched == 0
        assert c.match(v2, hash_blocks(v2, list(range(64 * 2)), LAY.block_size)).num_matched == 0
        with pytest.raises(VersionFenced):
            c.commit(res.reservation_id, [])
        with pytest.raises(VersionFenced):
            pc.put_blocks(v1, None, late, blocks_for(1, 4))


def test_unreleased_leases_expire(cluster) -> None:
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("leases", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64)), LAY.block_size)
        res = c.reserve(ns, None, hashes)
        # commit without bytes is refused by the stores: nothing becomes visible
        c.abort(res.reservation_id)
        with PoolClient(master.grpc_address, transfer.UcxTransport(), block_nbytes=LAY.block_nbytes) as pc:
            pc.put_blocks(ns, None, hashes, blocks_for(1, 5))
            pc.transport.close()
        started = time.monotonic()
        for _ in range(1000):
            assert c.match(ns, hashes, count_hit=True, lease_ttl_ms=4000).lease_id is not None
        if time.monotonic() - started < 3.5:
            assert c.stats().num_live_leases >= 1000
        deadline = time.monotonic() + 10
        while c.stats().num_live_leases and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.stats().num_live_leases == 0
        assert c.evict(1.0)[0] >= 1  # nothing stays pinned: the pool can still evict


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["nodes"],
        ["stats"],
        ["match", "1,2,3", "--model", "adm", "--version", "v1", "--layout", LAYOUT],
        ["set-version", "--model", "adm2", "--version", "v9", "--force"],
        ["evict", "--fraction", "0.01"],
        ["economics", "--model-params", "1e9", "--window", "0.1"],
    ],
)
def test_admin_commands(cluster, args: list[str]) -> None:
    master, _ = cluster
    runner = CliRunner()
    table = runner.invoke(app, ["admin", "--master", master.grpc_address, *args])
    assert table.exit_code == 0, table.output
    as_json = runner.invoke(app, ["admin", "--master", master.grpc_address, *args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    json.loads(as_json.output)


def test_admin_set_version_warns_when_no_node_serves_that_version(cluster) -> None:
    """Found by a new-user pass: `set-version` with a typo'd version answered rc 0 and silently fenced the
    live version (every publish then failed). Now it is refused (issue #26); `--force` still sets it
    (activating a version ahead of its rollout is how a weight change fences the old KV, B28) and says
    that nothing of the model is served at it."""
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        c.register_namespace("warnme", "v1", LAYOUT)
    runner = CliRunner()
    base = ["admin", "--master", master.grpc_address, "set-version", "--model", "warnme"]
    refused = runner.invoke(app, [*base, "--version", "v1-typo"])
    assert refused.exit_code == 1 and "in use: v1" in refused.output, refused.output
    typo = runner.invoke(app, [*base, "--version", "v1-typo", "--force"])
    assert typo.exit_code == 0, typo.output
    assert "warning: no node has registered 'warnme' at version 'v1-typo' (registered: v1)" in typo.output
    back = runner.invoke(app, [*base, "--version", "v1", "--json"])
    assert back.exit_code == 0 and "warning" not in back.output, back.output
    assert json.loads(back.stdout)["registered_versions"] == ["v1"]


def test_admin_match_peeks_without_registering_anything(cluster) -> None:
    """A peek by --model/--version computes the namespace as the nodes do; it used to register it, so a
    peek with a wrong version before any node registered made that version the model's active one."""
    master, _ = cluster
    runner = CliRunner()
    base = ["admin", "--master", master.grpc_address, "match", "1,2,3"]
    with MasterClient(master.grpc_address) as c:
        before = c.stats().num_namespaces
        out = runner.invoke(app, [*base, "--model", "peeked", "--version", "wrong", "--json"])
        assert out.exit_code == 0, out.output
        assert c.stats().num_namespaces == before
        ns, active = c.register_namespace("peeked", "right", LAYOUT)
        assert active == "right"  # the peek did not pin "wrong"
        out = runner.invoke(
            app, [*base, "--model", "peeked", "--version", "right", "--layout", LAYOUT, "--json"]
        )
        assert json.loads(out.output)["namespace"] == ns.hex()
    both = runner.invoke(app, [*base, "--namespace", ns.hex(), "--model", "peeked"])
    assert both.exit_code == 2  # a usage error: one or the other
    assert runner.invoke(app, [*base, "--model", "peeked"]).exit_code == 2  # no version


def test_admin_match_summarises_the_replicas_of_a_long_prompt(cluster, transport) -> None:
    """A 6,000-token prompt's table listed every block's replicas: one 41 KB-wide row. The table now counts
    blocks per holder; --json keeps each block's replicas."""
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("long-match", "v1", LAYOUT)
    tokens = list(range(64 * 96))
    hashes = hash_blocks(ns, tokens, LAY.block_size)
    with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pc:
        assert pc.put_blocks(ns, None, hashes, blocks_for(96, 3), num_replicas=2).num_committed == 96
    base = [
        "admin",
        "--master",
        master.grpc_address,
        "match",
        ",".join(map(str, tokens)),
        "--namespace",
        ns.hex(),
    ]
    table = CliRunner().invoke(app, base, env={"COLUMNS": "100"})
    assert table.exit_code == 0, table.output
    assert "s0: 96 blocks, s1: 96 blocks (--json: per block)" in table.output, table.output
    assert max(len(line) for line in table.output.splitlines()) <= 100
    full = json.loads(CliRunner().invoke(app, [*base, "--json"]).output)
    assert full["num_matched"] == 96 and len(full["replicas"]) == 96
    assert all(sorted(r.split(":")[0] for r in block) == ["s0", "s1"] for block in full["replicas"])


def test_admin_invalidate_and_drain_and_failures(cluster) -> None:
    master, _ = cluster
    runner = CliRunner()
    base = ["admin", "--master", master.grpc_address]
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("inv", "v1", LAYOUT)
    out = runner.invoke(app, [*base, "invalidate", "--namespace", ns.hex(), "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["invalidated"]
    assert runner.invoke(app, [*base, "invalidate", "--namespace", "00" * 16]).exit_code == 1
    assert runner.invoke(app, [*base, "drain", "nosuchnode"]).exit_code == 1
    assert runner.invoke(app, [*base, "evict", "--fraction", "2"]).exit_code == 2  # a usage error, no call
    assert runner.invoke(app, [*base, "evict", "--node", "nosuchnode", "--fraction", "0.5"]).exit_code == 1
    down = runner.invoke(app, ["admin", "--master", "127.0.0.1:1", "--timeout", "0.5", "status"])
    assert down.exit_code == 1 and "Traceback" not in down.output


def test_invalidate_flushes_a_namespace_that_then_fills_again(cluster, transport) -> None:
    """`admin invalidate` of the active namespace is a flush, not a permanent fence (a new user's pool
    stayed off for that model until the master restarted): its blocks are gone at once, a publish reserved
    before the flush is refused at commit (its KV may predate it), new publishes fill it again, and the
    heartbeat answers' flush epoch moves so serving nodes drop their local tiers."""
    master, _ = cluster
    hashes = [bytes([7, k]) * 8 for k in range(4)]
    late = [bytes([8, k]) * 8 for k in range(2)]
    with (
        MasterClient(master.grpc_address) as c,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool,
    ):
        ns, _ = c.register_namespace("flush", "v1", LAYOUT)
        assert pool.put_blocks(ns, None, hashes, blocks_for(4, 7)).num_committed == 4
        before = c.heartbeat("no-such-node", 1).flush_epoch
        inflight = c.reserve(ns, None, late, block_nbytes=LAY.block_nbytes)  # begun before the flush
        assert inflight.reservation_id > 0
        c.invalidate(ns)
        assert c.match(ns, hashes).num_matched == 0
        assert c.heartbeat("no-such-node", 1).flush_epoch == before + 1
        with pytest.raises(FailedPrecondition, match="invalidated"):
            c.commit(inflight.reservation_id, [])
        # KV computed before the flush (a node's load began under the old epoch) is refused at reserve
        now = c.heartbeat("no-such-node", 1).flush_epoch
        with pytest.raises(FailedPrecondition, match="invalidated since this KV was computed"):
            c.reserve(ns, None, late, block_nbytes=LAY.block_nbytes, flush_epoch=before)
        fresh = c.reserve(ns, None, late, block_nbytes=LAY.block_nbytes, flush_epoch=now)
        c.abort(fresh.reservation_id)
        again = pool.put_blocks(ns, None, hashes, blocks_for(4, 8))
        assert again.num_committed == 4 and again.num_existing == 0  # a fresh, empty namespace
        got = pool.get_blocks(ns, hashes)
        assert got.num_ok == 4 and got.blocks[0].data == blocks_for(4, 8)[0].tobytes()


def test_a_serving_node_drops_its_local_tier_when_a_namespace_is_invalidated(cluster) -> None:
    """Its heartbeat sees the master's flush epoch move (a local tier held blocks of the flushed namespace:
    a new user's requests still got them from there after `admin invalidate`)."""
    import threading

    from kvpool.client import NodeInfo
    from kvpool.client.master_link import MasterLink, new_epoch

    master, _ = cluster
    epochs: list[int] = []
    moved = threading.Event()

    def note(epoch: int) -> None:
        epochs.append(epoch)
        if epoch != epochs[0]:
            moved.set()

    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("tier-flush", "v1", LAYOUT)
        node = NodeInfo("flush-watcher", "prefill", "127.0.0.1:9", "", new_epoch())
        agent = MasterLink(c, node, layout_fingerprint=LAYOUT, on_flush_epoch=note)
        agent.start()
        try:
            time.sleep(3 * agent.heartbeat_interval_s)  # heartbeats without a flush: the epoch holds
            assert epochs and len(set(epochs)) == 1 and not moved.is_set()
            c.invalidate(ns)
            assert moved.wait(5 * agent.heartbeat_interval_s + 2) and epochs[-1] == epochs[0] + 1
        finally:
            agent.stop()


def test_reserve_pins_the_parent_until_commit(cluster, transport) -> None:
    """Making room (or an admin evict) between Reserve and Commit never evicts the chain's parent."""
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("pin", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64 * 3)), LAY.block_size)
        data = blocks_for(3, 7)
        with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool:
            assert pool.put_blocks(ns, None, hashes[:2], data[:2]).num_committed == 2
        res = c.reserve(ns, hashes[1], hashes[2:], block_nbytes=LAY.block_nbytes)
        c.evict(1.0)  # every unpinned leaf goes: the parent chain stays pinned by the reservation
        assert c.match(ns, hashes[:2]).num_matched == 2
        c.abort(res.reservation_id)
        c.evict(1.0)  # released: now the chain is evictable
        assert c.match(ns, hashes[:2]).num_matched == 0


def test_two_writers_of_one_block_leave_replicas_on_distinct_nodes(cluster, transport) -> None:
    """Two publishers reserve the same new block at once (both see it absent); after both commit, the
    block keeps at most its target replicas, on distinct nodes; the second writer's extra slot is freed."""
    from kvpool.client.types import CommitBlock
    from transfer import BlockWrite, checksum

    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("two-writers", "v1", LAYOUT)
        for target in (1, 2):
            h = hash_blocks(ns, [target] * 64, LAY.block_size)
            data = blocks_for(1, 10 + target)[0]
            cs = checksum(memoryview(data))
            rs = [
                c.reserve(ns, None, h, num_replicas=target, block_nbytes=LAY.block_nbytes) for _ in range(2)
            ]
            for r in rs:
                assert not r.blocks[0].already_present
                for loc in r.blocks[0].locations:
                    w = BlockWrite(
                        loc.slot, loc.generation, data, cs, loc.capability, loc.capability_expiry_ms
                    )
                    peer = r.nodes[loc.node_id].data_address
                    assert transport.write_blocks(peer, [w], timeout_s=10)[0].ok
            for r in rs:
                c.commit(r.reservation_id, [CommitBlock(h[0], cs, r.blocks[0].locations)])
            reps = c.match(ns, h).replicas[0]
            assert len(reps) == target and len({x.node_id for x in reps}) == target, reps


def test_a_publish_places_runs_of_consecutive_blocks_together(cluster, transport) -> None:
    """Runs of `placement_run_blocks` (16) consecutive new blocks share a node (one message per run when
    pulled, `transfer.coalesce`); successive runs spread over the nodes."""
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("runs", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64 * 40)), LAY.block_size)
        r = c.reserve(ns, None, hashes, num_replicas=1, block_nbytes=LAY.block_nbytes)
        try:
            nodes = [b.locations[0].node_id for b in r.blocks]
            runs = [set(nodes[i : i + 16]) for i in range(0, 40, 16)]
            assert all(len(run) == 1 for run in runs), nodes
            assert len(set(nodes)) == 2, nodes  # the next run goes to the node with more room
        finally:
            c.abort(r.reservation_id)


def test_admin_refuses_to_drain_the_last_store_or_evict_a_serving_nodes_blocks() -> None:
    """Found by a new-user pass: draining the only live store was accepted (every publish then failed,
    with no undrain), and `evict --node <prefill node>` answered "evicted 7" while the node still held
    them (its local tier is its own: only its index entries went)."""
    from kvpool.client import NodeInfo
    from kvpool.errors import FailedPrecondition
    from kvpool.rpc import PROTOCOL_VERSION

    require_ucx()
    master = start_master("--heartbeat-timeout-ms", "60000")
    store = start_store(master.grpc_address, "only")
    try:
        wait_stores(master.grpc_address, 1)
        with MasterClient(master.grpc_address) as c:
            with pytest.raises(FailedPrecondition, match="only live store"):
                c.drain("only")
            assert not {n.node.node_id: n.draining for n in c.list_nodes()}["only"]
            c.register_node(
                NodeInfo("p0", "prefill", "127.0.0.1:9", "", 1), protocol_version=PROTOCOL_VERSION,
                layout_fingerprint=LAYOUT,
            )  # fmt: skip
            with pytest.raises(FailedPrecondition, match="prefill node, not a store"):
                c.evict(0.5, node_id="p0")
            ns, _ = c.register_namespace("drain", "v1", LAYOUT)
            held = hash_blocks(ns, list(range(3 * LAY.block_size)), LAY.block_size)
            with PoolClient(
                master.grpc_address, transfer.UcxTransport(), block_nbytes=LAY.block_nbytes
            ) as pc:
                assert pc.put_blocks(ns, None, held, blocks_for(3, 9)).num_committed == 3  # all on "only"
                pc.transport.close()
        second = start_store(master.grpc_address, "second")
        try:
            wait_stores(master.grpc_address, 2)
            with MasterClient(master.grpc_address) as c:
                assert c.drain("only") == 3  # another store takes its 3 blocks now
                assert {n.node.node_id: n.draining for n in c.list_nodes()}["only"]
                # and a drain can be taken back (a new-user pass found no way to): new blocks go there again
                assert c.drain("only", cancel=True) == 0
                assert not {n.node.node_id: n.draining for n in c.list_nodes()}["only"]
                again = CliRunner().invoke(app, ["admin", "--master", master.grpc_address, "drain", "only"])
                assert again.exit_code == 0 and c.list_nodes() and any(n.draining for n in c.list_nodes())
                undo = ["admin", "--master", master.grpc_address, "drain", "only", "--cancel", "--json"]
                out = CliRunner().invoke(app, undo)
                assert out.exit_code == 0 and json.loads(out.stdout) == {"node": "only", "draining": False}
                assert not any(n.draining for n in c.list_nodes())
                with pytest.raises(FailedPrecondition, match="prefill node, not a store"):
                    c.drain("p0", cancel=True)
        finally:
            second.kill()
    finally:
        store.kill()
        master.kill()
