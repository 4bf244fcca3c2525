"""Steady greedy traffic through the router while the master is killed (-9): no request fails.

Real processes (master, a store, two prefill nodes, a decode node; `kvpool.cluster.local`) and the real
router app (`kvpool.router.serve.build`) in this process behind Starlette's test client. A first cold
pass gives each prompt's answer; then the same prompts are sent in turn while the master is killed and,
in the first test, started again on its port 20 s later (from nothing: it rebuilds its index from the
store's inventory and the nodes' re-registrations). Every request must answer 200 with the cold pass's
text; the hit rate (cached / prompt tokens) per phase is printed, and after the restart it must be back
at its level before the kill within 5 s. The router places round-robin, so a prompt's next request goes
to the other prefill node: with the master up it pulls the prompt from the pool, with the master down
only the node-local tiers hit (a prefill node runs degraded: local tier and recompute, no pool calls).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from kvpool.client import MasterClient
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.router.model_info import ModelInfo
from kvpool.router.serve import build
from kvpool.router.settings import RouterSettings
from tests.capabilities import require_ucx
from tests.test_router_failover import _metric

pytestmark = pytest.mark.slow

BLOCK = 16


def _prompt(i: int) -> str:
    """Conversation `i`'s prompt (several blocks; no two share their first block)."""
    return f"{i:05d} conversation: " + "the pool keeps every prefix it has seen in memory. " * 2


@dataclass(frozen=True, slots=True)
class Answer:
    at_s: float  # monotonic, when the request was sent
    status: int
    text: str
    prompt_tokens: int
    cached_tokens: int


def _hit_rate(answers: list[Answer]) -> float:
    prompt = sum(a.prompt_tokens for a in answers)
    return sum(a.cached_tokens for a in answers) / prompt if prompt else 0.0


def _traffic(outage_s: float, *, restart: bool, policy: str) -> None:
    require_ucx()
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(layout=layout, num_stores=1, num_prefill=2, num_decode=1, block_size=BLOCK,
                            segment_size="64MiB")  # fmt: skip
    with LocalCluster(spec) as cluster:
        settings = RouterSettings(master=cluster.master_address, policy=policy, port=0)
        app, _ = build(settings)
        with TestClient(app) as http:  # type: ignore[arg-type]
            model_id = http.get("/v1/models").json()["data"][0]["id"]

            def ask(prompt: str) -> Answer:
                t = time.monotonic()
                body = {"model": model_id, "prompt": prompt, "max_tokens": 6, "temperature": 0}
                r = http.post("/v1/completions", json=body)
                if r.status_code != 200:
                    return Answer(t, r.status_code, r.text, 0, 0)
                js: dict[str, Any] = r.json()
                usage = js["usage"]
                return Answer(t, 200, js["choices"][0]["text"], usage["prompt_tokens"],
                              usage["prompt_tokens_details"]["cached_tokens"])  # fmt: skip

            cold: list[Answer] = []  # each conversation's first request: nothing cached, the reference
            again: list[Answer] = []  # its second request, right after: cached (node-local or the pool)

            stop = threading.Event()

            def run_until_stopped() -> None:
                while not stop.is_set():
                    prompt = _prompt(len(cold))
                    cold.append(ask(prompt))
                    again.append(ask(prompt))

            traffic = threading.Thread(target=run_until_stopped, daemon=True)
            traffic.start()  # (the master is restarted from this thread: a child dies with its thread)
            try:
                time.sleep(6.0)  # steady state
                t_kill = time.monotonic()
                cluster.master.kill()
                time.sleep(outage_s)
                t_restart = time.monotonic()
                if restart:
                    cluster.restart_master(kill=False)  # (the process is dead already: stop is a no-op)
                    time.sleep(12.0)
            finally:
                stop.set()
                traffic.join(timeout=60)
            health = http.get("/health").json()
            degraded = {name: _metric(httpx.get(f"http://{addr}/metrics").text, "kvpool_prefill_pool_calls_skipped_total")
                        for name, addr in cluster.metrics_addresses.items() if name.startswith("prefill")}  # fmt: skip
            if restart:  # every node re-registered with the new master by itself
                with MasterClient(cluster.master_address) as master:
                    alive = sorted(n.node.node_id for n in master.list_nodes() if n.alive)
                assert alive == ["decode0", "prefill0", "prefill1", "store0"], alive

    # the prefill nodes ran degraded in the outage: local tier + recompute, no pool calls (round-robin:
    # both served; the cost policy may prefer one, whose calibrated recompute is faster)
    assert len(degraded) == 2 and sum(degraded.values()) > 0, degraded
    assert policy != "round-robin" or all(n > 0 for n in degraded.values()), degraded
    failed = [a for a in cold + again if a.status != 200]
    assert not failed, failed[:3]
    assert all(a.cached_tokens == 0 for a in cold), [a for a in cold if a.cached_tokens][:3]
    wrong = [
        (i, a.text, c.text) for i, (c, a) in enumerate(zip(cold, again, strict=True)) if a.text != c.text
    ]
    assert not wrong, wrong[:3]
    before = [a for a in again if a.at_s < t_kill][2:]  # (the first few warm the nodes up)
    level = _hit_rate(before)
    outage_end = t_restart if restart else float("inf")
    during = [a for a in again if t_kill <= a.at_s < outage_end]
    print(f"\n{policy}: {2 * len(cold)} requests ({2 * len(during)} with the master down), 0 failed, 0 wrong")
    print(f"hit rate of repeated prompts: before the kill {level:.2f}, master down {_hit_rate(during):.2f}")
    print("health at the end:", health)
    print("prefill pool calls skipped in degraded mode (local tier + recompute):", degraded)
    assert level > 0.5, level
    if not restart:  # the affinity record keeps each conversation on the node that holds it
        assert health["status"] == "degraded" and health["degraded"][0]["part"] == "master", health
        assert _hit_rate(during) >= 0.8 * level, _hit_rate(during)
        return
    t0 = t_restart
    after = [a for a in again if a.at_s >= t0]
    window = 3
    back_s = next((a.at_s - t0 for k, a in enumerate(after[: len(after) - window + 1])
                   if _hit_rate(after[k : k + window]) >= 0.9 * level), None)  # fmt: skip
    tail = [a for a in after if a.at_s >= t0 + 5.0]
    print(
        f"after the restart: {_hit_rate(after):.2f} (from +5 s: {_hit_rate(tail):.2f}); back to "
        f"{0.9 * level:.2f} or more {back_s if back_s is None else round(back_s, 2)} s after the restart"
    )
    assert health["status"] == "ok", health
    assert back_s is not None and back_s <= 5.0, back_s
    assert _hit_rate(tail) >= 0.9 * level


def test_master_killed_and_restarted_after_20_s_costs_no_request() -> None:
    """Round-robin: a conversation's second request goes to the other prefill node, which pulls the
    prompt from the pool while the master answers: the pool's hits are lost in the outage, and back
    within 5 s of the restart (the store re-reports its inventory, the nodes re-register)."""
    _traffic(20.0, restart=True, policy="round-robin")


def test_master_killed_for_60_s_costs_no_request() -> None:
    """The cost policy: with the master gone for good the router's affinity record sends a
    conversation's second request to the node that computed it: hits from the node-local tiers only."""
    _traffic(60.0, restart=False, policy="cost")
