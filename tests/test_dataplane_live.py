"""A store whose data plane fails while it keeps heartbeating (issue 26 item 1), with real processes.

A real master and two real store processes on 127.0.0.1; the client reads and writes over UCX. One
store's committed bytes are overwritten in its own memory (through /proc/<pid>/mem, as a RAM fault would
change them; the test process is the store's parent), so the reader's checksum fails: one bad slot costs
that block only; after `fail_after` of them the master places new blocks only on the other store and stops
offering the failed store's other replicas, while the store stays alive; after the back-off the master
probes it (a block copied through its own data plane): passed, it is tried again and serves reads; failed
(its bytes are still bad), it stays out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.hashing import hash_blocks
from kvpool.master.dataplane import DataPlanePolicy
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from tests.capabilities import mark, skip, ucx_missing
from tests.test_master_cluster import LAY, blocks_for, wait_stores

transfer = pytest.importorskip("transfer")
pytestmark = mark("ucx", ucx_missing())


@pytest.fixture
def cluster() -> Iterator[tuple[Proc, list[Proc]]]:
    master = start_master("--heartbeat-timeout-ms", "60000")
    stores: list[Proc] = []
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(2)]
        wait_stores(master.grpc_address, 2)
        yield master, stores
    finally:
        for s in stores:
            s.kill()
        master.kill()


@pytest.fixture
def transport() -> Iterator[object]:
    t = transfer.UcxTransport()
    yield t
    t.close()


def corrupt_slot(store: Proc, slot: int, nbytes: int = 64) -> None:
    """Flip the first bytes of `slot` in the store's segment (its memfd mapping, found in /proc/<pid>/maps)
    through /proc/<pid>/mem: this test process is the store's parent, which may write its memory."""
    pid = store.popen.pid
    with open(f"/proc/{pid}/maps") as maps:
        lines = [ln for ln in maps if "/memfd:" in ln and "segment" in ln]
    if not lines:
        skip("memfd", "the store's segment is not a memfd mapping here")
    base = int(lines[0].split("-", 1)[0], 16)
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(base + slot * LAY.block_nbytes)
            flipped = bytes(255 - b for b in mem.read(nbytes))
            mem.seek(base + slot * LAY.block_nbytes)
            mem.write(flipped)
    except PermissionError:
        skip("ptrace", "no ptrace rights over the store process")


def eventually(cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.2)


def _publisher(mc: MasterClient, pool: PoolClient, ns: bytes) -> Callable[[int], tuple[bytes, str, int]]:
    def publish(seed: int) -> tuple[bytes, str, int]:
        """One single-block prompt: (hash, the node and slot its replica landed on)."""
        h = hash_blocks(ns, [seed] * LAY.block_size, LAY.block_size)
        assert pool.put_blocks(ns, None, h, blocks_for(1, seed), num_replicas=1).num_committed == 1
        loc = mc.match(ns, h).replicas[0][0]
        return h[0], loc.node_id, loc.slot

    return publish


def _spread(
    publish: Callable[[int], tuple[bytes, str, int]], on_s1: int
) -> dict[str, list[tuple[bytes, int, int]]]:
    """Publish single-block prompts until s1 holds `on_s1` of them: {node: [(hash, slot, seed)]}."""
    on: dict[str, list[tuple[bytes, int, int]]] = {"s0": [], "s1": []}
    for seed in range(200):  # spread over both (s1 may be adopted a tick later)
        h, node, slot = publish(seed)
        on[node].append((h, slot, seed))
        if len(on["s0"]) >= 2 and len(on["s1"]) >= on_s1:
            break
        time.sleep(0.05)
    assert len(on["s1"]) >= on_s1, on
    return on


