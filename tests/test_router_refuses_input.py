"""Input is refused, never silently reinterpreted (field case B32, issue #26): a body field the router
does not implement is a 400 in OpenAI's shape naming it, by an allow-list (an unknown field is refused);
harmless bookkeeping fields are accepted; `GET /v1/models/{model}`."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from starlette.testclient import TestClient

from kvpool.router.http import build_app
from kvpool.router.model_info import ModelInfo
from kvpool.router.tenants import Tenants
from tests.test_router_http import NODES, _client

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


@pytest.fixture(scope="module")
def model() -> ModelInfo:
    return ModelInfo.load(None, block_size=16)


@pytest.fixture(scope="module")
def client(model: ModelInfo) -> TestClient:
    return _client(model, NODES)[0]


def _post(client: TestClient, model: ModelInfo, path: str, body: dict[str, Any]) -> Any:
    base = COMPLETION if path == "/v1/completions" else CHAT
    return client.post(path, json={"model": model.model_id, "max_tokens": 2, **base, **body})


def _refused(r: Any, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param in err["message"] and "not supported" in err["message"], err
    return str(err["message"])


REFUSED_BOTH: list[tuple[str, Any]] = [
    ("prompt_embeds", "AAAA"),
    ("logit_bias", {"65": 100}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("repetition_penalty", 1.1),
    ("response_format", {"type": "json_object"}),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "a+"),
    ("guided_choice", ["a", "b"]),
    ("structured_outputs", {"regex": "a"}),
    ("min_tokens", 3),
    ("min_p", 0.2),
    ("ignore_eos", True),
    ("logprobs", True),
    ("n", 2),
    ("lora_request", {"lora_name": "a"}),
    ("adapter", "a"),
    ("stop_token_ids", [1]),
    ("skip_special_tokens", False),
    ("store", True),
    ("a_field_nobody_listed", 1),
    ("prompt_embeds", None),  # unknown even at null: never in the allow-list
]
REFUSED_COMPLETIONS: list[tuple[str, Any]] = [
    ("echo", True),
    ("suffix", "x"),
    ("best_of", 2),
    ("logprobs", 0),
]
REFUSED_CHAT: list[tuple[str, Any]] = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("top_logprobs", 2),
    ("chat_template", "{{ x }}"),
    ("chat_template_kwargs", {"enable_thinking": False}),
    ("reasoning_effort", "high"),
    ("modalities", ["text", "audio"]),
]


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_COMPLETIONS, ids=lambda x: str(x)[:20])
def test_completions_refuse_fields_they_do_not_implement(
    client: TestClient, model: ModelInfo, field: str, value: Any
) -> None:
    _refused(_post(client, model, "/v1/completions", {field: value}), field)


@pytest.mark.parametrize(("field", "value"), REFUSED_BOTH + REFUSED_CHAT, ids=lambda x: str(x)[:20])
def test_chat_refuses_fields_it_does_not_implement(
    client: TestClient, model: ModelInfo, field: str, value: Any
) -> None:
    _refused(_post(client, model, "/v1/chat/completions", {field: value}), field)


def test_stream_options_beyond_usage_are_refused(client: TestClient, model: ModelInfo) -> None:
    body = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    _refused(_post(client, model, "/v1/completions", body), "stream_options.continuous_usage_stats")


PARTS = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
    {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}},
    {"type": "image_embeds", "image_embeds": "AAAA"},
    {"image_url": {"url": "http://x/i.png"}},  # no type at all
]


@pytest.mark.parametrize("part", PARTS, ids=lambda p: str(p.get("type")))
def test_multimodal_content_parts_are_refused_naming_their_place(
    client: TestClient, model: ModelInfo, part: dict[str, Any]
) -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "look:"}, part]},
    ]
    r = client.post("/v1/chat/completions", json={"model": model.model_id, "messages": messages})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.1.content.1" and "not supported" in err["message"]
    assert json.dumps(part.get("type")) in err["message"]


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "hi", "name": "bob"}, "messages.0.name"),
        ({"role": "tool", "content": "4", "tool_call_id": "c1"}, "messages.0.tool_call_id"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, "messages.0.tool_calls"),
        (
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]},
            "messages.0.content.0.cache_control",
        ),
    ],
)
def test_message_keys_that_would_change_the_answer_are_refused(
    client: TestClient, model: ModelInfo, message: dict[str, Any], param: str
) -> None:
    r = client.post("/v1/chat/completions", json={"model": model.model_id, "messages": [message]})
    _refused(r, param)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"user": "u-1", "metadata": {"k": "v"}, "service_tier": "auto", "store": False}),
        ("/v1/completions", {"prompt_cache_key": "k", "safety_identifier": "s", "stream_options": None}),
        ("/v1/completions", {"n": 1, "logprobs": None, "echo": False, "best_of": 1, "suffix": None}),
        (
            "/v1/completions",
            {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "min_tokens": 0},
        ),
        (
            "/v1/chat/completions",
            {"tools": [], "tool_choice": "none", "parallel_tool_calls": True, "top_logprobs": 0},
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "text"}, "logprobs": False, "modalities": ["text"]},
        ),
        ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True}}),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {
                        "role": "assistant",
                        "content": "ok",
                        "refusal": None,
                        "tool_calls": None,
                        "annotations": [],
                    },
                    {"role": "user", "content": "more"},
                ]
            },
        ),
    ],
)
def test_harmless_fields_are_accepted(
    client: TestClient, model: ModelInfo, path: str, body: dict[str, Any]
) -> None:
    r = _post(client, model, path, body)
    assert r.status_code == 200, r.text


def test_get_model_by_served_name_or_id(model: ModelInfo) -> None:
    _, svc = _client(model, NODES)
    client = TestClient(build_app(svc, Tenants.open(), model_name="served-name"))
    listed = client.get("/v1/models").json()["data"][0]
    for name in ("served-name", model.model_id):
        r = client.get(f"/v1/models/{name}")
        assert r.status_code == 200, r.text
        assert r.json() == listed and listed["id"] == "served-name" and listed["object"] == "model"
    for missing in ("gpt-9", "org/gpt-9", ""):
        r = client.get(f"/v1/models/{missing}")
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "model_not_found" and err["param"] == "model"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", True),
        ("max_tokens", 5.5),
        ("stream", "yes"),
        ("stream", 1),
        ("temperature", "0.7"),
        ("top_k", "3"),
        ("seed", True),
        ("return_token_ids", "true"),
    ],
)
def test_a_value_of_another_type_is_refused_not_coerced(
    client: TestClient, model: ModelInfo, path: str, field: str, value: Any
) -> None:
    """Found by a new-user pass: `"max_tokens": true` answered 1 token, `"max_tokens": "5"` five, and
    `"stream": "yes"` streamed (pydantic's lax coercion). OpenAI refuses a value of another type; so does
    the router now, naming the field (a JSON integer where a number is expected stays accepted)."""
    r = _post(client, model, path, {field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(f"{field}: "), err


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_number_that_is_not_finite_is_refused_as_such(
    client: TestClient, model: ModelInfo, field: str, value: float
) -> None:
    """Found by a new-user pass: `"temperature": NaN` was refused as "should be less than or equal to 2"."""
    body = {"model": model.model_id, "max_tokens": 2, **COMPLETION, field: value}
    r = client.post(  # Python's json writes NaN and Infinity as JavaScript does; httpx's json= refuses them
        "/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "finite number" in err["message"], err


def test_an_integer_where_a_number_is_expected_is_accepted(client: TestClient, model: ModelInfo) -> None:
    r = _post(client, model, "/v1/completions", {"temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text
