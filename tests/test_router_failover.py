"""The router when a serving node dies (kill -9) while the master still lists it alive: failover, no 503.

Live test: real processes (master, 2 prefill, 2 decode; no store: prompts are computed, publishes fail
softly) and the real router app (`kvpool.router.serve.build`, what `kvpool router` serves) in this
process behind Starlette's test client. The master's heartbeat timeout is 60 s, so for the whole test
it keeps listing the killed nodes alive: only the router's own failover keeps the requests served.

In-process tests (fake node stubs) pin the rules that need a failure at a chosen moment: a decode stream
that already sent tokens is never retried; no other node left → 503 naming the failure; a node in
back-off is tried again once the back-off ends, and a node that answers leaves back-off.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from starlette.testclient import TestClient

from kvpool.client import MasterClient
from kvpool.client.types import NodeInfo, NodeLoad, NodeStatus
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.errors import Unavailable
from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.serve import build
from kvpool.router.service import RouterService
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from kvpool.sampling import SamplingParams
from kvpool.v1 import kvpool_pb2 as pb
from tests.test_router_http import FakeMaster

BLOCK = 16


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text `text` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    return 0.0


def test_requests_fail_over_when_a_prefill_and_a_decode_node_are_killed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by a new-user pass: after `kill -9` of one of two prefill nodes about half the requests
    answered 503 `prefill on p2: failed to connect to all addresses … Connection refused` until the
    master's heartbeat timeout declared the node dead, although the other node was healthy. Now a call
    that fails to reach its node (UNAVAILABLE) before anything of it went to the client puts that node in
    a local back-off and is retried on the next node the same policy chooses."""
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, num_stores=0, num_prefill=2, num_decode=2, block_size=BLOCK, heartbeat_timeout_ms=60_000
    )  # fmt: skip
    with LocalCluster(spec) as cluster:
        settings = RouterSettings(
            master=cluster.master_address, policy="round-robin", node_backoff_s=60.0, port=0
        )  # fmt: skip
        app, svc = build(settings)
        assert isinstance(svc, RouterService)
        with TestClient(app) as http:  # type: ignore[arg-type]
            model = svc.model.model_id

            def ask(i: int, *, stream: bool = False) -> Any:
                body = {"model": model, "prompt": f"request {i}: tell me about the pool", "max_tokens": 4,
                        "temperature": 0, "stream": stream}  # fmt: skip
                return http.post("/v1/completions", json=body)

            assert http.get("/health").json()["prefill"] == 2
            before = [ask(i).json()["choices"][0]["text"] for i in range(2)]  # one on each prefill node

            cluster.prefill[1].kill()
            cluster.decode[1].kill()
            time.sleep(0.2)  # the connections are gone; the master still lists both nodes alive
            assert http.get("/health").json() == {"status": "ok", "prefill": 2, "decode": 2, "inflight": 0}

            caplog.set_level(logging.WARNING, logger="kvpool.router.service")
            t0 = time.monotonic()
            for i in range(8):
                r = ask(i, stream=i % 3 == 2)
                assert r.status_code == 200, r.text
                if i % 3 == 2:  # SSE: the decode failover happens after the first chunk went out
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
                elif i < 2:
                    assert r.json()["choices"][0]["text"] == before[i]  # same answer as before the kill
            assert time.monotonic() - t0 < 9.0  # well before any heartbeat timeout (60 s here anyway)
            with MasterClient(cluster.master_address) as m:  # it never noticed: the router's failover did it
                alive = {n.node.node_id for n in m.list_nodes() if n.alive}
            assert {"prefill1", "decode1"} <= alive

            health = http.get("/health")  # still serving (200), the dead nodes named as degraded parts
            assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
            parts = {p["part"]: p for p in health.json()["degraded"]}
            assert set(parts) == {"prefill prefill1", "decode decode1"}, parts
            assert all("back-off" in p["reason"] and p["for_s"] < 60 for p in parts.values()), parts

            text = http.get("/metrics").text
            assert _metric(text, "kvpool_router_degraded_since_seconds", part="prefill prefill1") > 0, text
            for role, dead in (("prefill", "prefill1"), ("decode", "decode1")):
                # one failed call, then the node is in back-off: later requests avoid it
                assert _metric(text, "kvpool_router_node_failures_total", role=role, node=dead) == 1, text
                assert _metric(text, "kvpool_router_retries_total", role=role) == 1, text
            assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="200") == 10
            assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="503") == 0
            logged = [r.getMessage() for r in caplog.records]
            assert any("prefill1" in m and "retrying on prefill0" in m for m in logged), logged
            assert any("decode1" in m and "retrying on decode0" in m for m in logged), logged


