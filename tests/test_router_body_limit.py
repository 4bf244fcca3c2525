"""The router reads at most `max_request_bytes` of a request body: a longer one is a 413 in OpenAI's shape
before it is parsed (by its `Content-Length`, or while a chunked body streams in), and a client that
hangs up mid-body is no logged server error."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.tenants import Tenants
from tests.test_router_http import NODES, _client

LIMIT = 4096


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return ModelInfo.load(None, block_size=16)


def _body(model: ModelInfo, prompt_chars: int) -> bytes:
    return json.dumps({"model": model.model_id, "prompt": "a" * prompt_chars, "max_tokens": 2}).encode()


def _too_large(r: Any) -> str:
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "request_too_large", err
    assert f"the limit is {LIMIT} bytes" in err["message"], err
    return str(err["message"])


def test_a_body_at_the_limit_is_served_one_byte_more_is_413(model: ModelInfo) -> None:
    client, _ = _client(model, NODES, max_request_bytes=LIMIT)
    overhead = len(_body(model, 0))
    ok = client.post("/v1/completions", content=_body(model, LIMIT - overhead))
    assert ok.status_code == 200, ok.text
    msg = _too_large(client.post("/v1/completions", content=_body(model, LIMIT - overhead + 1)))
    assert f"is {LIMIT + 1} bytes" in msg, msg
    chat = {"model": model.model_id, "messages": [{"role": "user", "content": "b" * LIMIT}]}
    _too_large(client.post("/v1/chat/completions", json=chat))


def test_a_chunked_body_is_cut_off_at_the_limit(model: ModelInfo) -> None:
    """No Content-Length: the router stops reading once the body passes the limit."""
    client, _ = _client(model, NODES, max_request_bytes=LIMIT)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "x", "prompt": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}'

    msg = _too_large(client.post("/v1/completions", content=chunks()))
    assert f"is more than {LIMIT} bytes" in msg, msg
    ok = client.post("/v1/completions", content=iter([_body(model, 10)]))
    assert ok.status_code == 200, ok.text


def test_the_default_limit_is_16_mib(model: ModelInfo) -> None:
    client, svc = _client(model, NODES)
    assert svc.settings.max_request_bytes == 16 * 2**20
    r = client.post("/v1/completions", content=b"{}", headers={"content-length": str(16 * 2**20 + 1)})
    assert r.status_code == 413, r.text


def test_a_client_gone_mid_body_logs_no_error(model: ModelInfo, caplog: pytest.LogCaptureFixture) -> None:
    """ASGI delivers the disconnect (a client that announced more than it sent and hung up)."""
    _, svc = _client(model, NODES)
    app = build_app(svc, Tenants.open())
    messages = [
        {"type": "http.request", "body": b'{"model": "', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-length", b"1000")], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    with caplog.at_level(logging.DEBUG, logger="kvpool"):
        asyncio.run(app(scope, receive, send))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400, sent


def test_the_body_is_parsed_and_checked_off_the_event_loop(
    model: ModelInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON parsing and the allow-list and type checks run on a worker thread (no running event loop
    there), so a large body never stalls the loop's other requests (issue 46)."""
    from kvpool.router import http, schemas

    on_loop: dict[str, bool] = {}

    def spy(name: str, fn: Any) -> Any:
        def wrapped(*args: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop[name] = True
            except RuntimeError:
                on_loop[name] = False
            return fn(*args)

        return wrapped

    monkeypatch.setattr(schemas, "_json_object", spy("parse", schemas._json_object))
    monkeypatch.setattr(http.OpenAIApp, "_validate", staticmethod(spy("check", http.OpenAIApp._validate)))
    client, _ = _client(model, NODES)
    assert client.post("/v1/completions", content=_body(model, 10)).status_code == 200
    assert on_loop == {"parse": False, "check": False}, on_loop
