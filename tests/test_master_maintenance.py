"""The master's background maintenance against real processes: re-replication after a store is killed
with -9, `Drain`, and watermark eviction on a small segment (one master, up to three store nodes)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Sequence

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import MasterClient, Match, PoolClient
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from tests.capabilities import mark, ucx_missing
from tests.test_master_cluster import LAY, blocks_for, wait_stores
from tests.test_master_failures import eventually

transfer = pytest.importorskip("transfer")
pytestmark = mark("ucx", ucx_missing())

FAST = ("--heartbeat-timeout-ms", "1500", "--heartbeat-interval-ms", "300")


def only(m: Match, node_id: str) -> Match:
    """The same match with each block's replica on `node_id` alone (to read that one replica)."""
    picked = [tuple(x for x in r if x.node_id == node_id) for r in m.replicas]
    assert all(len(r) == 1 for r in picked), f"not every block has a replica on {node_id}"
    return dataclasses.replace(m, replicas=picked)


def read_each_replica(pc: PoolClient, ns: bytes, chain: Sequence[bytes], want: Sequence[bytes]) -> None:
    """Every replica of every block of `chain` reads back as `want`, bit-exact."""
    m = pc.master.match(ns, chain, lease_ttl_ms=30_000)
    try:
        assert m.num_matched == len(chain)
        for node_id in {x.node_id for r in m.replicas for x in r}:
            sub = only(m, node_id) if all(any(x.node_id == node_id for x in r) for r in m.replicas) else None
            if sub is None:  # this node holds some blocks of the chain: read those one by one
                for i, r in enumerate(m.replicas):
                    for x in r:
                        if x.node_id == node_id:
                            one = dataclasses.replace(m, num_matched=1, replicas=[(x,)])
                            got = pc.read_matched(ns, [chain[i]], one)
                            assert got.blocks[0].data == want[i], f"block {i} on {node_id} differs"
                continue
            got = pc.read_matched(ns, chain, sub)
            assert [b.data for b in got.blocks] == list(want), f"a replica on {node_id} differs"
    finally:
        assert m.lease_id is not None
        pc.master.release_lease(m.lease_id)


def _stop(master: Proc, stores: list[Proc], tr: object) -> None:
    tr.close()  # type: ignore[attr-defined]
    for s in stores:
        s.kill()
    master.kill()


@pytest.mark.slow
def test_killed_store_blocks_are_rereplicated_from_a_survivor() -> None:
    master = start_master(*FAST)
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(3)]
        wait_stores(master.grpc_address, 3)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("rerep", "v1", LAYOUT)
            chains = [hash_blocks(ns, list(range(64 * 6)), LAY.block_size)]
            chains += [hash_blocks(ns, [i] * 64, LAY.block_size) for i in range(6)]
            data = [[d.tobytes() for d in blocks_for(len(ch), 20 + k)] for k, ch in enumerate(chains)]
            for ch, d in zip(chains, data, strict=True):
                assert pc.put_blocks(ns, None, ch, d, num_replicas=2).num_committed == len(ch)
            before = [c.match(ns, ch).replicas for ch in chains]
            assert all(len({x.node_id for x in r}) == 2 for reps in before for r in reps)
            held = {n: sum(x.node_id == n for reps in before for r in reps for x in r) for n in ("s0", "s1")}
            victim = max(held, key=lambda n: held[n])
            lost = held[victim]
            assert lost > 0
            stores[int(victim[1:])].kill()

            def back_to_two() -> bool:
                for ch in chains:
                    m = c.match(ns, ch)
                    if m.num_matched != len(ch):
                        return False
                    if any(len(r) != 2 or victim in {x.node_id for x in r} for r in m.replicas):
                        return False
                return True

            eventually(back_to_two, timeout_s=30)
            assert c.stats().num_rereplications >= lost
            alive = {n.node.node_id for n in c.list_nodes() if n.alive}
            assert victim not in alive
            for ch, d in zip(chains, data, strict=True):
                read_each_replica(pc, ns, ch, d)
            used = {n.node.node_id: n.num_used_slots for n in c.list_nodes() if n.alive}
            assert sum(used.values()) == 2 * sum(len(ch) for ch in chains)
    finally:
        _stop(master, stores, tr)


