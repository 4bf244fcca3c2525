"""The HTTP fuzz: random and near-valid bodies to every route of the router's OpenAI-compatible API.

Acceptance per response: never a 5xx; every 4xx carries OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` with a non-empty message; a 200 is JSON (or SSE ending
in `[DONE]` or an error chunk).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fuzz.cluster import MAX_NEW, MAX_PROMPT, Cases

JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON = st.recursive(JSON_LEAF, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)  # fmt: skip
WEIRD_NUMBER = st.sampled_from([0, -1, 1, 2, 7, 2**31, 2**63, 2**64, 10**40, -(10**40), 0.5, 1e308, -0.0])
SMALL_TEXT = st.text(max_size=24)
LONG_TEXT = st.just("z" * (MAX_PROMPT + 40))  # over the prompt limit (one byte-level token per char)


def _maybe(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({}, optional=fields)


def _common(model: str) -> dict[str, st.SearchStrategy[Any]]:
    return {
        "model": st.sampled_from([model, model, "no-such-model", ""]) | JSON_LEAF,
        "max_tokens": st.integers(1, 4) | WEIRD_NUMBER | JSON_LEAF | st.just(MAX_NEW + 1),
        "max_completion_tokens": st.integers(1, 4) | WEIRD_NUMBER,
        "temperature": st.sampled_from([0, 0.0, 0.7, -1, 2.5, "hot", None, float("nan")]),
        "top_p": st.sampled_from([0, 0.5, 1, 1.5, -1, "x"]),
        "top_k": WEIRD_NUMBER,
        "seed": WEIRD_NUMBER | JSON_LEAF,
        "stream": st.booleans() | JSON_LEAF,
        "stream_options": st.sampled_from([{"include_usage": True}, {}, [], "yes", None]),
        "stop": st.sampled_from(["\n", ["a", "b"], [], [1], 5, None, "x" * 1000]),
        "n": WEIRD_NUMBER,
        "logprobs": st.sampled_from([None, False, True, 3]),
        "cache_salt": SMALL_TEXT | JSON_LEAF,
        "user": JSON_LEAF,
        "tools": st.sampled_from([None, [], [{"type": "function"}]]),
    }


def completion_bodies(model: str) -> st.SearchStrategy[Any]:
    prompt = (
        SMALL_TEXT.filter(bool) | LONG_TEXT | st.lists(st.integers(-5, 300), max_size=8)
        | st.lists(SMALL_TEXT, max_size=3) | st.lists(st.integers(0, 258), min_size=MAX_PROMPT + 1, max_size=MAX_PROMPT + 1)
        | JSON
    )  # fmt: skip
    fields = _common(model) | {
        "prompt": prompt,
        "echo": JSON_LEAF,
        "best_of": WEIRD_NUMBER,
        "suffix": JSON_LEAF,
    }
    rest = {k: v for k, v in fields.items() if k not in ("model", "prompt")}
    near = st.fixed_dictionaries({"model": st.just(model), "prompt": prompt}, optional=rest)
    return near | near | _maybe(fields) | JSON


def chat_bodies(model: str) -> st.SearchStrategy[Any]:
    content = SMALL_TEXT | LONG_TEXT | st.none() | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 5]), "text": SMALL_TEXT | JSON_LEAF}),
        max_size=2,
    ) | JSON_LEAF  # fmt: skip
    message = (
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot", 3])},
            optional={"content": content},
        )
        | JSON
    )
    messages = st.lists(message, max_size=3) | st.just([{"role": "user", "content": "hi"}] * 300)
    fields = _common(model) | {"messages": messages}
    rest = {k: v for k, v in fields.items() if k not in ("model", "messages")}
    near = st.fixed_dictionaries({"model": st.just(model), "messages": messages}, optional=rest)
    return near | near | _maybe(fields) | JSON


RAW_BODIES = st.sampled_from([
    b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe\xfd", b'{"model": "\xff"}', b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 5000 + b"1" + b"}" * 5000, b"[" + b"1," * 200_000 + b"1]", b'{"prompt": NaN}',
]) | st.binary(max_size=200)  # fmt: skip


FOUND = {
    "completions": [
        (
            "POST",
            "/v1/completions",
            b'{"model": "m", "prompt": "0", "top_k": 9223372036854775808}',
            {},
        ),  # was 500
        (
            "POST",
            "/v1/completions",
            b'{"model": "m", "prompt": "0", "seed": 18446744073709551616}',
            {},
        ),  # was 500
        ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, {}),  # RecursionError: was 500
        ("GET", "/v1/completions", b"", {}),  # Starlette's plain-text 405: not the error shape
    ],
    "chat": [("POST", "/v1/chat/completionsx", b"", {})],  # Starlette's plain-text 404
}
"""Cases the fuzz found, kept as explicit examples (each was a 500 or a non-OpenAI error before its fix)."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One route: its path, method and what to send."""

    name: str
    path: str
    method: str
    bodies: st.SearchStrategy[Any] | None = None  # JSON values (None: a GET with no body)
    model: str = ""  # the served model's id (replaces "m" in the `FOUND` examples)


def endpoints(model: str) -> list[Endpoint]:
    return [
        Endpoint("completions", "/v1/completions", "POST", completion_bodies(model), model),
        Endpoint("chat", "/v1/chat/completions", "POST", chat_bodies(model), model),
        Endpoint("models", "/v1/models", "GET"),
        Endpoint("health", "/health", "GET"),
        Endpoint("metrics", "/metrics", "GET"),
    ]


def requests(ep: Endpoint) -> st.SearchStrategy[tuple[str, str, bytes, dict[str, str]]]:
    """(method, path, body, headers): the route's bodies, raw bytes, wrong methods and headers."""
    headers = st.sampled_from([{}, {"authorization": "Bearer x"}, {"authorization": "Basic " + "k" * 5000},
                               {"content-type": "text/plain"}])  # fmt: skip
    encoded = (ep.bodies if ep.bodies is not None else JSON).map(lambda b: json.dumps(b).encode())
    method = (
        st.just(ep.method)
        if ep.bodies is not None
        else st.sampled_from([ep.method, ep.method, "POST", "DELETE"])
    )
    return st.tuples(method, st.just(ep.path), encoded | RAW_BODIES, headers) | st.tuples(
        st.sampled_from(["GET", "PUT", "PATCH"]), st.just(ep.path + "x"), st.just(b""), headers
    )  # and an unknown path next to each route


def check(resp: httpx.Response, what: str) -> None:
    """The acceptance of one response (see the module docstring)."""
    assert resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:300]}"
    if 400 <= resp.status_code < 500:
        body = resp.json()
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{what}: {body}"
        assert isinstance(err["message"], str) and err["message"], f"{what}: {body}"
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        assert resp.text.rstrip().endswith(("data: [DONE]", "}")), f"{what}: {resp.text[-300:]}"


def fuzz(client: httpx.Client, ep: Endpoint, n: int, cases: Cases) -> None:
    """Send `n` fuzz requests to `ep` (derandomized)."""

    def run(req: tuple[str, str, bytes, dict[str, str]]) -> None:
        cases.add(f"http.{ep.name}")
        method, path, body, headers = req
        resp = client.request(method, path, content=body, headers=headers)
        check(resp, f"{method} {path} {body[:200]!r}")

    for method, path, body, headers in FOUND.get(ep.name, []):
        body = body.replace(b'"model": "m"', b'"model": ' + json.dumps(ep.model).encode())
        run = example(req=(method, path, body, headers))(run)
    run = given(req=requests(ep))(run)
    settings(max_examples=n, deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck))(run)()  # fmt: skip
