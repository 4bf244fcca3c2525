"""The router's OpenAI request bodies (pydantic) and its OpenAI-shaped error (`APIError`)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from kvpool import errors
from kvpool.tenants import Tenants


class APIError(Exception):
    """An HTTP error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close
        """Answer with `Connection: close`: the request's body was not read (to its end), so the
        connection serves no further request and no more of that body is taken in."""

    def response(self) -> JSONResponse:
        """The answer; a 429 carries `Retry-After: 1` (seconds)."""
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        headers = {"retry-after": "1"} if self.status == 429 else {}
        if self.close:
            headers["connection"] = "close"
        return JSONResponse(body, status_code=self.status, headers=headers)


def from_kvpool(exc: errors.KVPoolError) -> APIError:
    """The HTTP answer to a kvpool error."""
    if isinstance(exc, errors.InvalidArgument):
        return APIError(400, str(exc))
    if isinstance(exc, errors.ResourceExhausted):
        return APIError(429, str(exc), type_="rate_limit_exceeded", code="overloaded")
    if isinstance(exc, errors.Unavailable | errors.TransferError):
        return APIError(503, str(exc), type_="service_unavailable", code="unavailable")
    if isinstance(exc, errors.DeadlineExceeded):
        return APIError(504, str(exc), type_="timeout", code="timeout")
    return APIError(500, str(exc), type_="server_error", code="internal_error")


async def read_json_object(
    request: Request, limit_bytes: int, timeout_s: float | None = None
) -> dict[str, Any]:
    """The request body as a JSON object, reading at most `limit_bytes` bytes of it within `timeout_s`
    seconds (None: no limit), parsed on a worker thread (a large body never stalls the event loop): 413
    `APIError` for a longer body (a `Content-Length` above the limit before anything is read), 408 for a
    body not received in time, 400 for one that is not a JSON object or that the client stopped sending
    (nobody reads that answer; nothing is logged)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit_bytes:
        raise _too_large(int(declared), limit_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit_bytes:
                    raise _too_large(None, limit_bytes)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection before the request body ended") from None
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s (the router's body_timeout_s)",
            type_="timeout",
            code="request_timeout",
            close=True,
        ) from None
    return await run_in_threadpool(_json_object, b"".join(chunks))


def _json_object(data: bytes) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError; nesting too deep
        raise APIError(400, "the request body is not valid JSON (or nests too deeply)") from None
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    return raw


def _too_large(size: int | None, limit_bytes: int) -> APIError:
    """`size`: the declared length, None for a streamed body cut off past the limit."""
    what = f"more than {limit_bytes}" if size is None else str(size)
    return APIError(
        413,
        f"the request body is {what} bytes; the limit is {limit_bytes} bytes (the router's max_request_bytes)",
        code="request_too_large",
        close=True,
    )


def api_key(authorization: str) -> str:
    """The API key of an `Authorization: Bearer ...` header ("" without one)."""
    return authorization[7:].strip() if authorization.lower().startswith("bearer ") else ""


def request_salt(request: Request, client_salt: str) -> str:
    """The cache salt of a request: its tenant (authenticated from its API key by `Admission` before
    anything of the body was read) selects the salt, a client's `cache_salt` only sub-partitions that
    tenant (B09)."""
    return Tenants.cache_salt(request.scope["state"]["tenant"], client_salt)


def health_response(live: dict[str, Any] | errors.KVPoolError) -> JSONResponse:
    """`GET /health`: `live` is `NodeView.health_report`'s body: HTTP 200 while it is "ok" or "degraded"
    (serving, with the degraded parts and since when), 503 when "unavailable" (no live prefill or decode
    node known; `error` says why) or for an error."""
    if isinstance(live, errors.KVPoolError):
        return JSONResponse({"status": "unavailable", "error": str(live)}, status_code=503)
    return JSONResponse(live, status_code=503 if live["status"] == "unavailable" else 200)


class CommonBody(BaseModel):
    """The fields both endpoints implement. `refuse_unsupported` runs first and drops neutral fields, so
    any other field reaching here is a bug: refused too (`extra="forbid"`), never ignored. NaN and infinities
    (JSON's `NaN`, `Infinity`) are refused as not finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=2**32 - 1)  # the wire is uint32
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # the wire is uint64
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    cache_salt: str = ""
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its generated `token_ids`
    # Accepted and without effect on the answer (bookkeeping in OpenAI's API).
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


HARMLESS = ("user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier")
"""Accepted fields that change nothing in the answer (OpenAI's bookkeeping and routing hints)."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "min_p": (None, 0),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    # completions only
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    # chat only
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
}
"""Fields the nodes do not implement, accepted only at these values (OpenAI's and vLLM's "off", which
clients send by default) and then dropped; any other value is a 400 naming the field."""

NEUTRAL_IN_MESSAGE: dict[str, tuple[Any, ...]] = {
    "refusal": (None,),
    "tool_calls": (None, []),
    "function_call": (None,),
    "audio": (None,),
    "annotations": (None, []),
    "reasoning_content": (None,),
}
"""Keys of a chat message accepted only at these values (what a client echoes back from an answer)."""


def _neutral(value: Any, neutrals: tuple[Any, ...]) -> bool:
    """`value` equals one of `neutrals`, a bool only a bool (`0` is not `false`, `1` is not `true`)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutrals)


