"""The router over vLLM engines (issue #25; `kvpool.router.vllm_pd`, `kvpool.router.vllm_http`), fast.

A real master on 127.0.0.1:0 lists engines registered as `vllm-prefill` / `vllm-decode` with their URLs;
the engines are small OpenAI HTTP servers (uvicorn on ephemeral ports) that record what they receive and
can fail at a chosen moment (a refused connection, a stream cut mid-way): faults a real vLLM engine does
not produce on cue. The real engines are exercised in tests/vllm/test_vllm_pd.py.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvpool.client import EngineNamespace, MasterClient, NodeInfo
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from kvpool.router.vllm_http import build_vllm_app
from kvpool.router.vllm_pd import VllmEngines, decode_body, prefill_body, tokenize_body
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import DEFAULT_LAYOUT
from kvpool.vllm.pd import prefill_blocks, wait_committed
from tests.asgi_server import AsgiServer

REPORT = {"num_saved_blocks": 3, "decision": "none"}


class FakeEngine:
    """An OpenAI server on 127.0.0.1:0 that records request bodies. `cut_stream_after`: chunks sent before
    the connection is dropped mid-stream."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.cut_stream_after: int | None = None
        app = Starlette(
            routes=[
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models),
            ]
        )
        self._server = AsgiServer(app)
        self.url = self._server.url

    def stop(self) -> None:
        self._server.stop()

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages"))
        return JSONResponse({"tokens": list(text.encode())[:4000], "count": len(text)})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body.get("model") != "m":
            return JSONResponse({"error": {"message": "The model does not exist."}}, status_code=404)
        if body.get("max_tokens") == 1:
            return JSONResponse({"choices": [{"text": "p"}], "kv_transfer_params": {"kvpool": REPORT}})
        if not body.get("stream"):
            return JSONResponse(
                {
                    "choices": [{"text": "decoded"}],
                    "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}},
                }
            )

        async def chunks() -> AsyncIterator[str]:
            for i in range(5):
                if self.cut_stream_after is not None and i == self.cut_stream_after:
                    raise RuntimeError("engine died")  # uvicorn drops the connection mid-body
                yield f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")


def _closed_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"  # nothing listens: connection refused


ENGINE_NS = EngineNamespace("m", "w1", DEFAULT_LAYOUT, "vllm-test")


@pytest.fixture
def cluster() -> Iterator[dict[str, Any]]:
    master: MasterServer = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False))
    engines = {"p0": FakeEngine(), "d0": FakeEngine(), "d1": FakeEngine()}
    mc = MasterClient(master.address)
    try:
        yield {"master": master, "engines": engines, "client": mc, "register": lambda *a: _register(mc, *a)}
    finally:
        mc.close()
        for e in engines.values():
            e.stop()
        master.stop()


def _register(mc: MasterClient, node_id: str, role: str, url: str) -> None:
    mc.register_node(
        NodeInfo(node_id, role, "", "", 1, url, ENGINE_NS),
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=DEFAULT_LAYOUT,
    )


def _router(cluster: dict[str, Any], tenants: Tenants | None = None) -> TestClient:
    settings = RouterSettings(master=cluster["master"].address, engines="vllm", node_backoff_s=30.0)
    engines = VllmEngines(settings, cluster["client"]).start()
    return TestClient(build_vllm_app(engines, tenants or Tenants.open()))


def test_prefill_then_decode_with_the_prefills_report(cluster: dict[str, Any]) -> None:
    e = cluster["engines"]
    cluster["register"]("p0", "vllm-prefill", e["p0"].url)
    cluster["register"]("d0", "vllm-decode", e["d0"].url)
    with _router(cluster) as client:
        r = client.post(
            "/v1/completions",
            json={
                "model": "m",
                "prompt": "hello " * 40,
                "max_tokens": 9,
                "stream": True,
                "cache_salt": "mine",
            },
        )
        assert r.status_code == 200 and "data: [DONE]" in r.text
        assert client.get("/health").json() == {"status": "ok", "prefill": 1, "decode": 1}
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
        metrics = client.get("/metrics").text
    (pre,) = e["p0"].bodies
    assert pre["max_tokens"] == 1 and "stream" not in pre and pre["prompt"] == "hello " * 40
    (dec,) = e["d0"].bodies
    assert dec["max_tokens"] == 9 and dec["stream"] is True
    assert dec["kv_transfer_params"] == {"kvpool_prefill": REPORT}
    assert dec["cache_salt"] == pre["cache_salt"] != "mine"  # the client's salt, hashed under the tenant's
    assert 'kvpool_router_requests_total{code="200",endpoint="completions"} 1.0' in metrics


