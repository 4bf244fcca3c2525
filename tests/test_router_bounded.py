"""Bounded router state (issue #24 part 3): a new `cache_salt` per request grows no router state.

In process: the real router request path (`RouterService.generate`: namespace cache, peek, placement,
metrics) against a real master server on 127.0.0.1:0 (every namespace registered and every peek made over
gRPC); only the prefill/decode nodes are canned stubs (`tests/test_router_failover.py`) and the node
list is the stubs'. 10,000 distinct salts: the namespace cache stays at its cap and RSS grows < 50 MiB.
A master that refuses a new namespace for its own cap is answered 429 naming the master's setting.

End to end (slow): 1,000 distinct salts through a real `kvpool router` process in front of a real
cluster (master, store, prefill, decode processes): the router's cache stays under its cap and the
router's and master's RSS grow < 50 MiB.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from starlette.testclient import TestClient

from kvpool.client import MasterClient
from kvpool.client.types import NodeStatus
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.cluster.process import RoleProcess
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.service import RouterService
from kvpool.router.tenants import Tenants
from kvpool.sampling import SamplingParams
from tests.test_router_failover import _metric, _Node, _service

BLOCK = 16
MiB = 1 << 20


def self_rss() -> int:
    """This process's resident set (bytes), from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_rss(pid: int) -> int:
    """Another process's resident set (bytes), from /proc/<pid>/status VmRSS."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class _RealMaster:
    """A real master over gRPC for namespaces and peeks; the node list is the stubs' (no serving process)."""

    def __init__(self, client: MasterClient, nodes: list[NodeStatus]) -> None:
        self.client, self.nodes = client, nodes

    def list_nodes(self) -> list[NodeStatus]:
        return self.nodes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


@pytest.fixture
def master_server(request: pytest.FixtureRequest) -> Iterator[MasterServer]:
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    kw = getattr(request, "param", {})
    server = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, layout=layout, **kw))
    try:
        yield server
    finally:
        server.stop()


def _router(server: MasterServer, **settings: Any) -> tuple[RouterService, MasterClient]:
    svc = _service({"p0": _Node(), "p1": _Node(), "d0": _Node()}, **settings)
    client = MasterClient(server.address)
    svc.master = svc.namespaces.master = _RealMaster(client, svc.master.nodes)
    return svc, client


def _prompt(i: int) -> list[int]:
    return [1 + (i + k) % 250 for k in range(BLOCK + 1)]  # one full block: the router peeks it


def test_ten_thousand_salts_leave_the_router_state_at_its_caps(master_server: MasterServer) -> None:
    cap = 1000
    svc, client = _router(master_server, namespace_cache_size=cap, policy="round-robin")
    try:
        one = SamplingParams(max_tokens=1)
        for i in range(300):  # warm-up: allocator pools, channels, metric children
            list(svc.generate(_prompt(i), one, cache_salt=f"warm-{i}"))
        before = self_rss()
        for i in range(10_000):
            list(svc.generate(_prompt(i), one, cache_salt=f"salt-{i}"))
            assert len(svc.namespaces) <= cap
        grown = self_rss() - before
        assert len(svc.namespaces) == cap
        assert svc.namespaces.evictions == 10_300 - cap
        # every other per-request structure is back to empty or bounded by the nodes
        assert svc.inflight.total() == 0 and svc.decode_inflight.total() == 0
        assert len(svc._down) == 0 and len(svc._last_serving) <= 2
        # a salt still cached is a hit (no registration); an evicted one is registered again, once
        calls: list[str] = []
        register = client.register_namespace

        def counted(*args: Any, **kw: Any) -> Any:
            calls.append(kw["cache_salt"])
            return register(*args, **kw)

        svc.namespaces.master = _RealMaster(client, [])  # type: ignore[assignment]
        svc.namespaces.master.register_namespace = counted  # type: ignore[method-assign]
        svc.namespace("salt-9999")
        svc.namespace("salt-0")
        svc.namespace("salt-0")
        assert calls == ["salt-0"]
        metrics = generate_latest(svc.metrics.registry).decode()
        assert _metric(metrics, "kvpool_router_namespace_cache_entries") == cap
        assert _metric(metrics, "kvpool_router_namespace_cache_evictions_total") == 10_301 - cap
        assert _metric(metrics, "kvpool_router_prompt_tokens_total") == 10_300 * (BLOCK + 1)
        assert grown < 50 * MiB, f"RSS grew {grown / MiB:.1f} MiB over 10,000 salts"
    finally:
        svc.close()
        client.close()


