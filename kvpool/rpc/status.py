"""The one place that maps kvpool exceptions to gRPC status codes and back.

Server side: `rpc_errors` wraps a servicer method so any `KVPoolError` becomes its status with the
message, and any other exception becomes INTERNAL (logged with its stack) — the server never crashes.
`DecodeErrors` (a server interceptor) answers INVALID_ARGUMENT for a request that does not parse (gRPC
itself would answer INTERNAL). Client side: `raise_from_rpc_error` turns a `grpc.RpcError` into the matching kvpool exception.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvpool import errors

log = logging.getLogger(__name__)

_TO_STATUS: list[tuple[type[errors.KVPoolError], grpc.StatusCode]] = [
    # most specific first
    (errors.StaleGeneration, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.LeaseExpired, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.VersionFenced, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ChecksumMismatch, grpc.StatusCode.DATA_LOSS),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.TransferError, grpc.StatusCode.UNAVAILABLE),
    (errors.KVPoolError, grpc.StatusCode.INTERNAL),
]

_FROM_STATUS: dict[grpc.StatusCode, type[errors.KVPoolError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DATA_LOSS: errors.ChecksumMismatch,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception (INTERNAL for anything that is not a `KVPoolError`)."""
    for cls, code in _TO_STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def error_from_status(code: int, message: str) -> errors.KVPoolError:
    """The `KVPoolError` for a per-item status of a batch answer (`code`: a gRPC status code, not 0)."""
    status = _BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _FROM_STATUS.get(status, errors.KVPoolError)(message or status.name)


def raise_from_rpc_error(exc: grpc.RpcError, what: str = "") -> NoReturn:
    """Re-raise a client-side `grpc.RpcError` as the matching `KVPoolError` (message kept)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _FROM_STATUS.get(code, errors.KVPoolError)
    prefix = f"{what}: " if what else ""
    raise cls(f"{prefix}{details or code.name}") from None


F = TypeVar("F", bound=Callable[..., Any])


def rpc_errors(method: F) -> F:
    """Decorate a servicer method (unary or streaming, sync) so every error becomes a proper status."""

    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                _abort(context, method.__name__, exc)

        return stream_wrapper  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            _abort(context, method.__name__, exc)

    return wrapper  # type: ignore[return-value]


def _abort(context: grpc.ServicerContext, name: str, exc: Exception) -> NoReturn:
    if isinstance(exc, grpc.RpcError) and not isinstance(exc, errors.KVPoolError):
        # an abort raised by context.abort inside the method: propagate unchanged
        raise exc
    code_set = getattr(context, "code", None)
    if code_set is not None and code_set() not in (None, grpc.StatusCode.OK):
        raise exc  # aborted already (e.g. an undecodable request in a stream): keep that status
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", name)
        message = f"internal error in {name}: {type(exc).__name__}: {exc}"
    else:
        log.debug("%s -> %s: %s", name, code.name, exc)
        message = str(exc) or type(exc).__name__
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


class DecodeErrors(grpc.ServerInterceptor):
    """Parse requests inside the handler, so that undecodable bytes get INVALID_ARGUMENT, not INTERNAL."""

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        parse = getattr(handler, "request_deserializer", None)
        if parse is None:
            return handler
        kind = ("stream" if handler.request_streaming else "unary") + "_"
        kind += "stream" if handler.response_streaming else "unary"
        behavior = getattr(handler, kind)
        method = handler_call_details.method

        def decode(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                return parse(raw)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
                log.debug("%s: undecodable request: %s", method, exc)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request for {method}: {exc}")
                raise AssertionError("unreachable") from None  # context.abort raises

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            if handler.request_streaming:  # an iterator of raw requests
                return behavior((decode(r, context) for r in request), context)
            return behavior(decode(request, context), context)

        return handler._replace(request_deserializer=None, **{kind: wrapped})
