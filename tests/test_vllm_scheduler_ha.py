"""The vLLM connector's scheduler half on a list of masters in high availability (etcd): kill -9 the leader
and the half follows the new one without operator action. Its engine steps never wait on the failover
(each call returns within `FAST_S`), and its matches hit again once the new leader has adopted the store's
inventory and the half's link has registered it and its namespace there. Built as `build_scheduler` builds
it (see tests/test_vllm_scheduler.py), on real master, store and etcd processes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.errors import KVPoolError
from tests.capabilities import require_etcd, require_ucx
from tests.test_vllm_scheduler import BS, FP, LAYOUT, Req, built, call, prompt, put

transfer = pytest.importorskip("transfer")


def _leader(client: MasterClient) -> str:
    try:
        return client.masters().leader
    except KVPoolError:
        return ""


def _registered(address: str, node_id: str) -> bool:
    with MasterClient(address, timeout_s=1.0) as c:
        try:
            return any(n.alive and n.node.node_id == node_id for n in c.list_nodes())
        except KVPoolError:
            return False


def _wait(predicate: Any, timeout_s: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}\n{cluster.logs()}"
        time.sleep(0.1)


def test_the_scheduler_half_follows_a_new_leader(tmp_path: Path) -> None:
    require_etcd()
    require_ucx()
    spec = LocalClusterSpec(layout=FP, num_stores=1, num_prefill=0, num_decode=0, segment_size="16MiB",
                            masters=2)  # fmt: skip
    t = transfer.UcxTransport()
    with (
        LocalCluster(spec, log_dir=tmp_path) as cluster,
        MasterClient(cluster.master_address) as client,
        built(cluster.master_address) as half,
        PoolClient(cluster.master_address, t, block_nbytes=LAYOUT.block_nbytes) as pool,
    ):
        node_id = half.connector.node_id
        _wait(lambda: _leader(client) in cluster.master_addresses, 15, "a leader", cluster)
        first = _leader(client)
        _wait(lambda: _registered(first, "store0") and _registered(first, node_id), 10, "registered", cluster)
        tokens = prompt(6 * BS + 10, seed=21)
        put(half, pool, tokens, 5)

        def hits(request_id: str, timeout_s: float) -> int:
            """Poll as vLLM does, one call per step (each within FAST_S), until the half answers."""
            deadline = time.monotonic() + timeout_s
            while (out := call(half, Req(request_id, tokens), 0))[0] is None:
                assert time.monotonic() < deadline, "no answer"
                time.sleep(0.01)
            return int(out[0] or 0)

        assert hits("before", 10) == 5 * BS
        index = cluster.master_addresses.index(first)
        other = cluster.master_addresses[1 - index]
        cluster.masters[index].kill()
        _wait(lambda: _leader(client) == other, 5 + 4, "the other master leads", cluster)
        deadline, n, i = time.monotonic() + 20, 0, 0
        while n != 5 * BS:  # misses (recompute) while the new leader has no store or namespace yet
            assert time.monotonic() < deadline, f"no hit from the new leader within 20 s\n{cluster.logs()}"
            i += 1
            n = hits(f"after{i}", 10)
            time.sleep(0.1)
        assert _registered(other, node_id), "the half's link did not register with the new leader"
    t.close()
