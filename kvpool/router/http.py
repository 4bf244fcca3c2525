"""The OpenAI-compatible HTTP API (Starlette): completions, chat completions, models, health, metrics.

- `POST /v1/completions`, `POST /v1/chat/completions`: non-streaming JSON, or SSE (`stream: true`,
  `data: {chunk}` lines then `data: [DONE]`; with `stream_options.include_usage` a last chunk carries the
  usage). `usage.prompt_tokens_details.cached_tokens` = tokens reused from cache by the prefill node.
- `GET /v1/models`, `GET /v1/models/{model}` (by served name or model id; 404 otherwise), `GET /health`,
  `GET /metrics` (Prometheus).
- Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 bad input (an
  oversized prompt states the limit), 401 unknown API key (when a tenants file is configured), 404
  unknown model, 408 a body not received within `body_timeout_s`, 413 a body over `max_request_bytes`
  (`request_too_large`), 429 overload (too many requests in flight, all or the tenant's, or a node's
  queue full; `Retry-After: 1`), 503 no live
  prefill or decode node known (the message says why, e.g. a master never reached), 500 otherwise. A
  master that does not answer is no error: requests are routed on the last known nodes without hits.
- `GET /health`: 200 `{"status": "ok" | "degraded", "prefill", "decode", "inflight", "degraded": [{"part",
  "reason", "since", "for_s"}]}` (degraded: the master unreachable, nodes in back-off), 503 with
  `"status": "unavailable"` and `error` when no live prefill or decode node is known.
- The API key (`Authorization: Bearer …`) selects the tenant and so the cache salt; a `cache_salt` in
  the body only sub-partitions the caller's own tenant (field case B09). The key is checked from the
  headers before anything of the body is read, and each tenant has an in-flight cap (429 with
  `Retry-After`): `kvpool.router.admission`. A body not received within `body_timeout_s` is a 408.

Input is refused, never silently reinterpreted (field case B32): the body is checked against an
allow-list (`schemas.refuse_unsupported`), so a field not listed here, known or new, is a 400 in OpenAI's
shape whose `param` names it ("X is not supported").
- Implemented (both endpoints): `model`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stream`,
  `stream_options` (`include_usage`; `include_obfuscation` accepted, no effect), `stop`, `cache_salt`,
  `return_token_ids` (vLLM's); `prompt` (completions); `messages` (role and content: a string or text
  parts) and `max_completion_tokens` (chat).
- Accepted without effect on the answer: `user`, `metadata`, `service_tier`, `prompt_cache_key`,
  `safety_identifier`.
- Accepted only at their "off" value (`schemas.NEUTRAL`, what clients send by default), refused at any
  other: `n` 1, `logprobs` false, `top_logprobs` 0, `presence_penalty`/`frequency_penalty` 0,
  `repetition_penalty` 1, `logit_bias` {}, `min_p` 0, `min_tokens` 0, `ignore_eos` false, `response_format`
  text, `store` false, `echo` false, `best_of` 1, `suffix` "", `tools`/`functions` [], `tool_choice`/
  `function_call` "none", `parallel_tool_calls`, `modalities` ["text"], `audio`/`prediction` null (null
  is "off" for each). In a message: `refusal`, `function_call`, `audio`, `reasoning_content` null,
  `tool_calls`/`annotations` empty (an answer echoed back).
- Refused, e.g.: `prompt_embeds`, `guided_*`, `structured_outputs`, `lora_request`, a message's `name` or
  `tool_call_id`, and image, audio, file or video content parts (`param` `messages.I.content.J`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvpool import errors
from kvpool.prompt import prompt_token_limit
from kvpool.router.admission import Admission
from kvpool.router.schemas import (
    APIError,
    ChatBody,
    CommonBody,
    CompletionBody,
    first_invalid_text,
    from_kvpool,
    health_response,
    read_json_object,
    refuse_unsupported,
    request_salt,
    text_content,
)
from kvpool.router.service import Event, RouterService
from kvpool.router.tenants import Tenants
from kvpool.router.text_stream import TextStream
from kvpool.sampling import SamplingParams

log = logging.getLogger(__name__)


class OpenAIApp:
    def __init__(self, service: RouterService, tenants: Tenants, *, model_name: str | None = None) -> None:
        self.service = service
        self.tenants = tenants
        self.model_name = model_name or service.model.model_id
        self.created = int(time.time())

    # ---- helpers ----------------------------------------------------------------------------------
    def _tenant_salt(self, request: Request, client_salt: str) -> str:
        return request_salt(request, client_salt)

    async def _body(self, request: Request, cls: type[CommonBody]) -> Any:
        """The body read (at most `max_request_bytes`, within `body_timeout_s`), then parsed and checked
        on a worker thread: a large body never stalls the event loop."""
        s = self.service.settings
        raw = await read_json_object(request, s.max_request_bytes, s.body_timeout_s)
        body = await run_in_threadpool(self._validate, raw, cls)
        self._check_model(body.model)
        return body

    @staticmethod
    def _validate(raw: dict[str, Any], cls: type[CommonBody]) -> Any:
        if (where := first_invalid_text(raw)) is not None:
            raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate code point)", param=where)
        raw = refuse_unsupported(raw, cls)
        try:
            body = cls.model_validate(raw, strict=True)  # "5", true, "yes": refused, never coerced (B32)
        except ValidationError as exc:
            param, msg = _first_error(exc)
            raise APIError(400, f"{param}: {msg}", param=param) from None
        return body

    def _check_model(self, name: str) -> None:
        if name != self.model_name and name != self.service.model.model_id:
            msg = f"the model {name!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, msg, param="model", code="model_not_found")

    def _check_prompt(self, tokens: list[int], max_tokens: int) -> None:
        s, m = self.service.settings, self.service.model
        limit = prompt_token_limit(s.max_prompt_tokens, m.max_model_len)  # the nodes' rule
        if len(tokens) > limit:
            raise APIError(
                400,
                f"the prompt has {len(tokens)} tokens; the limit is {limit} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens > s.max_tokens_limit:
            raise APIError(
                400, f"max_tokens is {max_tokens}; the limit is {s.max_tokens_limit}", param="max_tokens"
            )
        if len(tokens) + max_tokens > m.max_model_len:
            raise APIError(
                400,
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceed the model's "
                f"context of {m.max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        bad = next((t for t in tokens if not 0 <= t < m.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary of {m.vocab_size}", param="prompt")

    def _default(self, max_tokens: int) -> int:
        """The max_tokens of a request that names none: never above the configured limit."""
        return min(max_tokens, self.service.settings.max_tokens_limit)

    def _sampling(self, body: Any, max_tokens: int) -> SamplingParams:
        eos = self.service.model.eos_token_id
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed,
            max_tokens=max_tokens,
            stop_token_ids=(eos,) if eos is not None else (),
        )

    # ---- endpoints --------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body: CompletionBody = await self._body(request, CompletionBody)
        salt = self._tenant_salt(request, body.cache_salt)
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            tokens = await run_in_threadpool(self.service.model.encode, prompt)
        else:
            tokens = [int(t) for t in prompt]
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        return await self._serve(
            request, "completions", body, tokens, salt, body.max_tokens or self._default(16)
        )

    async def chat(self, request: Request) -> Response:
        body: ChatBody = await self._body(request, ChatBody)
        salt = self._tenant_salt(request, body.cache_salt)
        messages = [{"role": m.role, "content": text_content(m)} for m in body.messages]
        tokens = await run_in_threadpool(self.service.model.chat_prompt_ids, messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or self._default(256)
        return await self._serve(request, "chat", body, tokens, salt, max_tokens)

    async def _serve(
        self, request: Request, kind: str, body: Any, tokens: list[int], salt: str, max_tokens: int
    ) -> Response:
        self._check_prompt(tokens, max_tokens)
        svc = self.service
        svc.admit()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                svc.release()

        try:
            rid = ("cmpl-" if kind == "completions" else "chatcmpl-") + uuid.uuid4().hex[:24]
            gen = svc.generate(tokens, self._sampling(body, max_tokens), cache_salt=salt, request_id=rid)
            first: Event = await run_in_threadpool(next, gen)
        except BaseException:
            release()
            raise
        eos = {svc.model.eos_token_id} if svc.model.eos_token_id is not None else set()
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        text = TextStream(svc.model, eos, stops)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            chunks = self._sse(kind, rid, gen, first, text, include_usage, release)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            events = await run_in_threadpool(list, gen)
        finally:
            release()
        content = text.push(first.token_ids)
        done = first
        for ev in events:
            content += text.push(ev.token_ids)
            if ev.kind == "done":
                done = ev
        content += text.finish()
        n_out = len(text.ids)
        reason = "stop" if text.stopped else done.finish_reason or "length"
        usage = self._usage(first, n_out)
        if kind == "completions":
            choice: dict[str, Any] = {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        else:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": reason,
            }
            obj = "chat.completion"
        if body.return_token_ids:
            choice["token_ids"] = list(text.ids)
        svc.metrics.requests.labels(kind, "200").inc()
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    @staticmethod
    def _usage(first: Event, n_out: int) -> dict[str, Any]:
        return {
            "prompt_tokens": first.prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": first.prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        }

    async def _sse(
        self,
        kind: str,
        rid: str,
        gen: Generator[Event, None, None],
        first: Event,
        text: TextStream,
        include_usage: bool,
        release: Any,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "text_completion" if kind == "completions" else "chat.completion.chunk"

        def chunk(delta: str | None, reason: str | None, *, role: bool = False, usage: Any = None) -> str:
            if kind == "completions":
                choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}]
            else:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}]
            payload: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices if usage is None else [],
            }
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        reason = "length"
        try:
            yield chunk(text.push(first.token_ids), None, role=True)
            async for ev in iterate_in_threadpool(gen):
                if ev.kind == "tokens":
                    delta = text.push(ev.token_ids)
                    if delta:
                        yield chunk(delta, None)
                    if text.stopped:
                        break
                elif ev.kind == "done":
                    reason = ev.finish_reason or reason
            tail = text.finish()
            yield chunk(tail, "stop" if text.stopped else reason)
            if include_usage:
                yield chunk(None, None, usage=self._usage(first, len(text.ids)))
            yield "data: [DONE]\n\n"
            self.service.metrics.requests.labels(kind, "200").inc()
        except errors.KVPoolError as exc:
            err = from_kvpool(exc)
            self.service.metrics.requests.labels(kind, str(err.status)).inc()
            yield f"data: {json.dumps({'error': {'message': err.message, 'type': err.type, 'code': err.code}})}\n\n"
        finally:
            gen.close()
            release()

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvpool"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}`: the served model by its served name or its model id, else 404."""
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_object())

    async def health(self, request: Request) -> Response:
        try:
            return health_response(await run_in_threadpool(self.service.health))
        except errors.KVPoolError as exc:
            return health_response(exc)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(service: RouterService, tenants: Tenants, *, model_name: str | None = None) -> Starlette:
    api = OpenAIApp(service, tenants, model_name=model_name)

    def wrap(endpoint: Any, kind: str) -> Any:
        async def handler(request: Request) -> Response:
            try:
                return await endpoint(request)  # type: ignore[no-any-return]
            except APIError as exc:
                err = exc
            except errors.KVPoolError as exc:
                err = from_kvpool(exc)
            except Exception:
                log.exception("%s failed", kind)
                err = APIError(500, "internal error", type_="server_error", code="internal_error")
            service.metrics.requests.labels(kind, str(err.status)).inc()
            return err.response()

        return handler

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        service.close()

    routes = [
        Route("/v1/completions", wrap(api.completions, "completions"), methods=["POST"]),
        Route("/v1/chat/completions", wrap(api.chat, "chat"), methods=["POST"]),
        Route("/v1/models", wrap(api.models, "models"), methods=["GET"]),
        Route("/v1/models/{model:path}", wrap(api.model, "models"), methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own 404 / 405 in OpenAI's error shape too."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return APIError(status, f"{request.method} {request.url.path}: {detail}").response()

    door = Middleware(
        Admission, tenants=tenants, per_tenant=service.settings.tenant_inflight_limit, metrics=service.metrics
    )
    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error}, middleware=[door]
    )


def _union_tag(part: object) -> bool:
    """Whether a pydantic error location part names a member of a union (`str`, `list[int]`), not a field."""
    return isinstance(part, str) and (
        part in {"str", "int", "float", "bool", "none"} or not part.isidentifier()
    )


def _first_error(exc: ValidationError) -> tuple[str | None, str]:
    """The body parameter of a validation error, as OpenAI names it ("prompt", "messages.0.role": a union's
    member tags are not part of it), and its message; a value matching no member of a union names them all."""
    errors = exc.errors()
    loc = errors[0]["loc"]
    cut = next((i for i, part in enumerate(loc) if _union_tag(part)), len(loc))
    param = ".".join(str(x) for x in loc[:cut]) or None
    if cut == len(loc):
        return param, str(errors[0]["msg"])
    tags = [
        str(e["loc"][cut])
        for e in errors
        if tuple(e["loc"][:cut]) == tuple(loc[:cut]) and len(e["loc"]) > cut
    ]
    return param, "wrong type: expected one of " + ", ".join(dict.fromkeys(tags))
