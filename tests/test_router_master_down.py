"""The router with a real master process that is killed (-9) and restarted: 503 while it is down.

The HTTP layer and placement are real (`FakeService` replaces only the gRPC calls to the serving nodes,
which are registered with the master by hand); the node-list refresh period is 5 s, so nothing here
depends on the background refresh noticing the dead master.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.testclient import TestClient

from kvpool.client import MasterClient, NodeInfo
from kvpool.errors import Unavailable
from kvpool.master.procs import Proc, start_master
from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from kvpool.rpc import PROTOCOL_VERSION
from tests.test_router_http import FakeService

SHORT = "hi"  # under one block: no peek at the master, the node list alone decides
LONG = "a prompt of more than one block of sixteen tokens"  # peeks at the master's index


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
                for node_id, role in (("p0", "prefill"), ("d0", "decode")):
                    node = NodeInfo(node_id, role, "127.0.0.1:1", "", 1)
                    c.register_node(node, protocol_version=PROTOCOL_VERSION, layout_fingerprint=layout)
        except Unavailable:
            return False
        return True

    eventually(register)


def test_router_answers_503_as_soon_as_the_master_is_killed() -> None:
    """Found by a new-user pass: right after `kill -9` of the master the router still answered 200 and
    `/health` said ok (for up to 4 refresh periods: a cached node list counted as fresh even though the
    master no longer answered, and a failed peek was only logged). Now `/health` asks the master each
    time, and a failed master call (health, refresh or peek) drops the cached list at once."""
    model = ModelInfo.load(None, block_size=16)
    layout = model.layout.fingerprint()
    master: Proc = start_master("--heartbeat-timeout-ms", "60000", layout=layout)
    port = int(master.grpc_address.rsplit(":", 1)[1])
    _register_nodes(master.grpc_address, layout)
    client = MasterClient(master.grpc_address, timeout_s=2.0)
    svc = FakeService(
        RouterSettings(master=master.grpc_address, refresh_interval_s=5.0), client, model
    ).start()
    http = TestClient(build_app(svc, Tenants.open()))

    def complete(prompt: str) -> Any:
        return http.post("/v1/completions", json={"model": model.model_id, "prompt": prompt, "max_tokens": 3})

    def unavailable(r: Any) -> bool:
        assert r.status_code == 503, r.text
        error = r.json()["error"]  # /health: a string; the API: OpenAI's error object
        return "master unreachable" in (error["message"] if isinstance(error, dict) else error)

    try:
        assert http.get("/health").json()["status"] == "ok"
        assert complete(LONG).status_code == 200 and complete(SHORT).status_code == 200

        master.kill()  # the cached node list is fresh: only asking the master tells it is gone
        assert unavailable(http.get("/health"))
        assert unavailable(complete(SHORT))  # the failed health check dropped the cached list

        master = start_master("--heartbeat-timeout-ms", "60000", port=port, layout=layout)
        _register_nodes(master.grpc_address, layout)
        eventually(lambda: http.get("/health").status_code == 200)
        assert complete(SHORT).status_code == 200 and complete(LONG).status_code == 200

        master.kill()
        assert unavailable(complete(LONG))  # its peek finds the master gone
        assert unavailable(complete(SHORT))
        assert unavailable(http.get("/health"))
    finally:
        svc.close()
        client.close()
        master.kill()
