"""Call guards for the sync gRPC server and channels: refuse a call whose metadata fails a check, and add
per-call metadata computed from the method (used for the master's signed control calls to stores,
`kvpool.membership.master_call_credential`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from kvpool.rpc.security import _Details


def deny_handlers(message: str) -> dict[tuple[bool, bool], grpc.RpcMethodHandler]:
    """UNAUTHENTICATED `message` handlers, by (request streaming, response streaming)."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return {
        (False, False): grpc.unary_unary_rpc_method_handler(deny),
        (False, True): grpc.unary_stream_rpc_method_handler(deny),
        (True, False): grpc.stream_unary_rpc_method_handler(deny),
        (True, True): grpc.stream_stream_rpc_method_handler(deny),
    }


class MetadataGuard(grpc.ServerInterceptor):
    """Calls `check(method, metadata)` for every method not in `open_methods` (full names, e.g.
    "/kvpool.v1.Store/GetInfo"; health checks and reflection always pass); a returned message refuses
    the call with UNAUTHENTICATED, None lets it through."""

    _ALWAYS_OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, check: Callable[[str, Any], str | None], open_methods: frozenset[str]) -> None:
        self._check = check
        self._open = open_methods

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        if method in self._open or method.startswith(self._ALWAYS_OPEN):
            return continuation(handler_call_details)
        refusal = self._check(method, handler_call_details.invocation_metadata or ())
        if refusal is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return deny_handlers(refusal)[(handler.request_streaming, handler.response_streaming)]


class SigningInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `(key, sign(method))` to the metadata of every call of a channel."""

    def __init__(self, key: str, sign: Callable[[str], str]) -> None:
        self._key = key
        self._sign = sign

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), (self._key, self._sign(details.method))]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)
