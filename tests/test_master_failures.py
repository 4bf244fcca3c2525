"""Failures with real processes: a store node killed with -9, the master killed with -9 and restarted."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable

import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from tests.capabilities import mark, ucx_missing
from tests.test_master_cluster import LAY, blocks_for, wait_stores

transfer = pytest.importorskip("transfer")
pytestmark = mark("ucx", ucx_missing())


def eventually(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_killed_store_replicas_vanish_and_other_replicas_still_hit() -> None:
    master = start_master("--heartbeat-timeout-ms", "1500", "--heartbeat-interval-ms", "300")
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(2)]
        wait_stores(master.grpc_address, 2)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("fail", "v1", LAYOUT)
            both = hash_blocks(ns, list(range(64 * 3)), LAY.block_size)
            data = blocks_for(3, 7)
            assert pc.put_blocks(ns, None, both, data, num_replicas=2).num_committed == 3
            single = [hash_blocks(ns, [i] * 64, LAY.block_size)[0] for i in range(8)]
            for h, d in zip(single, blocks_for(8, 8), strict=True):
                pc.put_blocks(ns, None, [h], [d], num_replicas=1)
            on_s0 = [h for h in single if c.match(ns, [h]).replicas[0][0].node_id == "s0"]
            assert on_s0, "placement should spread single-replica blocks over both nodes"
            top = on_s0[0]  # children below a block of s0: those placed on s1 are orphaned with it
            t = single.index(top)
            kids = [hash_blocks(ns, [t] * 64 + [100 + i] * 64, LAY.block_size)[1] for i in range(8)]
            for k, d in zip(kids, blocks_for(8, 9), strict=True):
                assert pc.put_blocks(ns, top, [k], [d], num_replicas=1).num_committed == 1
            kids_on_s1 = sum(c.match(ns, [top, k]).replicas[1][0].node_id == "s1" for k in kids)
            assert kids_on_s1, "placement should put some children on s1"
            s1_kept = 3 + len(single) - len(on_s0)  # what s1 holds once the orphans are freed
            used = {n.node.node_id: n.num_used_slots for n in c.list_nodes()}
            assert used["s1"] == s1_kept + kids_on_s1
            stores[0].kill()
            t0 = time.monotonic()
            eventually(lambda: all(c.match(ns, [h]).num_matched == 0 for h in on_s0))
            assert time.monotonic() - t0 < 5 * 1.5  # 5x the heartbeat timeout, for a loaded host
            m = c.match(ns, both)
            assert m.num_matched == 3 and all({x.node_id for x in r} == {"s1"} for r in m.replicas)
            got = pc.get_blocks(ns, both)
            assert got.num_ok == 3 and [b.data for b in got.blocks] == [d.tobytes() for d in data]
            nodes = {n.node.node_id: n for n in c.list_nodes()}
            assert not nodes["s0"].alive and nodes["s1"].alive
            assert all(c.match(ns, [top, k]).num_matched == 0 for k in kids)
            # the orphans' slots on s1 were ordered freed and the store acknowledged them
            eventually(lambda: {n.node.node_id: n.num_used_slots for n in c.list_nodes()}["s1"] == s1_kept)
            metrics_at = str(master.ready.get("metrics_address") or "")
            assert metrics_at
            if metrics_at:  # the node death's longest lock hold, step by step (kvpool.master.node_death)
                eventually(lambda: _metric(metrics_at, "kvpool_master_node_deaths_total") >= 1)
                assert _metric(metrics_at, "kvpool_master_node_death_lock_ms") > 0
                assert _metric(metrics_at, "kvpool_master_watermark_tick_ms") > 0
    finally:
        tr.close()
        for s in stores:
            s.kill()
        master.kill()


def _metric(address: str, name: str) -> float:
    """One unlabelled sample of the master's /metrics (-1 when absent)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:  # noqa: S310 - our own master
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return -1.0


