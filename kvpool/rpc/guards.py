"""Call guards for the sync gRPC server: refuse a call whose metadata fails a check (`MetadataGuard`), or
whose metadata and request together fail it (`RequestGuard`: a secured store's check of the master's signed
control calls, bound to the request's bytes, `kvpool.membership.check_master_call`). The channel side is
`kvpool.rpc.security.CallMetadata`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


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


class RequestGuard(grpc.ServerInterceptor):
    """Calls `check(method, metadata, request)` before every call of a method not in `open_methods` (full
    names) runs, with its request (its bytes as received where `kvpool.rpc.status.DecodeErrors` parses
    requests inside the handler, else the message; calls that send one request: one that streams requests
    is refused); a returned message refuses the call with UNAUTHENTICATED, None lets it run. Health checks
    and reflection always pass."""

    _ALWAYS_OPEN = MetadataGuard._ALWAYS_OPEN

    def __init__(self, check: Callable[[str, Any, Any], str | None], open_methods: frozenset[str]) -> None:
        self._check = check
        self._open = open_methods

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        handler = continuation(handler_call_details)
        if handler is None or method in self._open or method.startswith(self._ALWAYS_OPEN):
            return handler
        if handler.request_streaming:
            return deny_handlers(f"{method}: streamed requests are not accepted here")[
                (True, handler.response_streaming)
            ]
        metadata = handler_call_details.invocation_metadata or ()
        check = self._check
        options = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.response_streaming:
            behavior = handler.unary_stream

            def checked_stream(request: Any, context: grpc.ServicerContext) -> Any:
                refusal = check(method, metadata, request)
                if refusal is not None:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
                yield from behavior(request, context)

            return grpc.unary_stream_rpc_method_handler(checked_stream, **options)
        unary = handler.unary_unary

        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            refusal = check(method, metadata, request)
            if refusal is not None:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            return unary(request, context)

        return grpc.unary_unary_rpc_method_handler(checked, **options)
