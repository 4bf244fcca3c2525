"""The HTTP layer in-process (Starlette's test client, a fake master and fake nodes): OpenAI error codes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvpool.client.types import Match, NodeInfo, NodeLoad, NodeStatus
from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo, simple_chat_prompt
from kvpool.router.service import Event, RouterService
from kvpool.router.settings import RouterSettings
from kvpool.router.tenants import Tenants
from tests.tenant_files import SALT_KEY, write_private


class FakeMaster:
    def __init__(self, nodes: list[NodeStatus]) -> None:
        self.nodes = nodes

    def list_nodes(self) -> list[NodeStatus]:
        return self.nodes

    def register_namespace(self, model_id: str, version: str, layout: str, *, cache_salt: str = "") -> Any:
        return b"", ""

    def match(self, ns: bytes, hashes: list[bytes], **_: Any) -> Match:
        return Match(0, [], None, {})


def _node(node_id: str, role: str) -> NodeStatus:
    info = NodeInfo(node_id=node_id, role=role, grpc_address="127.0.0.1:1", data_address="", epoch=1)
    return NodeStatus(
        node=info, alive=True, draining=False, num_slots=0, num_used_slots=0, num_blocks=0, used_bytes=0,
        load=NodeLoad(),
    )  # fmt: skip


class FakeService(RouterService):
    """Placement is real; the gRPC part is replaced by a canned answer."""

    def generate(
        self, tokens: Any, sampling: Any, *, cache_salt: str = "", request_id: str = ""
    ) -> Iterator[Event]:  # type: ignore[override]
        choice, node = self.place(tokens, cache_salt)
        self.inflight.end(node.node.node_id, node.node.epoch, choice.prediction.service_s)
        self.pick_decode()
        common = {"prompt_tokens": len(tokens), "cached_tokens": 0, "prefill_node": node.node.node_id}
        yield Event("first", token_ids=[ord("o")], **common)  # type: ignore[arg-type]
        yield Event("tokens", token_ids=[ord("k"), ord("!")])
        yield Event("done", finish_reason="length", **common)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return ModelInfo.load(None, block_size=16)


def _client(model: ModelInfo, nodes: list[NodeStatus], **settings: Any) -> tuple[TestClient, RouterService]:
    tenants = settings.pop("tenants", None) or Tenants.open()
    svc = FakeService(RouterSettings(**settings), FakeMaster(nodes), model)
    svc.refresh()
    return TestClient(build_app(svc, tenants)), svc


NODES = [_node("p0", "prefill"), _node("d0", "decode")]


def test_completion_and_chat_ok(model: ModelInfo) -> None:
    client, _ = _client(model, NODES)
    r = client.post("/v1/completions", json={"model": model.model_id, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == "ok!"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
    r = client.post("/v1/chat/completions", json={"model": model.model_id, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200
    lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"role": "assistant"' in lines[0]


def test_error_codes(model: ModelInfo) -> None:
    client, svc = _client(model, NODES, max_prompt_tokens=100, max_inflight=2)
    m = model.model_id

    def err(r: Any, status: int) -> dict[str, Any]:
        assert r.status_code == status, r.text
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        return dict(e)

    assert (
        err(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)["code"]
        == "model_not_found"
    )
    e = err(client.post("/v1/completions", json={"model": m, "prompt": "x" * 200}), 400)
    assert "the limit is 100 tokens" in e["message"] and e["code"] == "context_length_exceeded"
    assert err(client.post("/v1/completions", json={"model": m}), 400)["param"] == "prompt"
    e = err(
        client.post("/v1/completions", json={"model": m, "prompt": 5}), 400
    )  # matches no member of the union
    assert (
        e["param"] == "prompt"
        and e["message"] == "prompt: wrong type: expected one of str, list[str], list[int]"
    )
    e = err(
        client.post("/v1/chat/completions", json={"model": m, "messages": [{"role": "user", "content": 5}]}),
        400,
    )
    assert e["param"] == "messages.0.content", e
    assert err(client.post("/v1/completions", json={"model": m, "prompt": "x", "temperature": 9}), 400)
    assert err(client.post("/v1/completions", json={"model": m, "prompt": [999]}), 400)
    assert err(client.post("/v1/completions", json={"model": m, "prompt": "x", "n": 2}), 400)["param"] == "n"
    assert err(
        client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    assert err(client.post("/v1/chat/completions", json={"model": m, "messages": []}), 400)
    svc.admit()
    svc.admit()  # the router is full
    assert err(client.post("/v1/completions", json={"model": m, "prompt": "x"}), 429)["code"] == "overloaded"
    svc.release()
    svc.release()
    assert client.post("/v1/completions", json={"model": m, "prompt": "x"}).status_code == 200


def test_no_nodes_is_503(model: ModelInfo) -> None:
    client, _ = _client(model, [_node("d0", "decode")])
    r = client.post("/v1/completions", json={"model": model.model_id, "prompt": "x"})
    assert r.status_code == 503 and "no live prefill node" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 503
    client, _ = _client(model, [_node("p0", "prefill")])
    r = client.post("/v1/completions", json={"model": model.model_id, "prompt": "x"})
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"]


def test_unknown_api_key_is_401(model: ModelInfo, tmp_path: Any) -> None:
    tfile = write_private(tmp_path / "t.toml", '[[tenants]]\nname = "a"\napi_keys = ["ka"]\n')
    client, _ = _client(model, NODES, tenants=Tenants.load(tfile, SALT_KEY))
    body = {"model": model.model_id, "prompt": "x"}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert (
        client.post("/v1/completions", json=body, headers={"Authorization": "Bearer kb"}).status_code == 401
    )
    assert (
        client.post("/v1/completions", json=body, headers={"Authorization": "Bearer ka"}).status_code == 200
    )


def test_chat_template_of_the_embedded_model(model: ModelInfo) -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert simple_chat_prompt(msgs) == "<|system|>\nS\n<|user|>\nU\n<|assistant|>\n"
    ids = model.chat_prompt_ids(msgs)
    assert ids[0] == 256 and bytes(ids[1:]).decode() == simple_chat_prompt(msgs)


def test_bad_tenants_file_names_file_and_field(tmp_path: Any) -> None:
    from kvpool.errors import InvalidArgument

    tfile = write_private(tmp_path / "t.toml", '[[tenants]]\nname = "a"\napi_keys = []\n')
    with pytest.raises(InvalidArgument, match=r"t\.toml: tenants\.0\.api_keys"):
        Tenants.load(tfile)


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 0.5), ("frequency_penalty", 2), ("repetition_penalty", 1.2), ("logit_bias", {"65": 100}),
     ("min_p", 0.1), ("min_tokens", 5), ("ignore_eos", True), ("response_format", {"type": "json_object"})],
)  # fmt: skip
def test_sampling_controls_the_nodes_lack_are_refused_not_ignored(
    model: ModelInfo, field: str, value: Any
) -> None:
    """Found by a new-user pass: logit_bias, frequency_penalty, ignore_eos + min_tokens and a JSON
    response_format were accepted and silently ignored (200, the same tokens as without them)."""
    client, _ = _client(model, NODES)
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        r = client.post(path, json={"model": model.model_id, **body, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and "not supported" in r.json()["error"]["message"]
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "logit_bias": {},
               "min_p": 0, "min_tokens": 0, "ignore_eos": False, "response_format": {"type": "text"}}  # fmt: skip
    r = client.post("/v1/completions", json={"model": model.model_id, "prompt": "hi", field: neutral[field]})
    assert r.status_code == 200, r.text  # the "off" value clients send by default is fine


def test_a_lone_surrogate_is_a_400_not_a_500(model: ModelInfo) -> None:
    """Found by a new-user pass: "\\ud800" in a prompt (valid JSON, not encodable text) reached the
    tokenizer's UTF-8 encode and answered 500. Any string of the body: prompt, message content, stop."""
    client, _ = _client(model, NODES)
    json_headers = {"content-type": "application/json"}
    cases = [
        ("/v1/completions", '{"model": "M", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", '{"model": "M", "prompt": "x", "stream": true, "stop": ["\\udc00"]}', "stop.0"),
        ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "hi \\udc00"}]}',
         "messages.0.content"),
    ]  # fmt: skip
    for path, body, where in cases:
        r = client.post(
            path, content=body.replace('"M"', f'"{model.model_id}"').encode(), headers=json_headers
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == where and "surrogate" in r.json()["error"]["message"]
    ok = '{"model": "M", "prompt": "caf\\u00e9 \\ud83d\\ude00"}'  # a valid pair is one emoji: fine
    r = client.post(
        "/v1/completions", content=ok.replace('"M"', f'"{model.model_id}"').encode(), headers=json_headers
    )
    assert r.status_code == 200, r.text


def test_a_router_port_in_use_is_one_line_naming_it() -> None:
    """Found by a new-user pass: `kvpool router --port <in use>` said only `OSError: [Errno 98] Address
    already in use`."""
    import socket
    import subprocess
    import sys

    from kvpool.master import MasterSettings, serve

    master = serve(MasterSettings(port=0))
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "router", "--port", str(port), "--master",
             master.address],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        # exit 2, a setting that cannot work: `kvpool up` stops at once instead of restarting it for a minute
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"cannot bind the router to 127.0.0.1:{port}" in out.stderr.strip().splitlines()[-1], (
            out.stderr
        )
    finally:
        busy.close()
        master.stop()
