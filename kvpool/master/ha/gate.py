"""The door of a master that does not lead: UNAVAILABLE "not the leader (leader is HOST:PORT)".

Installed on the master's gRPC server only with etcd (`MasterSettings.etcd`); a single master has no gate
and pays nothing. Per call it reads the election's role (a clock comparison, no etcd call):

- the leader answers everything;
- a standby answers only read-only status (`STATUS_METHODS`, health, reflection), so `kvpool admin` can
  ask any master who leads; every other call is refused, naming the leader for the client to redirect.
  `ListNodes` is refused too: no node registers with a standby, and a router or engine given a list of
  masters must get the leader's node list (or, in a failover, keep its last one), never an empty one;
- a deposed leader (its lease lost or etcd out of reach) also serves reads of its index (`READ_METHODS`:
  its node list, matches and their read leases, which stores still honour until a newer leader's epoch
  fences them) and refuses every write (registration, heartbeats, reservations, commits, evictions...).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvpool.master.ha.election import DEPOSED, LEADER, Election

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
STATUS_METHODS = frozenset(f"/kvpool.v1.Master/{name}" for name in ("Stats", "ListAdapters", "Masters"))
READ_METHODS = STATUS_METHODS | frozenset(
    f"/kvpool.v1.Master/{name}"
    for name in (
        "ListNodes",
        "MatchPrefix",
        "MatchPrefixStream",
        "RenewLease",
        "ReleaseLease",
        "ReleaseLeases",
    )
)


def not_leader_message(leader: str) -> str:
    """The refusal's text; clients parse the address after "leader is " (kvpool.client)."""
    return f"not the leader (leader is {leader or 'unknown'})"


def _deny(handler: Any, message: str) -> Any:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        yield None  # pragma: no cover - abort raises

    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class LeaderGate(grpc.aio.ServerInterceptor):
    """UNAVAILABLE for what a master that does not lead may not answer (see the module docstring)."""

    def __init__(self, election: Election) -> None:
        self._election = election

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        role = self._election.role
        if role == LEADER:
            return await continuation(details)
        method = details.method or ""
        allowed = READ_METHODS if role == DEPOSED else STATUS_METHODS
        if method in allowed or method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return _deny(handler, not_leader_message(self._election.leader))