def _refused(where: str, shown: str, cls: type[CommonBody]) -> APIError:
    known = ", ".join(k for k in cls.model_fields if k not in HARMLESS)
    return APIError(400, f"{shown} is not supported (this router implements {known})", param=where)


STREAM_OPTIONS = ("include_usage", "include_obfuscation")
"""Keys of `stream_options` accepted (`include_obfuscation` changes nothing here: no obfuscation)."""


VLLM_SAMPLING = (
    "ignore_eos",
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""Sampling controls vLLM engines implement and the native nodes do not: the vLLM router passes them on at
any value (they change which tokens are drawn, never which KV is read or written, nor who may read it)."""


def refuse_unsupported(
    raw: dict[str, Any], cls: type[CommonBody], passed: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`raw` without its neutral fields, or an `APIError` (400, `param` = the field) for the first field
    the router does not implement: an allow-list (the fields of `cls` and `passed`, then `NEUTRAL`), so a
    field nobody listed (`prompt_embeds`, `guided_json`, `lora_request`, …) is refused, never served as if absent.
    Chat messages: `role`, `content` (a string or text parts) and `NEUTRAL_IN_MESSAGE`; an image, audio,
    file or video part is refused naming its place and type (field case B32)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in cls.model_fields or key in passed:
            out[key] = value
        elif key not in NEUTRAL or not _neutral(value, NEUTRAL[key]):
            raise _refused(key, key if key not in NEUTRAL else f"{key}={json.dumps(value)[:40]}", cls)
    options = out.get("stream_options")
    if isinstance(options, dict) and (bad := next((k for k in options if k not in STREAM_OPTIONS), None)):
        raise _refused(f"stream_options.{bad}", f"stream_options.{bad}", cls)
    messages = out.get("messages")
    if isinstance(messages, list):
        out["messages"] = [_message(m, i) for i, m in enumerate(messages)]
    return out


def _message(msg: Any, i: int) -> Any:
    if not isinstance(msg, dict):
        return msg  # pydantic names the error
    out = {}
    for key, value in msg.items():
        if key in ("role", "content"):
            out[key] = value
        elif key not in NEUTRAL_IN_MESSAGE or not _neutral(value, NEUTRAL_IN_MESSAGE[key]):
            where = f"messages.{i}.{key}"
            raise APIError(
                400, f"{where} is not supported (a message here is its role and content)", param=where
            )
    content = out.get("content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(part, dict):
            continue  # pydantic names the error
        where = f"messages.{i}.content.{j}"
        if part.get("type") != "text":
            text = f"{where}: content parts of type {json.dumps(part.get('type'))[:40]} are not supported (only text)"
            raise APIError(400, text, param=where)
        if extra := next((k for k in part if k not in ("type", "text")), None):
            raise APIError(
                400,
                f"{where}.{extra} is not supported (a text part is type and text)",
                param=f"{where}.{extra}",
            )
    return out


def first_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (e.g. `messages.0.content`) of the first string in a parsed JSON value that is not valid
    Unicode text (a lone surrogate such as "\ud800", which JSON allows and UTF-8 cannot encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        if isinstance(key, str) and first_invalid_text(key) is not None:
            return f"{path}.{key!r}" if path else repr(key)
        found = first_invalid_text(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class CompletionBody(CommonBody):
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def text_content(msg: ChatMessage) -> str:
    """The message's text (`refuse_unsupported` has refused every part that is not text)."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    return "".join(str(part.get("text", "")) for part in msg.content)