def test_master_restart_rebuilds_from_store_inventories() -> None:
    port = free_port()
    args = ("--heartbeat-timeout-ms", "2000", "--heartbeat-interval-ms", "300")
    master = start_master(*args, port=port)
    stores: list[Proc] = []
    tr = transfer.UcxTransport()
    try:
        stores = [start_store(master.grpc_address, f"s{i}") for i in range(2)]
        wait_stores(master.grpc_address, 2)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            ns, _ = c.register_namespace("restart", "v1", LAYOUT)
            kept = hash_blocks(ns, list(range(64 * 4)), LAY.block_size)
            data = blocks_for(4, 9)
            assert pc.put_blocks(ns, None, kept, data, num_replicas=2).num_committed == 4
            gone = hash_blocks(ns, [7] * 128, LAY.block_size)
            assert pc.put_blocks(ns, None, gone, blocks_for(2, 10)).num_committed == 2
            assert c.remove(ns, gone[:1]) == 2  # with its descendant
            eventually(lambda: sum(n.num_used_slots for n in c.list_nodes()) == 8)
        master.kill()
        master = start_master(*args, port=port)
        wait_stores(master.grpc_address, 2, timeout_s=30)
        with (
            MasterClient(master.grpc_address) as c,
            PoolClient(master.grpc_address, tr, block_nbytes=LAY.block_nbytes) as pc,
        ):
            assert c.match(ns, kept).num_matched == 0  # unclaimed until a serving node registers it
            assert c.register_namespace("restart", "v1", LAYOUT)[0] == ns
            eventually(lambda: c.match(ns, kept).num_matched == 4)
            assert all(len(r) == 2 for r in c.match(ns, kept).replicas)
            assert c.match(ns, gone).num_matched == 0
            got = pc.get_blocks(ns, kept)
            assert [b.data for b in got.blocks] == [d.tobytes() for d in data]
            new = hash_blocks(ns, [3] * 64, LAY.block_size)  # placement works after the rebuild
            assert pc.put_blocks(ns, None, new, blocks_for(1, 11)).num_committed == 1
            assert pc.get_blocks(ns, new).num_ok == 1
    finally:
        tr.close()
        for s in stores:
            s.kill()
        master.kill()


def test_a_second_live_store_with_the_same_node_id_is_refused_and_a_restart_is_not() -> None:
    """Two stores started with one --node-id used to replace each other's registration on every
    heartbeat (each re-registered when the master no longer knew its epoch). Now the master asks the
    registered one: while it answers with its own id and epoch the newcomer gets ALREADY_EXISTS and exits
    2 (without reporting KVPOOL_READY); once it is dead (kill -9) a store under that id registers at once (the restart path)."""
    import grpc

    from kvpool.rpc import PROTOCOL_VERSION
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    master = start_master("--heartbeat-interval-ms", "300")
    procs: list[Proc] = []
    try:
        first = start_store(master.grpc_address, "dup")
        procs.append(first)
        wait_stores(master.grpc_address, 1)
        with pytest.raises(RuntimeError, match=r"did not become ready \(exit 2\)"):  # refused before READY
            start_store(master.grpc_address, "dup")
        with grpc.insecure_channel(master.grpc_address) as ch:
            req = pb.RegisterNodeRequest(
                node=pb.NodeEndpoint(
                    node_id="dup",
                    role="store",
                    grpc_address="127.0.0.1:1",
                    data_address="127.0.0.1:2",
                    epoch=7,
                ),
                protocol_version=PROTOCOL_VERSION,
                layout_fingerprint=LAYOUT,
                num_slots=8,
                block_nbytes=LAY.block_nbytes,
            )
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.MasterStub(ch).RegisterNode(req, timeout=10)
            assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "held by a live store at " + first.grpc_address in (exc.value.details() or "")
        with MasterClient(master.grpc_address) as c:
            time.sleep(1.0)  # a few heartbeats: no ping-pong, the first keeps its registration
            [node] = [n for n in c.list_nodes() if n.node.node_id == "dup"]
            assert node.alive and node.node.epoch == first.ready["epoch"]
            first.kill()
            third = start_store(master.grpc_address, "dup")
            procs.append(third)
            eventually(
                lambda: any(
                    n.node.node_id == "dup" and n.alive and n.node.epoch == third.ready["epoch"]
                    for n in c.list_nodes()
                ),
                timeout_s=10,
            )
            assert third.popen.poll() is None
    finally:
        for p in procs:
            p.kill()
        master.kill()


SERVING_LAYOUT = "kv1:float32:b64:l4:h4:d32"  # the embedded model's, block 64


def _serving(master: str, role: str, node_id: str) -> list[str]:
    return [role, "--master", master, "--port", "0", "--node-id", node_id, "--no-metrics"]


