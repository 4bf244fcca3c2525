"""The router's door: who may send a request, and how many, decided before its body is read.

`Admission` wraps the HTTP app (native and vLLM routers alike). For every `/v1/...` request it reads only
the headers:

1. **The API key** (`Authorization: Bearer ...`) must name a tenant (`kvpool.tenants.Tenants`; any key
   without a tenants file): else 401 `invalid_api_key` at once, with `Connection: close`, nothing of the
   body read (a 16 MiB body costs an unknown client its headers' worth of work).
2. **The tenant's in-flight cap** (`max_inflight_per_tenant`, with a tenants file): a tenant with that
   many requests in flight (from their headers to their last byte out, streams included) gets 429
   `tenant_overloaded` with `Retry-After: 1`, so one tenant cannot take every slot of `max_inflight`.

The tenant is then in `request.state.tenant` (`schemas.request_salt`). The body's read time is bounded by
`body_timeout_s` (408, `schemas.read_json_object`) and the connections by `max_connections` (uvicorn's
`limit_concurrency`: past it, 503; `kvpool.router.serve`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpool.router.metrics import RouterMetrics
from kvpool.router.schemas import APIError, api_key
from kvpool.tenants import Tenant, Tenants

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class Admission:
    """ASGI middleware: authenticate from headers, then the per-tenant in-flight cap (module docstring).
    Counts are kept on the event loop (no lock: every change happens between awaits)."""

    def __init__(
        self, app: ASGIApp, *, tenants: Tenants, per_tenant: int | None, metrics: RouterMetrics
    ) -> None:
        self.app, self.tenants, self.per_tenant, self.metrics = app, tenants, per_tenant, metrics
        self.inflight: dict[str, int] = {}
        """Tenant id -> its requests in flight (only > 0)."""

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        tenant = self.tenants.authenticate(api_key(headers.get(b"authorization", b"").decode("latin-1")))
        if tenant is None:
            err = APIError(401, "invalid API key", code="invalid_api_key", close=True)
            await self._refuse(err, "unauthenticated", scope, receive, send)
            return
        key = tenant.tenant_id
        n = self.inflight.get(key, 0)
        if self.tenants.required and self.per_tenant is not None and n >= self.per_tenant:
            self.metrics.tenant_rejected.labels(key).inc()
            err = APIError(
                429,
                f"this tenant has {n} requests in flight (the router's max_inflight_per_tenant); retry later",
                type_="rate_limit_exceeded",
                code="tenant_overloaded",
                close=True,
            )
            await self._refuse(err, "tenant_overloaded", scope, receive, send)
            return
        self.inflight[key] = n + 1
        self.metrics.tenant_inflight.labels(key).inc()
        scope.setdefault("state", {})["tenant"] = tenant
        try:
            await self.app(scope, receive, send)
        finally:
            self._end(tenant)

    def _end(self, tenant: Tenant) -> None:
        key = tenant.tenant_id
        n = self.inflight[key] - 1
        if n:
            self.inflight[key] = n
        else:
            del self.inflight[key]
        self.metrics.tenant_inflight.labels(key).dec()

    async def _refuse(self, err: APIError, reason: str, scope: Scope, receive: Any, send: Any) -> None:
        self.metrics.rejected.labels(reason).inc()
        path = scope["path"]
        endpoint = _ENDPOINTS.get(path) or ("models" if path.startswith("/v1/models") else "other")
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        await err.response()(scope, receive, send)


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