def test_an_unreachable_prefill_engine_is_failed_over(cluster: dict[str, Any]) -> None:
    e = cluster["engines"]
    cluster["register"]("p-dead", "vllm-prefill", _closed_url())
    cluster["register"]("p0", "vllm-prefill", e["p0"].url)
    cluster["register"]("d0", "vllm-decode", e["d0"].url)
    with _router(cluster) as client:
        for _ in range(3):
            r = client.post(
                "/v1/chat/completions",
                json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "decoded"
    assert len(e["p0"].bodies) == 3 and all(b["max_completion_tokens"] == 1 for b in e["p0"].bodies)


def test_a_decode_engine_dying_mid_stream_ends_that_stream_with_one_error(cluster: dict[str, Any]) -> None:
    e = cluster["engines"]
    cluster["register"]("p0", "vllm-prefill", e["p0"].url)
    cluster["register"]("d0", "vllm-decode", e["d0"].url)
    cluster["register"]("d1", "vllm-decode", e["d1"].url)
    e["d0"].cut_stream_after = 2  # d0 is chosen first (ties by id)
    with _router(cluster) as client:
        r = client.post(
            "/v1/completions", json={"model": "m", "prompt": "x" * 300, "max_tokens": 50, "stream": True}
        )
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[:2] == ['data: {"choices": [{"text": "0"}]}', 'data: {"choices": [{"text": "1"}]}']
        assert len(events) == 3 and "failed mid-stream" in json.loads(events[2][6:])["error"]["message"]
        for _ in range(2):  # later requests go to the other decode engine
            ok = client.post(
                "/v1/completions", json={"model": "m", "prompt": "y" * 300, "max_tokens": 50, "stream": True}
            )
            assert ok.text.rstrip().endswith("data: [DONE]")
    assert len(e["d0"].bodies) == 1 and len(e["d1"].bodies) == 2


def test_errors_are_clear_and_an_engines_refusal_passes_through(cluster: dict[str, Any]) -> None:
    with _router(cluster) as client:
        assert client.post("/v1/completions", content=b"[1]").status_code == 400
        nobody = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert (
            nobody.status_code == 503 and "no live vLLM prefill engine" in nobody.json()["error"]["message"]
        )
        assert client.get("/health").status_code == 503
        e = cluster["engines"]
        cluster["register"]("p0", "vllm-prefill", e["p0"].url)
        cluster["register"]("d0", "vllm-decode", e["d0"].url)
        time.sleep(0.3)  # the node list refreshes every 0.25 s
        wrong = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert wrong.status_code == 404 and "does not exist" in wrong.text  # vLLM's answer, unchanged
        assert (
            client.post("/v1/completions", json={"model": "m", "prompt": "x", "cache_salt": 5}).status_code
            == 400
        )


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("completions", "prompt_embeds", "AAAA"),
        ("completions", "kv_transfer_params", {"do_remote_prefill": True}),
        ("completions", "lora_request", {"lora_name": "x"}),
        ("completions", "logprobs", 5),
        ("chat", "chat_template", "{{ messages }}"),
        ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]),
        ("chat", "structured_outputs", {"json": {}}),
    ],
)
def test_the_native_routers_allow_list_applies(
    cluster: dict[str, Any], kind: str, field: str, value: Any
) -> None:
    """A field the native router refuses is a 400 naming it, and no engine sees the request; a field at
    its neutral value is dropped before the engines."""
    e = cluster["engines"]
    cluster["register"]("p0", "vllm-prefill", e["p0"].url)
    cluster["register"]("d0", "vllm-decode", e["d0"].url)
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": 3}
    body |= {"prompt": "hi"} if kind == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with _router(cluster) as client:
        refused = client.post(path, json=body | {field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
        assert e["p0"].bodies == [] and e["d0"].bodies == []
        ok = client.post(
            path, json=body | {"logprobs": False, "tools": [], "ignore_eos": True, "min_tokens": 2}
        )
        assert ok.status_code == 200, ok.text
    assert not {"logprobs", "tools"} & set(e["d0"].bodies[0])
    # vLLM's own sampling controls reach the engines (a benchmark's ignore_eos was refused as unsupported)
    assert e["d0"].bodies[0]["ignore_eos"] is True and e["d0"].bodies[0]["min_tokens"] == 2


def test_bodies_and_reports() -> None:
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"a": 1},
        "n": 1,
        "kv_transfer_params": {"evil": True},
    }
    assert prefill_body(body, "completions") == {"model": "m", "prompt": "p", "max_tokens": 1, "n": 1}
    assert decode_body(body, None) == {k: v for k, v in body.items() if k != "kv_transfer_params"}
    assert decode_body(body, REPORT)["kv_transfer_params"] == {"kvpool_prefill": REPORT}
    assert tokenize_body({"prompt": [1, 2, 3]}, "completions") == {"tokens": [1, 2, 3]}
    chat = {"model": "m", "messages": [{"role": "user", "content": "c"}], "tools": [{"x": 1}], "top_p": 0.5}
    assert tokenize_body(chat, "chat") == {"model": "m", "messages": chat["messages"], "tools": [{"x": 1}]}

    class Req:
        def __init__(self, params: Any) -> None:
            self.kv_transfer_params = params

    assert prefill_blocks(Req({"kvpool_prefill": {"num_saved_blocks": 4}})) == 4
    for bad in (
        None,
        {},
        {"kvpool_prefill": 3},
        {"kvpool_prefill": {"num_saved_blocks": True}},
        {"kvpool_prefill": {"num_saved_blocks": -2}},
        {"kvpool_prefill": {"num_saved_blocks": "9"}},
    ):
        assert prefill_blocks(Req(bad)) == 0


def test_a_decode_waits_for_the_prefills_blocks_at_most_pd_wait_s(cluster: dict[str, Any]) -> None:
    """Nothing committed: the wait ends after `wait_s` with 0 blocks (the decode then recomputes)."""
    ns = ENGINE_NS.namespace("").digest()
    t0 = time.monotonic()
    assert wait_committed(cluster["client"], ns, [bytes(16)] * 3, 0.3) == 0
    assert 0.3 <= time.monotonic() - t0 < 5