def _refused(master: str, role: str, node_id: str) -> str:
    """Run a serving node the master must refuse: it exits 1 before READY (a READY fails at once); returns
    its last stderr line."""
    import subprocess
    import sys
    import tempfile
    import threading

    with tempfile.TemporaryFile("w+") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", *_serving(master, role, node_id)],
            stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        watchdog = threading.Timer(120, popen.kill)
        watchdog.start()
        try:
            assert popen.stdout is not None
            for out in popen.stdout:
                assert not out.startswith("KVPOOL_READY"), f"the duplicate {role} node was accepted: {out}"
            rc = popen.wait()
        finally:
            watchdog.cancel()
            popen.kill()
            popen.wait()
        err.seek(0)
        lines = err.read().strip().splitlines()
    assert rc == 1, (rc, lines[-20:])
    return lines[-1]


def test_a_second_live_serving_node_with_the_same_node_id_is_refused_and_a_restart_is_not() -> None:
    """Two prefill (or decode) nodes started with one --node-id were both accepted and kept replacing each
    other's registration (found by a new-user pass). The master now asks the registered node's GetInfo, as
    for stores: while it answers with its own id and epoch the newcomer gets ALREADY_EXISTS and exits 1
    with one line; once it is dead (kill -9, long before its heartbeat timeout) a node under that id
    registers at once."""
    from kvpool.master.procs import start

    master = start_master(
        "--heartbeat-interval-ms", "300", "--heartbeat-timeout-ms", "60000", layout=SERVING_LAYOUT
    )
    procs: list[Proc] = []
    try:
        first = start(_serving(master.grpc_address, "prefill", "dup"), timeout_s=120)
        procs.append(first)
        line = _refused(master.grpc_address, "prefill", "dup")
        why = f"node id 'dup' is held by a live prefill at {first.grpc_address}: give every node its own --node-id"
        assert line.startswith("kvpool prefill: AlreadyExists: ") and why in line, line
        with MasterClient(master.grpc_address) as c:

            def holder() -> tuple[str, bool]:
                [n] = [n for n in c.list_nodes() if n.node.node_id == "dup"]
                return n.node.grpc_address, n.alive

            for _ in range(5):  # a few heartbeats: no ping-pong, the first keeps its registration
                assert holder() == (first.grpc_address, True)
                time.sleep(0.3)
            first.kill()
            second = start(_serving(master.grpc_address, "decode", "dup"), timeout_s=120)  # the restart path
            procs.append(second)
            assert holder() == (second.grpc_address, True)
            line = _refused(master.grpc_address, "decode", "dup")  # asks the decode node's GetInfo
            assert f"held by a live decode at {second.grpc_address}" in line, line
            assert holder() == (second.grpc_address, True) and second.popen.poll() is None
    finally:
        for p in procs:
            p.kill()
        master.kill()


def test_a_gracefully_stopped_node_leaves_the_master_at_once() -> None:
    """A store (or prefill node) stopped with SIGTERM did not deregister: `kvpool admin status`/`nodes`
    counted it live until its heartbeat timeout (found by a new-user pass). Its stop now calls the
    master's DeregisterNode (one short try): it is dead at once, here with a 60 s heartbeat timeout.
    Only the registered epoch may deregister a node."""
    import json
    import signal
    import subprocess
    import sys

    from kvpool.master.procs import start

    master = start_master("--heartbeat-timeout-ms", "60000", layout=SERVING_LAYOUT)
    procs: list[Proc] = []
    try:
        stores = [start_store(master.grpc_address, f"s{i}", layout=SERVING_LAYOUT) for i in range(2)]
        procs += stores
        prefill = start(_serving(master.grpc_address, "prefill", "p0"), timeout_s=120)
        procs.append(prefill)
        wait_stores(master.grpc_address, 2)
        with MasterClient(master.grpc_address) as c:

            def alive() -> dict[str, bool]:
                return {n.node.node_id: n.alive for n in c.list_nodes()}

            assert alive() == {"s0": True, "s1": True, "p0": True}
            assert not c.deregister_node("s1", stores[1].ready["epoch"] + 1)  # another epoch: refused
            stores[0].kill(signal.SIGTERM)
            prefill.kill(signal.SIGTERM)
            assert stores[0].popen.returncode == 0 and prefill.popen.returncode == 0
            assert alive() == {"s0": False, "s1": True, "p0": False}  # at once, not after 60 s
        out = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master.grpc_address, "status", "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        status = json.loads(out)
        assert (status["nodes_alive"], status["nodes"]) == (1, 3)
        assert status["capacity_bytes"] == stores[1].ready["num_slots"] * stores[1].ready["block_nbytes"]
    finally:
        for p in procs:
            p.kill()
        master.kill()