def test_metrics_count_requests_not_attempts_in_a_replay_with_failover_and_failures() -> None:
    """Field case B40: 100 requests; 10 fail over to the second prefill node, 5 fail outright. Decision
    counters count requests (a retry is counted in `retries_total`, not as another decision); predicted
    and measured TTFT, and cached, predicted cached and prompt tokens, are recorded at one point (the
    first token) for one set of requests (those served), so every ratio compares like with like and
    cached/prompt <= 1."""
    layout = ModelInfo.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, num_stores=1, num_prefill=2, num_decode=1, block_size=BLOCK, segment_size="64MiB",
        heartbeat_timeout_ms=60_000,
    )  # fmt: skip
    with LocalCluster(spec) as cluster:
        # round-robin and no back-off: after prefill1 dies, every request is placed on it first and fails over
        settings = RouterSettings(
            master=cluster.master_address, policy="round-robin", node_backoff_s=0.0, port=0
        )
        app, svc = build(settings)
        assert isinstance(svc, RouterService)
        with TestClient(app) as http:  # type: ignore[arg-type]
            model = svc.model.model_id
            served: list[dict[str, Any]] = []

            def ask(i: int) -> int:
                body = {"model": model, "prompt": DOC + f"question {i}?", "max_tokens": 2, "temperature": 0,
                        "stream": i % 4 == 3, "stream_options": {"include_usage": True}}  # fmt: skip
                r = http.post("/v1/completions", json=body)
                if r.status_code == 200:
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    usage = json.loads(events[-2])["usage"] if body["stream"] else r.json()["usage"]
                    served.append(usage)
                return r.status_code

            codes = [ask(i) for i in range(85)]  # an odd count: the next placement is on prefill1
            cluster.prefill[1].kill()
            time.sleep(0.2)
            codes += [ask(i) for i in range(85, 95)]  # each placed on prefill1, failed over to prefill0
            cluster.prefill[0].kill()
            time.sleep(0.2)
            codes += [ask(i) for i in range(95, 100)]  # both unreachable: 503 after one retry each
            assert codes == [200] * 95 + [503] * 5, codes
            text = http.get("/metrics").text

        def decisions(outcome: str) -> float:
            return sum(_metric(text, "kvpool_router_routing_decisions_total", node=n, outcome=outcome,
                               policy="round-robin") for n in ("prefill0", "prefill1"))  # fmt: skip

        assert decisions("served") + decisions("failed") == 100  # requests, not attempts
        assert decisions("failed") == 5
        assert _metric(text, "kvpool_router_routing_decisions_total", node="prefill1", outcome="served",
                       policy="round-robin") == 42  # fmt: skip  # before the kill only: half of 85
        assert _metric(text, "kvpool_router_retries_total", role="prefill") == 10 + 5  # attempts - requests
        # predicted vs measured TTFT: the same 95 requests
        assert _metric(text, "kvpool_router_ttft_seconds_count") == 95
        assert _metric(text, "kvpool_router_predicted_ttft_seconds_count") == 95
        # token ratios: numerator and denominator over the same 95 requests, as the clients saw them
        prompt = _metric(text, "kvpool_router_prompt_tokens_total")
        cached = _metric(text, "kvpool_router_cached_tokens_total")
        predicted = _metric(text, "kvpool_router_predicted_cached_tokens_total")
        assert len(served) == 95
        assert prompt == sum(u["prompt_tokens"] for u in served)
        assert cached == sum(u["prompt_tokens_details"]["cached_tokens"] for u in served)
        assert 0 < cached <= prompt and 0 < predicted <= prompt  # the shared DOC prefix was reused
        assert all(u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"] for u in served)
        assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="200") == 95
        assert _metric(text, "kvpool_router_requests_total", endpoint="completions", code="503") == 5


DOC = "The pool keeps KV blocks in CPU memory on store nodes; prefill nodes publish them. " * 2


