"""Failures cost hits, never requests: a store killed before a load (the master still offers it), a master
that is slow or down, and a layout the pool does not hold (the engine stops at start, naming both).

Engine A publishes; every later engine runs A's prompts again, so A's greedy tokens are the cold
reference (A's prompts share no prefix: it had no hit).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

import pytest

from kvpool.client import MasterClient
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.hashing import hash_blocks
from tests.vllm.harness import BLOCK, FP32_LAYOUT, requests, run_engine, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [tokens(500 + d, 1000) for d in range(4)]
FULL = (1000 - 1) // BLOCK * BLOCK


def delaying_proxy(target: str, delay_s: float) -> tuple[socket.socket, str]:
    """A TCP proxy that holds every chunk it forwards `delay_s` (a master slow to answer every call)."""
    host, port = target.rsplit(":", 1)
    lsock = socket.create_server(("127.0.0.1", 0))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                time.sleep(delay_s)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = lsock.accept()
                upstream = socket.create_connection((host, int(port)))
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return lsock, f"127.0.0.1:{lsock.getsockname()[1]}"


def _store_of_block(cluster: LocalCluster, prompt: list[int], i: int) -> Any:
    """The store process holding block `i` of `prompt` (the only namespace in the pool)."""
    with MasterClient(cluster.master_address, timeout_s=5.0) as m:
        ns = m.stats().namespaces[0].namespace
        match = m.match(ns, hash_blocks(ns, prompt, BLOCK))
    node_id = match.replicas[i][0].node_id
    return next(p for p in cluster.stores if p.name == node_id)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    # the master keeps offering a dead store for a minute (it learns of deaths by missed heartbeats)
    spec = LocalClusterSpec(
        layout=FP32_LAYOUT, num_stores=2, num_prefill=0, num_decode=0, heartbeat_timeout_ms=60_000
    )
    out: dict[str, Any] = {}
    with LocalCluster(spec) as cluster:
        master = cluster.master_address
        out["a"] = run_engine({"master": master, "phases": [requests(PROMPTS)], "settle_s": 1.0})["phases"][0]
        _store_of_block(cluster, PROMPTS[0], 3).kill()  # prompt 0's load fails from block 3 at the latest
        out["store_killed"] = run_engine({"master": master, "phases": [requests(PROMPTS)]}, exact_hits=True)[
            "phases"
        ][0]
        out["mismatch"] = run_engine({"master": master, "block_size": 128, "phases": []}, expect_ok=False)
        lsock, slow = delaying_proxy(master, 4.0)
        try:
            job = {"master": slow, "extra": {"match_wait_s": 0.3}, "phases": [requests(PROMPTS)]}
            out["slow_master"] = run_engine(job)["phases"][0]
        finally:
            lsock.close()
        cluster.master.kill()
        out["master_down"] = run_engine({"master": master, "phases": [requests(PROMPTS)]})["phases"][0]
    return out


def _equal_to_a(runs: dict[str, Any], name: str) -> None:
    for i, (r, a) in enumerate(zip(runs[name], runs["a"], strict=True)):
        assert r["tokens"] == a["tokens"], f"{name}, prompt {i}"


def test_a_killed_store_costs_the_missing_span_only(runs: dict[str, Any]) -> None:
    """Greedy answers equal the pool-less run's; a pull from the killed store fails and loads less than it
    planned. (Once the store has been silent for `stale_after_ms` the master stops offering it: then no
    pull fails and the match ends before its blocks, so a run may see no failed load at all.)"""
    _equal_to_a(runs, "store_killed")
    for r in runs["store_killed"]:
        if r["kvpool"]["load_failed"]:
            assert r["kvpool"]["num_loaded_tokens"] < r["kvpool"]["num_planned_load_tokens"], r["kvpool"]


def test_a_layout_the_pool_does_not_hold_stops_the_engine_naming_both(runs: dict[str, Any]) -> None:
    res = runs["mismatch"]
    assert res["returncode"] != 0
    line = next(
        (ln for ln in res["stderr"].splitlines() if "kv1:float32:b128" in ln and "kv1:float32:b64" in ln),
        None,
    )
    assert line is not None, res["stderr"][-3000:]


def test_a_slow_master_costs_hits_never_requests_nor_steps(runs: dict[str, Any]) -> None:
    _equal_to_a(runs, "slow_master")
    for r in runs["slow_master"]:
        assert r["num_cached_tokens"] == 0
        # the request did not wait for the answer (it arrives >= 8 s later: one round trip through the proxy)
        assert r["kvpool"]["decision"] == "no_answer", r["kvpool"]
        assert r["ttft_s"] < 7.5, r  # a request that waited would take >= 8 s; a loaded host is slow, not 8 s


def test_a_dead_master_costs_hits_never_requests(runs: dict[str, Any]) -> None:
    _equal_to_a(runs, "master_down")
    assert all(r["num_cached_tokens"] == 0 for r in runs["master_down"])
    assert all(r["ttft_s"] < 7.5 for r in runs["master_down"]), [r["ttft_s"] for r in runs["master_down"]]


def test_pooled_prompts_hit_before_the_faults(runs: dict[str, Any]) -> None:
    """Control: the prompts are reusable (the store-killed engine loaded the intact leading runs)."""
    assert any(r["num_cached_tokens"] > 0 for r in runs["store_killed"]), [
        r["kvpool"] for r in runs["store_killed"]
    ]
