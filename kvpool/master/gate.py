"""The secured master's door: every call but joining needs an active join token.

Installed on the master's gRPC server only when the cluster is secured (`Membership.secured`). Calls to
`JoinChallenge`, `RegisterNode`, `Heartbeat` and `DeregisterNode` pass (the servicer checks the store's
proof, the node's join token or its registration session itself), as do health checks and reflection;
every other call without an active token in `kvpool-join-token` is answered UNAUTHENTICATED before it
reaches the servicer. A revoked token is refused from its next call (the token file is re-read within
`TOKEN_RELOAD_INTERVAL_S`). A call outside the token's role (`kvpool.master.roles`) is answered
PERMISSION_DENIED, also before it reaches the servicer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvpool.errors import PermissionDenied, Unauthenticated
from kvpool.master.members import Membership
from kvpool.master.roles import check_call
from kvpool.membership import JOIN_TOKEN_METADATA

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_OPEN_METHODS = frozenset(
    f"/kvpool.v1.Master/{name}" for name in ("JoinChallenge", "RegisterNode", "Heartbeat", "DeregisterNode")
)


def join_token_of(metadata: Any) -> str:
    """The `kvpool-join-token` value of a call's invocation metadata ("" when absent)."""
    for key, value in metadata or ():
        if key == JOIN_TOKEN_METADATA:
            return value if isinstance(value, str) else bytes(value).decode(errors="replace")
    return ""


class MemberGate(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without an active join token, PERMISSION_DENIED for one its token's role
    may not make (see the module docstring)."""

    def __init__(self, members: Membership) -> None:
        self._members = members

        def make_deny(code: grpc.StatusCode, message: str) -> dict[tuple[bool, bool], Any]:
            async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(code, message)

            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(code, message)
                yield None  # pragma: no cover - abort raises

            return {
                (False, False): grpc.unary_unary_rpc_method_handler(deny),
                (False, True): grpc.unary_stream_rpc_method_handler(deny_stream),
                (True, False): grpc.stream_unary_rpc_method_handler(deny),
                (True, True): grpc.stream_stream_rpc_method_handler(deny_stream),
            }

        self._make_deny = make_deny

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        method = details.method or ""
        if method in _OPEN_METHODS or method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        try:
            _name, role = self._members.token_role(join_token_of(details.invocation_metadata))
            check_call(role, method)
        except (Unauthenticated, PermissionDenied) as exc:
            handler = await continuation(details)
            if handler is None:
                return None
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if isinstance(exc, Unauthenticated)
                else grpc.StatusCode.PERMISSION_DENIED
            )
            return self._make_deny(code, str(exc))[(handler.request_streaming, handler.response_streaming)]
        return await continuation(details)
