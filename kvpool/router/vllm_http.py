"""The router's OpenAI HTTP API over vLLM engines (prefill/decode through the pool; `kvpool.router.vllm_pd`).

`POST /v1/completions` and `POST /v1/chat/completions` (JSON or SSE, as the client asks: the decode
engine's response is passed through), `GET /v1/models` (an engine's), `GET /health` (503 unless a prefill
and a decode engine are known live; 200 "degraded" with the parts and since when while the master is
unreachable: `kvpool.router.nodes`), `GET /metrics`. The API key selects the tenant and so the cache salt (a
client's `cache_salt` only sub-partitions its own tenant, field case B09). vLLM validates the body
itself: its 4xx answers reach the client unchanged, but first the router applies the native router's
field allow-list (`schemas.refuse_unsupported`: a field the native router does not implement is a 400
naming it, a neutral one is dropped), so a client reaches no engine feature the native router would
refuse (`kv_transfer_params`, `prompt_embeds`, LoRA, guided decoding, chat templates, ...). The API key is
checked from the headers, and the per-tenant in-flight cap applied, before the body is read
(`kvpool.router.admission`). Router errors use OpenAI's shape: 400 a body that is not a JSON object or a
field not allowed, 401 unknown API key, 408 a body not received within `body_timeout_s`, 429
`max_inflight` or `max_inflight_per_tenant` reached, 503 no live engine known (or none
reachable; a master that does not answer leaves the last known engines in use, placed without hits), 502 a decode engine that failed mid-stream (in a stream: one `data: {"error"}`
event, then the stream ends).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvpool import errors
from kvpool.client.types import NodeStatus
from kvpool.router.admission import Admission
from kvpool.router.schemas import (
    VLLM_SAMPLING,
    APIError,
    ChatBody,
    CompletionBody,
    first_invalid_text,
    from_kvpool,
    health_response,
    read_json_object,
    refuse_unsupported,
    request_salt,
)
from kvpool.router.tenants import Tenants
from kvpool.router.vllm_pd import (
    DECODE_ROLES,
    PREFILL_ROLES,
    Placement,
    VllmEngines,
    decode_body,
    prefill_body,
    tokenize_body,
)
from kvpool.rpc.serving_key import engine_headers

log = logging.getLogger(__name__)

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _allowed(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    """`raw` through the native router's allow-list (`refuse_unsupported`: neutral fields dropped, any
    field it does not implement a 400 naming it) and its text check, vLLM's own sampling controls
    (`VLLM_SAMPLING`: `ignore_eos`, `min_tokens`, ...) passed on; types are left to vLLM."""
    if (where := first_invalid_text(raw)) is not None:
        raise APIError(400, f"{where}: not valid Unicode text (a lone surrogate code point)", param=where)
    return refuse_unsupported(raw, CompletionBody if kind == "completions" else ChatBody, VLLM_SAMPLING)


class EngineUnreachable(Exception):
    """A call could not reach an engine (connection refused or reset, or it died before answering)."""


class VllmProxy:
    def __init__(self, engines: VllmEngines, tenants: Tenants) -> None:
        self.engines = engines
        self.tenants = tenants
        settings = engines.settings
        self.http = httpx.AsyncClient(  # engines take calls only with the serving key (kvpool up)
            timeout=httpx.Timeout(settings.request_timeout_s, connect=5.0), headers=engine_headers()
        )
        self._admitted = 0

    # ---- helpers ----------------------------------------------------------------------------------
    def _salt(self, request: Request, client_salt: Any) -> str:
        if client_salt is not None and not isinstance(client_salt, str):
            raise APIError(400, "cache_salt must be a string", param="cache_salt")
        return request_salt(request, client_salt or "")

    def _failed(self, role: str, node: NodeStatus, exc: BaseException, tried: list[str]) -> None:
        """`node` could not be reached: back-off, count the retry, or 503 when no other is left."""
        self.engines.node_failed(role, node)
        tried.append(node.node.node_id)
        s = self.engines.settings
        others = self.engines.engines(PREFILL_ROLES if role == "prefill" else DECODE_ROLES, tried)
        if not others or len(tried) > s.node_retries:
            raise errors.Unavailable(
                f"{role} on {node.node.node_id} unreachable ({type(exc).__name__}: {exc}); "
                f"no other {role} engine to retry on (tried {', '.join(tried)})"
            )
        self.engines.metrics.retries.labels(role).inc()
        log.warning("%s on %s unreachable (%s): retrying on another engine", role, node.node.node_id, exc)

    async def _tokens(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as a prefill engine renders them (`POST /tokenize`); None when it cannot
        tell (the request is then placed by load)."""
        req = tokenize_body(body, kind)
        if req is None:
            return None
        if "tokens" in req:
            return list(req["tokens"])
        engines = self.engines.engines(PREFILL_ROLES)
        if not engines:
            return None
        try:
            resp = await self.http.post(engines[0].node.url + "/tokenize", json=req)
            tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("tokenize failed (%s): placing by load", exc)
            return None
        return tokens if isinstance(tokens, list) else None

    # ---- one request --------------------------------------------------------------------------------
    async def _prefill(self, kind: str, body: dict[str, Any], tokens: list[int] | None, salt: str) -> Any:
        """Run the prefill hop; returns (placement, the connector's report or None) or an engine's error
        `Response` to pass through."""
        tried: list[str] = []
        while True:
            placement: Placement = await run_in_threadpool(self.engines.place, tokens, salt, tried)
            if placement.prefill is None:
                return placement, None
            node = placement.prefill
            try:
                resp = await self.http.post(node.node.url + PATHS[kind], json=prefill_body(body, kind))
            except httpx.TransportError as exc:
                self._failed("prefill", node, exc, tried)
                continue
            finally:
                self.engines.prefill_done(placement)
            self.engines.node_answered(node)
            if resp.status_code != 200:
                return Response(resp.content, resp.status_code, media_type="application/json")
            try:
                params = resp.json().get("kv_transfer_params") or {}
            except ValueError:
                params = {}
            report = params.get("kvpool") if isinstance(params, dict) else None
            return placement, report if isinstance(report, dict) else None

    async def _open_decode(
        self, kind: str, body: dict[str, Any], tried: list[str]
    ) -> tuple[NodeStatus, httpx.Response]:
        while True:
            node = self.engines.pick_decode(tried)
            n = node.node
            self.engines.decode_inflight.begin(n.node_id, n.epoch)
            try:
                req = self.http.build_request("POST", n.url + PATHS[kind], json=body)
                return node, await self.http.send(req, stream=True)
            except httpx.TransportError as exc:
                self.engines.decode_inflight.end(n.node_id, n.epoch)
                self._failed("decode", node, exc, tried)

    async def serve(self, request: Request, kind: str) -> Response:
        s = self.engines.settings
        raw = await read_json_object(request, s.max_request_bytes, s.body_timeout_s)
        body = await run_in_threadpool(_allowed, raw, kind)
        salt = self._salt(request, body.get("cache_salt"))
        body.pop("cache_salt", None)
        if salt:
            body["cache_salt"] = salt
        if self._admitted >= self.engines.settings.max_inflight:
            self.engines.metrics.rejected.labels("overloaded").inc()
            raise APIError(
                429,
                f"the router is serving {self._admitted} requests; retry later",
                type_="rate_limit_exceeded",
                code="overloaded",
            )
        self._admitted += 1
        self.engines.metrics.inflight.inc()
        handed_off = False
        try:
            response = await self._serve(kind, body, salt)
            handed_off = isinstance(response, StreamingResponse)
            return response
        finally:
            if not handed_off:
                self._release()

    def _release(self) -> None:
        self._admitted -= 1
        self.engines.metrics.inflight.dec()

    async def _serve(self, kind: str, body: dict[str, Any], salt: str) -> Response:
        m = self.engines.metrics
        t0 = time.perf_counter()
        tokens = await self._tokens(kind, body)
        got = await self._prefill(kind, body, tokens, salt)
        if isinstance(got, Response):  # the engine refused the request (vLLM's own validation)
            m.requests.labels(kind, str(got.status_code)).inc()
            return got
        placement, report = got
        policy = self.engines.policy.policy
        where = placement.prefill.node.node_id if placement.prefill is not None else "pool"
        dbody = decode_body(body, report)
        tried: list[str] = []
        while True:
            node, resp = await self._open_decode(kind, dbody, tried)
            if resp.status_code != 200:
                content = await resp.aread()
                await resp.aclose()
                self.engines.decode_inflight.end(node.node.node_id, node.node.epoch)
                m.requests.labels(kind, str(resp.status_code)).inc()
                return Response(content, resp.status_code, media_type="application/json")
            m.requests.labels(kind, "200").inc()
            if body.get("stream"):
                m.decisions.labels(policy, where, "served").inc()
                return StreamingResponse(self._relay(kind, node, resp, t0), media_type="text/event-stream")
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:  # died before answering: nothing went out, fail over
                await resp.aclose()
                self.engines.decode_inflight.end(node.node.node_id, node.node.epoch)
                self._failed("decode", node, exc, tried)
                continue
            await resp.aclose()
            self.engines.decode_inflight.end(node.node.node_id, node.node.epoch)
            self.engines.node_answered(node)
            m.decisions.labels(policy, where, "served").inc()
            self._record_usage(content, time.perf_counter() - t0)
            return Response(content, 200, media_type="application/json")

    def _record_usage(self, content: bytes, ttft_s: float) -> None:
        """A non-streamed answer: its TTFT (the whole answer) and prompt and cached tokens, together (B40)."""
        try:
            usage = json.loads(content).get("usage") or {}
            prompt = int(usage.get("prompt_tokens") or 0)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return
        m = self.engines.metrics
        m.ttft.observe(ttft_s)
        m.prompt_tokens.inc(prompt)
        m.cached_tokens.inc(min(cached, prompt))

    async def _relay(
        self, kind: str, node: NodeStatus, resp: httpx.Response, t0: float
    ) -> AsyncIterator[bytes]:
        """The decode engine's SSE stream to the client; a failure mid-stream ends it with one error event
        and puts the engine in back-off."""
        first = True
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    self.engines.metrics.ttft.observe(time.perf_counter() - t0)
                    first = False
                yield chunk
            self.engines.node_answered(node)
        except httpx.TransportError as exc:
            self.engines.node_failed("decode", node)
            log.warning("decode on %s failed mid-stream: %s", node.node.node_id, exc)
            err = {
                "message": f"decode engine {node.node.node_id} failed mid-stream: {exc}",
                "type": "service_unavailable",
                "code": "engine_failed",
            }
            yield f"data: {json.dumps({'error': err})}\n\n".encode()
        finally:
            await resp.aclose()
            self.engines.decode_inflight.end(node.node.node_id, node.node.epoch)
            self._release()

    # ---- other endpoints ----------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        engines = self.engines.engines(PREFILL_ROLES) or self.engines.engines(DECODE_ROLES)
        if not engines:
            raise errors.Unavailable("no live vLLM engine")
        try:
            resp = await self.http.get(engines[0].node.url + "/v1/models")
        except httpx.HTTPError as exc:
            raise errors.Unavailable(f"engine {engines[0].node.node_id} unreachable: {exc}") from None
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def health(self, request: Request) -> Response:
        try:
            return health_response(await run_in_threadpool(self.engines.health))
        except errors.KVPoolError as exc:
            return health_response(exc)

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.engines.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_vllm_app(engines: VllmEngines, tenants: Tenants) -> Starlette:
    """The Starlette app of a router over vLLM engines (`engines` started; closed at shutdown)."""
    api = VllmProxy(engines, tenants)

    def wrap(kind: str) -> Any:
        async def handler(request: Request) -> Response:
            try:
                if kind == "models":
                    return await api.models(request)
                return await api.serve(request, kind)
            except APIError as exc:
                err = exc
            except errors.KVPoolError as exc:
                err = from_kvpool(exc)
            except Exception:
                log.exception("%s failed (%s)", kind, uuid.uuid4().hex[:8])
                err = APIError(500, "internal error", type_="server_error", code="internal_error")
            engines.metrics.requests.labels(kind, str(err.status)).inc()
            return err.response()

        return handler

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await api.http.aclose()
        engines.close()

    door = Middleware(
        Admission,
        tenants=tenants,
        per_tenant=engines.settings.tenant_inflight_limit,
        metrics=engines.metrics,
    )
    return Starlette(
        middleware=[door],
        routes=[
            Route("/v1/completions", wrap("completions"), methods=["POST"]),
            Route("/v1/chat/completions", wrap("chat"), methods=["POST"]),
            Route("/v1/models", wrap("models"), methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
