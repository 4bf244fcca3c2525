"""The router's OpenAI request bodies (pydantic) and its OpenAI-shaped error (`APIError`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from kvpool import errors


class APIError(Exception):
    """An HTTP error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


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


class CommonBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=2**32 - 1)  # the wire is uint32
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # the wire is uint64
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    logprobs: Any = None
    cache_salt: str = ""
    user: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice also carries its generated `token_ids`
    # Sampling controls the nodes do not implement: refused when set to anything but their neutral value
    # (`UNSUPPORTED`), never silently ignored.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extensions: min_p, min_tokens, ignore_eos, repetition_penalty


UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": None,
    "min_p": 0.0, "min_tokens": 0, "ignore_eos": False,
}  # fmt: skip
"""Fields of `CommonBody` accepted only at these values (OpenAI's and vLLM's "off"); `response_format`
is accepted only as `{"type": "text"}`."""


def unsupported_field(body: CommonBody) -> str | None:
    """The first sampling control `body` sets that the nodes do not implement, or None."""
    for name, neutral in UNSUPPORTED.items():
        value = getattr(body, name)
        if value != neutral and not (name == "logit_bias" and value == {}):
            return name
    if body.response_format not in (None, {"type": "text"}):
        return "response_format"
    return None


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
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None


def text_content(msg: ChatMessage, i: int) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for part in msg.content:
        if part.get("type") != "text":
            raise APIError(400, f"messages[{i}]: only text content parts are supported",
                           param=f"messages[{i}].content")  # fmt: skip
        parts.append(str(part.get("text", "")))
    return "".join(parts)
