"""The router with a real master process that is killed (-9) and restarted: it keeps serving, degraded.

The HTTP layer and placement are real (`RecordingService` replaces only the gRPC calls to the serving
nodes, which are registered with the master by hand); the master is a real process on 127.0.0.1. A
failed control plane costs hit rate, never requests: with the master gone the router answers 200 on
its last known nodes, places repeated prompts by its own affinity record (no peeks), and `/health` says
degraded (HTTP 200) with the reason and since when. Only a router that never reached a master and so
knows no node answers 503, saying why.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvpool.client import MasterClient, NodeInfo
from kvpool.errors import Unavailable
from kvpool.master.procs import Proc, start_master
from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.service import Event, RouterService
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from kvpool.rpc import PROTOCOL_VERSION
from tests.test_router_failover import _metric

SHORT = "hi"  # under one block: no peek at the master, the node list alone decides
LONG = "a prompt of more than one block of sixteen tokens, for the index"  # peeks at the master's index
NODES = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))


class RecordingService(RouterService):
    """Placement (peek or affinity record, policy) and its record are real; the nodes' answer is canned."""

    def generate(
        self, tokens: Any, sampling: Any, *, cache_salt: str = "", request_id: str = ""
    ) -> Iterator[Event]:  # type: ignore[override]
        peeked = self.peek(list(tokens), cache_salt)
        choice, node = self.choose_prefill(peeked)
        self.inflight.end(node.node.node_id, node.node.epoch, choice.prediction.service_s)
        self.affinity.record(peeked.hashes, node)
        self.record_first(choice, 0.0, len(tokens), 0)
        self.pick_decode()
        common = {"prompt_tokens": len(tokens), "cached_tokens": 0, "prefill_node": node.node.node_id}
        yield Event("first", token_ids=[ord("o")], **common)  # type: ignore[arg-type]
        yield Event("done", finish_reason="length", **common)  # type: ignore[arg-type]


