"""Fuzz the router's HTTP API on a live cluster: never a 5xx, OpenAI's error shape on every 4xx, and an
oversized prompt is a 400 that states the limit (issue #12, bad input)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvpool.router.model_info import ModelInfo
from tests.fuzz.cluster import MAX_NEW, MAX_PROMPT, Cases
from tests.fuzz.http_fuzz import Endpoint, check, endpoints, fuzz

DEFAULT_CASES = 25
"""Per route in the default run."""


@pytest.fixture(scope="package")
def http(router: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router, timeout=60) as c:
        yield c


@pytest.mark.parametrize("ep", endpoints("m"), ids=lambda e: e.name)
def test_fuzz_route(http: httpx.Client, model: ModelInfo, ep: Endpoint, cases: Cases) -> None:
    real = next(e for e in endpoints(model.model_id) if e.name == ep.name)
    fuzz(http, real, DEFAULT_CASES, cases)


def _error(resp: httpx.Response, status: int) -> dict[str, object]:
    check(resp, "probe")
    assert resp.status_code == status, resp.text
    return dict(resp.json()["error"])


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "z" * (MAX_PROMPT + 1)},
        {"prompt": [5] * (MAX_PROMPT + 1)},
        {"messages": [{"role": "user", "content": "z" * (MAX_PROMPT + 1)}]},
    ],
    ids=["text", "token_ids", "chat"],
)
def test_oversized_prompt_is_400_stating_the_limit(http: httpx.Client, model: ModelInfo, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = _error(http.post(path, json={"model": model.model_id, "max_tokens": 2, **body}), 400)
    assert f"the limit is {MAX_PROMPT} tokens" in str(err["message"])
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_huge_max_tokens_is_400_stating_the_limit(http: httpx.Client, model: ModelInfo) -> None:
    body = {"model": model.model_id, "prompt": "hi", "max_tokens": 10**12}
    err = _error(http.post("/v1/completions", json=body), 400)
    assert f"the limit is {MAX_NEW}" in str(err["message"]) and err["param"] == "max_tokens"


def test_chat_without_max_tokens_fits_the_limit(http: httpx.Client, model: ModelInfo) -> None:
    """The default max_tokens never exceeds the configured limit (the caller asked for nothing)."""
    body = {"model": model.model_id, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= MAX_NEW


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("GET", "/v1/nothing", 404)],
)
def test_unknown_routes_use_the_error_shape(http: httpx.Client, method: str, path: str, status: int) -> None:
    _error(http.request(method, path), status)


def test_deeply_nested_json_is_400(http: httpx.Client) -> None:
    err = _error(http.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000), 400)
    assert "JSON" in str(err["message"])


def test_router_still_answers_after_the_fuzz(http: httpx.Client, model: ModelInfo) -> None:
    assert http.get("/health").status_code == 200
    body = {"model": model.model_id, "prompt": "The pool", "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    assert http.post("/v1/completions", json=body).json()["choices"] == first.json()["choices"]