@pytest.mark.slow
def test_drain_moves_blocks_off_while_reads_keep_working() -> None:
    master = start_master(*FAST)
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(3)]
        wait_stores(master.grpc_address, 3)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("drain", "v1", LAYOUT)
            chains = [hash_blocks(ns, list(range(64 * 8)), LAY.block_size)]
            chains += [hash_blocks(ns, [i] * 64, LAY.block_size) for i in range(9)]
            data = [[d.tobytes() for d in blocks_for(len(ch), 40 + k)] for k, ch in enumerate(chains)]
            for ch, d in zip(chains, data, strict=True):
                assert pc.put_blocks(ns, None, ch, d, num_replicas=1).num_committed == len(ch)
            on = {n.node.node_id: n.num_blocks for n in c.list_nodes() if n.node.role == "store"}
            k_held = 1  # a one-block prompt, on the node to drain (which may also hold others)
            node = c.match(ns, chains[k_held]).replicas[0][0].node_id
            assert on[node] > 0
            held = c.match(ns, chains[k_held], lease_ttl_ms=60_000)  # a reader that has not read yet

            failures: list[str] = []
            reads = [0]
            stop = threading.Event()

            def reader() -> None:
                with PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as rc:
                    while not stop.is_set():
                        for ch, d in zip(chains, data, strict=True):
                            got = rc.get_blocks(ns, ch, count_hit=False)
                            reads[0] += 1
                            if got.num_ok != len(ch) or [b.data for b in got.blocks] != d:
                                failures.append(f"{got.num_ok}/{len(ch)}: {got.blocks[-1].error}")

            t = threading.Thread(target=reader, daemon=True)
            t.start()
            try:
                out = CliRunner().invoke(
                    app, ["admin", "--master", master.grpc_address, "drain", node, "--json"]
                )
                assert out.exit_code == 0, out.output
                assert json.loads(out.output) == {
                    "node": node,
                    "draining": True,
                    "num_blocks_to_move": on[node],
                }
                assert next(n for n in c.list_nodes() if n.node.node_id == node).draining
                # no new placements on a draining node
                fresh = [hash_blocks(ns, [100 + i] * 64, LAY.block_size) for i in range(6)]
                for i, ch in enumerate(fresh):
                    pc.put_blocks(ns, None, ch, [d.tobytes() for d in blocks_for(1, 60 + i)])
                    assert all(x.node_id != node for x in c.match(ns, ch).replicas[0])

                def moved_but_held() -> bool:  # every block has a copy elsewhere; the held one stays
                    m = c.match(ns, chains[k_held])
                    st = next(n for n in c.list_nodes() if n.node.node_id == node)
                    return len(m.replicas[-1]) == 2 and st.num_blocks == 1

                eventually(moved_but_held, timeout_s=30)
                got = pc.read_matched(ns, chains[k_held], held)  # its draining replica still reads
                assert [b.data for b in got.blocks] == data[k_held]
                assert held.lease_id is not None
                c.release_lease(held.lease_id)

                def drained() -> bool:
                    st = next(n for n in c.list_nodes() if n.node.node_id == node)
                    return st.num_blocks == 0 and st.num_used_slots == 0

                eventually(drained, timeout_s=30)
                n0 = reads[0]
                eventually(lambda: reads[0] >= n0 + 2 * len(chains))  # reads after the drain too
            finally:
                stop.set()
                t.join(timeout=30)
            assert not failures, failures[:5]
            assert reads[0] > 0
            for ch, d in zip(chains, data, strict=True):
                m = c.match(ns, ch)
                assert m.num_matched == len(ch) and all(x.node_id != node for r in m.replicas for x in r)
                read_each_replica(pc, ns, ch, d)
            table = CliRunner().invoke(app, ["admin", "--master", master.grpc_address, "drain", node])
            assert table.exit_code == 0 and "num_blocks_to_move" in table.output
    finally:
        _stop(master, stores, tr)