# ---- in-process: fake node stubs ------------------------------------------------------------------


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_REFUSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused"


class _Node:
    """A fake prefill or decode stub: `dead` refuses every call; `die_after` tokens, then the link drops."""

    def __init__(self, *, dead: bool = False, die_after: int | None = None) -> None:
        self.dead, self.die_after, self.calls = dead, die_after, 0

    def Prefill(self, req: pb.PrefillRequest, timeout: float) -> Iterator[pb.PrefillEvent]:  # noqa: N802
        self.calls += 1
        if self.dead:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE, _REFUSED)
        yield pb.PrefillEvent(first_token=pb.PrefillFirstToken(token_id=ord("o")))
        yield pb.PrefillEvent(published=pb.PrefillPublished(status="committed"))

    def Decode(self, req: pb.DecodeRequest, timeout: float) -> Iterator[pb.DecodeEvent]:  # noqa: N802
        self.calls += 1
        if self.dead:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE, _REFUSED)
        for i in range(req.sampling.max_tokens - 1):
            if self.die_after is not None and i >= self.die_after:
                raise _RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            yield pb.DecodeEvent(token_ids=[ord("k")])
        yield pb.DecodeEvent(finished=True)


def _service(stubs: dict[str, _Node], **settings: Any) -> RouterService:
    nodes = [
        NodeStatus(
            node=NodeInfo(node_id=i, role="prefill" if i.startswith("p") else "decode", grpc_address=i,
                          data_address="", epoch=1),
            alive=True, draining=False, num_slots=0, num_used_slots=0, num_blocks=0, used_bytes=0, load=NodeLoad(),
        )
        for i in sorted(stubs)
    ]  # fmt: skip
    svc = RouterService(RouterSettings(**settings), FakeMaster(nodes), ModelInfo.load(None, block_size=16))
    svc.node_client._stub = lambda address, kind: stubs[address]  # type: ignore[method-assign]
    svc.refresh()
    return svc


def _run(svc: RouterService, max_tokens: int = 4) -> list[Any]:
    return list(svc.generate([1, 2, 3], SamplingParams(max_tokens=max_tokens)))


def test_a_decode_stream_that_sent_tokens_is_not_retried() -> None:
    stubs = {"p0": _Node(), "d0": _Node(die_after=1), "d1": _Node(die_after=1)}
    svc = _service(stubs)
    out: list[Any] = []
    with pytest.raises(Unavailable, match="decode on d[01]: Socket closed"):
        for ev in svc.generate([1, 2, 3], SamplingParams(max_tokens=4)):
            out.append(ev)
    assert [e.kind for e in out] == ["first", "tokens"]  # one decode token went out: no second decode
    assert stubs["d0"].calls + stubs["d1"].calls == 1
    assert svc.metrics.retries.labels("decode")._value.get() == 0


def test_no_other_node_left_is_503_naming_the_failure() -> None:
    app_svc = _service({"p0": _Node(dead=True), "d0": _Node()})
    http = TestClient(build_app(app_svc, Tenants.open()))
    r = http.post("/v1/completions", json={"model": app_svc.model.model_id, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("prefill on p0: failed to connect") and "no other prefill node" in message
    text = http.get("/metrics").text
    assert _metric(text, "kvpool_router_node_failures_total", role="prefill", node="p0") == 1


def test_back_off_ends_and_a_node_that_answers_leaves_it() -> None:
    stubs = {"p0": _Node(), "p1": _Node(dead=True), "d0": _Node()}
    svc = _service(stubs, policy="round-robin", node_backoff_s=0.3)
    assert all(ev.prefill_node in ("", "p0") for _ in range(4) for ev in _run(svc))
    assert stubs["p1"].calls == 1  # then in back-off: not tried again
    time.sleep(0.35)
    stubs["p1"].dead = False  # it answers again: used again, in turn
    served = [next(iter(_run(svc))).prefill_node for _ in range(4)]
    assert sorted(served) == ["p0", "p0", "p1", "p1"], served
    # all nodes in back-off: they are still tried (a back-off is a hint, not a verdict)
    stubs["p0"].dead = stubs["p1"].dead = True
    for _ in range(2):
        with pytest.raises(Unavailable):
            _run(svc)
    stubs["p0"].dead = False
    assert next(iter(_run(svc))).prefill_node == "p0"