def _fail_by_checksums(
    mc: MasterClient,
    pool: PoolClient,
    ns: bytes,
    store: Proc,
    bads: list[tuple[bytes, int, int]],
    intact: bytes,
) -> None:
    """Corrupt and read each of `bads` (separate events): one bad slot costs one block; `fail_after` of
    them fail the store."""
    for i, (bad, bad_slot, _) in enumerate(bads):
        if i:
            time.sleep(DataPlanePolicy().coalesce_ms / 1000 + 0.1)  # separate events, not one burst
        corrupt_slot(store, bad_slot)
        got = pool.get_blocks(ns, [bad])
        assert got.num_ok == 0 and "checksum" in got.blocks[0].error
        if i == 0:  # one bad slot: that block is dropped, the store keeps serving the others
            assert {n.node.node_id: n.dataplane_state for n in mc.list_nodes()}["s1"] == "suspect"
            assert mc.match(ns, [intact]).num_matched == 1


def test_a_store_whose_bytes_fail_their_checksum_gets_no_blocks_and_serves_no_reads_until_probed(
    cluster, transport
) -> None:
    master, stores = cluster
    with (
        MasterClient(master.grpc_address) as mc,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool,
    ):
        ns, _ = mc.register_namespace("dataplane", "v1", LAYOUT)
        publish = _publisher(mc, pool, ns)
        n_bad = (
            DataPlanePolicy().fail_after
        )  # one corrupted slot costs one block; a store that keeps failing fails
        on = _spread(publish, n_bad + 1)
        *bads, (intact, _, intact_seed) = on["s1"][: n_bad + 1]
        _fail_by_checksums(mc, pool, ns, stores[1], bads, intact)
        t_failed = time.monotonic()
        nodes = {n.node.node_id: n for n in mc.list_nodes()}
        assert nodes["s1"].dataplane_state == "failed" and nodes["s1"].alive  # it still heartbeats
        assert nodes["s0"].dataplane_state == "ok"

        assert mc.match(ns, [intact]).num_matched == 0  # its intact replica is not offered either
        placed = [publish(1000 + seed)[1] for seed in range(8)]
        assert placed == ["s0"] * 8, placed  # no new block on the failed store
        assert time.monotonic() - t_failed < DataPlanePolicy().backoff_ms / 1000, "too slow to check"

        # after its back-off the master probes it (a copy of its intact block through its own data plane),
        # which passes: it is on trial, offered and placed on again; its intact bytes read back right
        eventually(lambda: mc.match(ns, [intact]).num_matched == 1, timeout_s=20)
        again = pool.get_blocks(ns, [intact])
        assert again.num_ok == 1 and again.blocks[0].data == blocks_for(1, intact_seed)[0].tobytes()
        assert {n.node.node_id: n.dataplane_state for n in mc.list_nodes()}["s1"] in ("trial", "ok")
        assert "s1" in {publish(2000 + seed)[1] for seed in range(8)}


@pytest.mark.slow
def test_a_store_that_still_returns_bad_bytes_fails_its_probe_and_stays_out(cluster, transport) -> None:
    """Every block left on the failed store is corrupted too: the probe's copy of one of them fails its
    checksum, so after the back-off the store is not taken back (without the probe it would be on trial,
    its bad replicas offered to readers)."""
    master, stores = cluster
    with (
        MasterClient(master.grpc_address) as mc,
        PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool,
    ):
        ns, _ = mc.register_namespace("dataplane-probe", "v1", LAYOUT)
        n_bad = DataPlanePolicy().fail_after
        on = _spread(_publisher(mc, pool, ns), n_bad + 2)
        *bads, (rest_a, slot_a, _), (rest_b, slot_b, _) = on["s1"][: n_bad + 2]
        _fail_by_checksums(mc, pool, ns, stores[1], bads, rest_a)
        corrupt_slot(stores[1], slot_a)  # the RAM fault goes on: what is left there is bad as well
        corrupt_slot(stores[1], slot_b)
        assert {n.node.node_id: n.dataplane_state for n in mc.list_nodes()}["s1"] == "failed"
        time.sleep(DataPlanePolicy().backoff_ms / 1000 + 2.0)  # past the back-off: probed by now
        assert {n.node.node_id: n.dataplane_state for n in mc.list_nodes()}["s1"] == "failed"
        assert mc.match(ns, [rest_a]).num_matched == 0 and mc.match(ns, [rest_b]).num_matched == 0