def test_watermark_eviction_spares_leased_and_interior_blocks() -> None:
    # one store of 16 slots: evict above 12 used slots, down to 8
    master = start_master(*FAST, "--high-watermark", "0.75", "--low-watermark", "0.5")
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        slots = 16
        stores = [start_store(master.grpc_address, "s0", segment=f"{slots * LAY.block_nbytes >> 10}KiB")]
        wait_stores(master.grpc_address, 1)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("wm", "v1", LAYOUT)
            assert next(n for n in c.list_nodes() if n.node.role == "store").num_slots == slots

            def put(ch: Sequence[bytes], seed: int) -> list[bytes]:
                d = [x.tobytes() for x in blocks_for(len(ch), seed)]
                assert pc.put_blocks(ns, None, ch, d).num_committed == len(ch)
                return d

            leased = hash_blocks(ns, [7] * 64 * 3, LAY.block_size)  # oldest: first to go without a lease
            leased_data = put(leased, 1)
            lease = c.match(ns, leased, lease_ttl_ms=120_000)
            assert lease.lease_id is not None and lease.num_matched == 3
            chain = hash_blocks(ns, list(range(64 * 5)), LAY.block_size)
            put(chain, 2)
            singles = [hash_blocks(ns, [50 + i] * 64, LAY.block_size) for i in range(4)]
            for i, ch in enumerate(singles):
                put(ch, 3 + i)
            assert c.stats().num_evictions == 0  # 12 of 16 slots: at the high watermark, not above
            old = {k: c.match(ns, ch) for k, ch in enumerate([chain, *singles])}  # readers without a lease
            last = hash_blocks(ns, [99] * 64 * 2, LAY.block_size)
            put(last, 9)  # 14 of 16: above the high watermark

            def used() -> int:
                return next(n for n in c.list_nodes() if n.node.role == "store").num_used_slots

            eventually(lambda: used() == slots // 2)
            st = c.stats()
            assert st.num_evictions >= 6
            # the leased chain (leaf and ancestors) stayed, and its bytes are intact
            assert c.match(ns, leased).num_matched == 3
            got = pc.read_matched(ns, leased, lease)
            assert [b.data for b in got.blocks] == leased_data
            # interior blocks never went before their children: the index holds exactly the matchable
            # prefixes of what was published (no unreachable child left behind)
            published = [leased, chain, *singles, last]
            assert sum(c.match(ns, ch).num_matched for ch in published) == st.num_blocks == slots // 2
            # freed slots are reused by new blocks; an old reader of such a slot gets an error, never the
            # new bytes
            evicted = [
                (k, i, loc)
                for k, m in old.items()
                for i, r in enumerate(m.replicas)
                for loc in r
                if c.match(ns, [chain, *singles][k]).num_matched <= i
            ]
            assert evicted
            new = hash_blocks(ns, [123] * 64 * 4, LAY.block_size)
            new_data = put(new, 10)
            new_slots = {x.slot: x for r in c.match(ns, new).replicas for x in r}
            reused = [(k, i, loc) for k, i, loc in evicted if loc.slot in new_slots]
            assert reused, "the new blocks should take slots the eviction freed"
            for k, i, loc in reused:
                assert new_slots[loc.slot].generation != loc.generation
                stale = dataclasses.replace(old[k], num_matched=1, replicas=[(loc,)])
                res = pc.read_matched(ns, [[chain, *singles][k][i]], stale)
                assert not res.blocks[0].ok and res.blocks[0].data is None
            assert [b.data for b in pc.get_blocks(ns, new).blocks] == new_data
            c.release_lease(lease.lease_id)
    finally:
        _stop(master, stores, tr)


def test_a_drain_into_a_store_near_its_high_watermark_finishes_instead_of_looping() -> None:
    """Found by a new-user pass: draining s2 into a nearly full s1 never finished — every copy pushed s1
    over its high watermark, its eviction dropped copies, the drain copied them again (50 k copies in
    3 minutes, two processes busy). Copies now stop at the high watermark; what has nowhere to go is
    evicted from the draining store, leaves first."""
    slots = 16
    master = start_master(*FAST, "--high-watermark", "0.75", "--low-watermark", "0.5")
    seg = f"{slots * LAY.block_nbytes >> 10}KiB"
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        stores = [start_store(master.grpc_address, f"s{i}", segment=seg) for i in range(2)]
        wait_stores(master.grpc_address, 2)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("drain-full", "v1", LAYOUT)
            chains = [hash_blocks(ns, [i] * 64, LAY.block_size) for i in range(20)]  # 20 one-block prompts
            for k, ch in enumerate(chains):
                assert pc.put_blocks(ns, None, ch, [blocks_for(1, 70 + k)[0].tobytes()]).num_committed == 1
            on = {n.node.node_id: n.num_blocks for n in c.list_nodes() if n.node.role == "store"}
            assert on["s0"] > 4 and on["s1"] > 4, on
            c.drain("s0")

            def drained() -> bool:
                nodes = {n.node.node_id: n for n in c.list_nodes() if n.node.role == "store"}
                return nodes["s0"].num_blocks == 0 and nodes["s0"].num_used_slots == 0

            eventually(drained, timeout_s=30)
            copies = c.stats().num_rereplications
            s1 = next(n for n in c.list_nodes() if n.node.node_id == "s1")
            assert s1.num_used_slots <= 0.75 * slots and copies <= slots, (s1.num_used_slots, copies)
            time.sleep(1.5)  # several maintenance ticks: nothing keeps copying
            assert c.stats().num_rereplications == copies
            matched = sum(c.match(ns, ch).num_matched for ch in chains)
            assert matched == s1.num_blocks  # what stayed is readable from s1; the rest was evicted
    finally:
        _stop(master, stores, tr)