@pytest.mark.parametrize("master_server", [{"max_namespaces_per_tenant": 3}], indirect=True)
def test_a_master_cap_on_namespaces_is_a_429_naming_the_setting(master_server: MasterServer) -> None:
    svc, client = _router(master_server)
    try:
        http = TestClient(build_app(svc, Tenants.open()))
        model = svc.model.model_id

        def ask(salt: str) -> httpx.Response:
            body = {"model": model, "prompt": _prompt(0), "max_tokens": 1, "cache_salt": salt}
            return http.post("/v1/completions", json=body)

        for salt in ("a", "b", "c"):  # one tenant ("", the open one): three namespaces fit
            assert ask(salt).status_code == 200
        r = ask("d")
        assert r.status_code == 429, r.text
        assert "max_namespaces_per_tenant" in r.json()["error"]["message"]
        assert ask("a").status_code == 200  # a salt the router holds is served without asking the master
        assert len(svc.namespaces) == 3
    finally:
        svc.close()
        client.close()


# ---- end to end (slow): real processes --------------------------------------------------------------


@pytest.mark.slow
def test_a_thousand_salts_end_to_end_leave_router_and_master_rss_flat() -> None:
    cap = 200
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, num_stores=1, num_prefill=1, num_decode=1, block_size=BLOCK, segment_size="64MiB",
        heartbeat_timeout_ms=30_000,
    )  # fmt: skip
    with LocalCluster(spec) as cluster:
        env = dict(os.environ) | cluster.member_env | {"KVPOOL_NAMESPACE_CACHE_SIZE": str(cap)}
        router = RoleProcess(
            "router", ["router", "--master", cluster.master_address, "--port", "0"],
            log_path=cluster.log_dir / "router.log", env=env,
        )  # fmt: skip
        cluster.processes.append(router)  # stopped with the cluster
        url = f"http://{router.wait_ready(60)['http_address']}"
        with httpx.Client(base_url=url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]

            def ask(salt: str) -> int:
                body = {"model": model, "prompt": _prompt(len(salt)), "max_tokens": 1, "cache_salt": salt}
                return http.post("/v1/completions", json=body).status_code

            with ThreadPoolExecutor(4) as pool:
                assert set(pool.map(ask, (f"warm-{i}" for i in range(100)))) == {200}
                router_before, master_before = vm_rss(router.proc.pid), vm_rss(cluster.master.proc.pid)
                codes = list(pool.map(ask, (f"salt-{i}" for i in range(1000))))
            assert codes.count(200) == 1000, {c: codes.count(c) for c in set(codes)}
            router_grown = vm_rss(router.proc.pid) - router_before
            master_grown = vm_rss(cluster.master.proc.pid) - master_before
            text = http.get("/metrics").text
        assert _metric(text, "kvpool_router_namespace_cache_entries") == cap
        assert _metric(text, "kvpool_router_namespace_cache_evictions_total") == 1100 - cap
        with MasterClient(cluster.master_address) as m:
            stats = m.stats()
        assert stats.num_namespaces <= MasterSettings().max_namespaces_per_tenant
        assert router_grown < 50 * MiB, f"router RSS grew {router_grown / MiB:.1f} MiB"
        assert master_grown < 50 * MiB, f"master RSS grew {master_grown / MiB:.1f} MiB"