def eventually(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _register_nodes(master: str, layout: str) -> None:
    """Register the fake serving nodes; retried: right after a restart, gRPC's shared subchannel may still
    be in its reconnect backoff (up to 1 s) from the calls to the dead master."""

    def register() -> bool:
        try:
            with MasterClient(master) as c:
                for node_id, role in NODES:
                    node = NodeInfo(node_id, role, "127.0.0.1:1", "", 1)
                    c.register_node(node, protocol_version=PROTOCOL_VERSION, layout_fingerprint=layout)
        except Unavailable:
            return False
        return True

    eventually(register)


def test_the_router_serves_degraded_while_the_master_is_killed_and_recovers_when_it_is_back() -> None:
    """Found by a new-user pass: `kill -9` of the master turned 257 of 258 requests in a 14-s outage into
    503 "master unreachable", although every serving node was alive. Now the router routes on its last
    known nodes, a repeated prompt goes where it went before (affinity without peeks), `/health` is 200
    "degraded" naming the master and since when, and the metrics say so; when a master answers again the
    report is "ok" and peeks resume."""
    model = ModelInfo.load(None, block_size=16)
    layout = model.layout.fingerprint()
    master: Proc = start_master("--heartbeat-timeout-ms", "60000", layout=layout)
    port = int(master.grpc_address.rsplit(":", 1)[1])
    _register_nodes(master.grpc_address, layout)
    client = MasterClient(master.grpc_address, timeout_s=2.0)
    settings = RouterSettings(master=master.grpc_address, refresh_interval_s=0.25, policy="cost")
    svc = RecordingService(settings, client, model).start()
    http = TestClient(build_app(svc, Tenants.open()))

    def complete(prompt: str) -> Any:
        r = http.post("/v1/completions", json={"model": model.model_id, "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
        return r

    def metric(name: str, **labels: str) -> float:
        return _metric(http.get("/metrics").text, name, **labels)

    try:
        assert http.get("/health").json()["status"] == "ok"
        complete(SHORT)
        complete(LONG)
        assert metric("kvpool_router_unpeeked_requests_total") == 0
        assert metric("kvpool_router_master_reachable") == 1
        served = svc.affinity.match(svc.peek(model.encode(LONG), "").hashes)
        assert served is not None
        home = served.replicas[0][0].node_id  # the node that served LONG

        def decisions() -> dict[str, float]:
            return {n: metric("kvpool_router_routing_decisions_total", policy="cost", node=n, outcome="served")
                    for n in ("p0", "p1")}  # fmt: skip

        t_kill = time.time()
        master.kill()
        for _ in range(3):
            complete(SHORT)
        before = decisions()
        for _ in range(6):  # the cost policy ties p0 and p1 without a record: 6 on `home` is no chance
            assert complete(LONG).json()["choices"][0]["text"].startswith("o")
        after = decisions()
        assert after[home] == before[home] + 6 and sum(after.values()) == sum(before.values()) + 6, after
        assert metric("kvpool_router_unpeeked_requests_total") == 6

        h = http.get("/health")
        assert h.status_code == 200, h.text
        body = h.json()
        assert body["status"] == "degraded" and body["prefill"] == 2 and body["decode"] == 1, body
        (part,) = body["degraded"]
        assert part["part"] == "master" and "unreachable" in part["reason"], part
        assert part["since"].endswith("Z") and 0 <= part["for_s"] < 30
        assert metric("kvpool_router_master_reachable") == 0
        since = metric("kvpool_router_degraded_since_seconds", part="master")
        assert t_kill - 1 <= since <= time.time(), since

        master = start_master("--heartbeat-timeout-ms", "60000", port=port, layout=layout)
        _register_nodes(master.grpc_address, layout)
        eventually(lambda: http.get("/health").json()["status"] == "ok")
        assert "degraded" not in http.get("/health").json()
        assert metric("kvpool_router_master_reachable") == 1
        assert metric("kvpool_router_degraded_since_seconds", part="master") == 0  # no series
        unpeeked = metric("kvpool_router_unpeeked_requests_total")
        complete(LONG)
        assert metric("kvpool_router_unpeeked_requests_total") == unpeeked  # peeked again
    finally:
        svc.close()
        client.close()
        master.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_router_that_never_reached_a_master_answers_503_saying_why() -> None:
    """With no node ever known there is nothing to route on: 503, and the message names the master and
    that it was never reached (not a bare "no live node")."""
    model = ModelInfo.load(None, block_size=16)
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    client = MasterClient(address, timeout_s=1.0)
    svc = RecordingService(RouterSettings(master=address, refresh_interval_s=0.25), client, model).start()
    http = TestClient(build_app(svc, Tenants.open()))
    try:
        h = http.get("/health")
        assert h.status_code == 503, h.text
        assert h.json()["status"] == "unavailable"
        assert address in h.json()["error"] and "never reached" in h.json()["error"], h.json()
        assert h.json()["degraded"][0]["part"] == "master"
        r = http.post("/v1/completions", json={"model": model.model_id, "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "no live prefill node known" in message and "never reached" in message, message
    finally:
        svc.close()
        client.close()


def test_fifty_failed_refreshes_log_one_warning_and_the_recovery_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A router whose master is down refreshes its node list every `refresh_interval_s`: one warning per
    outage, not one per refresh (a day's outage flooded the log), and one line when the master answers
    again."""
    model = ModelInfo.load(None, block_size=16)
    port = _free_port()
    address = f"127.0.0.1:{port}"  # nothing listens there yet
    client = MasterClient(address, timeout_s=1.0)
    svc = RouterService(RouterSettings(master=address), client, model)  # not started: no background refresh
    caplog.set_level(logging.DEBUG, logger="kvpool.router")
    master: Proc | None = None
    try:
        for _ in range(50):
            assert not svc.probe_master()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "unreachable" in warned[0] and address in warned[0], warned
        master = start_master(port=port, layout=model.layout.fingerprint())
        eventually(svc.probe_master)
        for _ in range(5):
            assert svc.probe_master()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 2 and "answers again" in warned[1], warned
    finally:
        svc.close()
        client.close()
        if master is not None:
            master.kill()
