"""A `grpc.aio` server on its own event-loop thread, for services with a hot path (the master's matches).

The sync `grpc.server` hands every message between its polling thread and a worker thread (a GIL
round trip and condition waits per message: ~5 % of the master's match time was the match itself). Here
`async` servicer methods run on the event loop with no hand-off; plain (sync) methods still run in a
thread pool (`migration_thread_pool`), so they may block on store calls as before. Same contract as
`kvpool.rpc.server.start_server`: health checking and reflection, the bearer token and TLS
(`kvpool.rpc.security`), undecodable requests answered INVALID_ARGUMENT, errors mapped by
`kvpool.rpc.status.status_for`.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool import errors
from kvpool.membership import JOIN_TOKEN_METADATA
from kvpool.rpc.loop import new_event_loop
from kvpool.rpc.security import (
    _OPEN_METHODS,
    bind,
    channel_credentials,
    channel_options,
    join_token,
    security,
)
from kvpool.rpc.server import _CHANNEL_OPTIONS, _SERVER_OPTIONS
from kvpool.rpc.status import status_for

log = logging.getLogger(__name__)


async def abort_async(context: grpc.aio.ServicerContext, name: str, exc: BaseException) -> None:
    """Answer `exc` as its status (async twin of `kvpool.rpc.status._abort`); always raises."""
    if isinstance(exc, (grpc.RpcError, asyncio.CancelledError)) and not isinstance(exc, errors.KVPoolError):
        raise exc  # an abort already under way, or a cancelled call
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error in %s", name, exc_info=exc)
        message = f"internal error in {name}: {type(exc).__name__}: {exc}"
    else:
        log.debug("%s -> %s: %s", name, code.name, exc)
        message = str(exc) or type(exc).__name__
    await context.abort(code, message)


class _Auth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer <token>` (health stays open)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield None  # pragma: no cover - abort raises

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny_stream),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
        }

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        method = details.method or ""
        if not method.startswith(_OPEN_METHODS):
            for key, value in details.invocation_metadata or ():
                if key == "authorization":
                    got = value.encode() if isinstance(value, str) else bytes(value)
                    if hmac.compare_digest(got, self._expected):
                        return await continuation(details)
            handler = await continuation(details)
            if handler is None:
                return None
            return self._deny[(handler.request_streaming, handler.response_streaming)]
        return await continuation(details)


def service_handler(service: Any, messages: Any, servicer: Any) -> grpc.GenericRpcHandler:
    """Handlers for every method of `service` (a ServiceDescriptor) bound to `servicer`'s methods,
    parsing requests themselves (INVALID_ARGUMENT for undecodable bytes). `messages`: the `_pb2` module."""
    handlers = {}
    for m in service.methods:
        parse = getattr(messages, m.input_type.name).FromString
        out = getattr(messages, m.output_type.name).SerializeToString
        behavior = getattr(servicer, m.name)
        full = f"/{service.full_name}/{m.name}"
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(m.client_streaming, m.server_streaming)]
        wrapped = _decoding(behavior, parse, full, m.client_streaming)
        handlers[m.name] = make(wrapped, request_deserializer=None, response_serializer=out)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _decoding(behavior: Any, parse: Callable[[bytes], Any], method: str, streaming: bool) -> Any:
    def bad(exc: Exception) -> str:
        log.debug("%s: undecodable request: %s", method, exc)
        return f"malformed request for {method}: {exc}"

    if getattr(behavior, "raw_requests", False):
        return behavior  # it reads raw bytes from its context and parses them itself
    if inspect.iscoroutinefunction(behavior) and not streaming:

        async def coro(request: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                req = parse(request)
            except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad(exc))
            return await behavior(req, context)

        return coro
    if inspect.isasyncgenfunction(behavior) or inspect.iscoroutinefunction(behavior):
        raise TypeError(f"{method}: async streaming methods must set raw_requests (read the context)")

    def decode(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad input
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad(exc))
            raise AssertionError("unreachable") from None  # context.abort raises

    def sync(request: Any, context: grpc.ServicerContext) -> Any:
        if streaming:
            it: Iterator[bytes] = request
            return behavior((decode(r, context) for r in it), context)
        return behavior(decode(request, context), context)

    return sync


class AioGrpcServer:
    """A running `grpc.aio` server on a daemon thread; the `GrpcServer` interface (port, set_serving,
    stop, wait)."""

    def __init__(self) -> None:
        self.port = 0
        self.loop = new_event_loop()
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvpool-grpc-aio", daemon=True)

    def _run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._run(self.health.set("", status))

    def stop(self, grace_s: float = 1.0) -> None:
        if self.server is None or not self.loop.is_running():
            return
        self.set_serving(False)
        self._run(self.server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def wait(self) -> None:
        self._thread.join()


def start_aio_server(
    handlers: list[tuple[grpc.GenericRpcHandler, str]],
    *,
    host: str,
    port: int,
    max_workers: int = 16,
    max_concurrent_rpcs: int | None = None,
    interceptors: list[grpc.aio.ServerInterceptor] | None = None,
) -> AioGrpcServer:
    """Start a `grpc.aio` server on `host:port` (0 = ephemeral) with `(handler, "kvpool.v1.X")` pairs
    (see `service_handler`); sync methods run on `max_workers` threads. Raises `OSError` when the
    address cannot be bound. `interceptors` run after the bearer-token check."""
    sec = security()
    srv = AioGrpcServer()
    srv._thread.start()

    async def start() -> int:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=max_workers),
            options=_SERVER_OPTIONS,
            interceptors=([_Auth(sec.auth_token)] if sec.auth_token else []) + list(interceptors or ()),
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        health_pb2_grpc.add_HealthServicer_to_server(srv.health, server)
        server.add_generic_rpc_handlers([h for h, _ in handlers])
        for _, name in handlers:
            names.append(name)
            await srv.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection(names, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = bind(server, address, sec)  # type: ignore[arg-type]
        if bound == 0:
            raise OSError(f"cannot bind gRPC server to {address}")
        await server.start()
        srv.server = server
        await srv.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("gRPC (aio) server on %s:%d serving %s", host, bound, ", ".join(names[2:]))
        return bound

    try:
        srv.port = srv._run(start())
    except BaseException:
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        raise
    return srv


def aio_channel(address: str) -> tuple[grpc.aio.Channel, tuple[tuple[str, str], ...]]:
    """A `grpc.aio` channel with our options and TLS (when a CA is configured), and the call metadata
    carrying the bearer token and the join token (empty without them). Create it inside the event loop that
    will use it."""
    sec = security()
    if sec.tls_ca_file:
        creds = channel_credentials(sec)
        ch = grpc.aio.secure_channel(address, creds, options=channel_options(_CHANNEL_OPTIONS, sec))
    else:
        ch = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
    metadata: tuple[tuple[str, str], ...] = (
        (("authorization", f"Bearer {sec.auth_token}"),) if sec.auth_token else ()
    )
    token = join_token()
    if token:
        metadata += ((JOIN_TOKEN_METADATA, token),)
    return ch, metadata
