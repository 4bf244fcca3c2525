"""What each join-token role may ask of a secured master (least privilege, `kvpool.membership.TOKEN_ROLES`).

A join token carries one role (`kvpool token new NAME --role ROLE`; `kvpool up` issues one to each serving
node and engine, one to the router and one for the operator):

| role | may call (besides joining: `JoinChallenge`, `RegisterNode`, `Heartbeat`, `DeregisterNode`) |
|---|---|
| `admin` | every call |
| `router` | `Masters`, `Stats`, `ListNodes`, `ListAdapters`, `RegisterNamespace`, `MatchPrefix(Stream)` |
| `serving`, `engine` | the router's, and read leases, `Reserve`/`Commit`/`Abort` (and their batches), the replica and data-plane reports |
| `store` | `Masters` only (a store proves the cluster secret to join; it needs no token) |

`check_call` answers PERMISSION_DENIED for any other call (the gate, `kvpool.master.gate`, calls it before
the servicer runs). `check_registration` keeps a token to the node roles of its kind: a router token
cannot register a serving node or an engine (that would receive tenants' prompts), nor can a serving
token register an engine; no token registers a store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpool.errors import PermissionDenied

_MASTER = "/kvpool.v1.Master/"

JOINING = frozenset({"JoinChallenge", "RegisterNode", "Heartbeat", "DeregisterNode"})
"""Open to every caller: the servicer checks the store's proof, the token or the registration session."""

_READ = frozenset({"Masters", "Stats", "ListNodes", "ListAdapters"})
_ROUTER = _READ | {"RegisterNamespace", "MatchPrefix", "MatchPrefixStream"}
_WRITER = _ROUTER | {
    "RenewLease",
    "ReleaseLease",
    "ReleaseLeases",
    "Reserve",
    "Commit",
    "ReserveBatch",
    "CommitBatch",
    "Abort",
    "ReportBadReplica",
    "ReportDataPlaneFailure",
    "ReportLocal",
}

ALLOWED: dict[str, frozenset[str] | None] = {
    "admin": None,  # every call
    "router": frozenset(_ROUTER),
    "serving": frozenset(_WRITER),
    "engine": frozenset(_WRITER),
    "store": frozenset({"Masters"}),
}
"""Each token role's master calls beyond `JOINING` (None: all)."""

NODE_ROLES: dict[str, frozenset[str]] = {
    "admin": frozenset({"prefill", "decode", "router", "vllm", "vllm-prefill", "vllm-decode"}),
    "router": frozenset({"router"}),
    "serving": frozenset({"prefill", "decode"}),
    "engine": frozenset({"vllm", "vllm-prefill", "vllm-decode"}),
    "store": frozenset(),
}
"""The node roles (`kvpool.master.registry.ROLES`) a token of each role may register."""


def check_call(role: str, method: str) -> None:
    """Raise `PermissionDenied` unless a token of `role` may call the full gRPC `method`
    ("/kvpool.v1.Master/Evict"). Calls outside the Master service pass (health, reflection)."""
    if not method.startswith(_MASTER):
        return
    name = method[len(_MASTER) :]
    if name in JOINING:
        return
    allowed = ALLOWED.get(role, frozenset())
    if allowed is not None and name not in allowed:
        raise PermissionDenied(
            f"a {role!r} join token may not call {name} (least privilege; an admin token may: see "
            "docs/security.md)"
        )


_KNOWN_NODE_ROLES = frozenset().union(*NODE_ROLES.values())


def check_registration(token_role: str, node_role: str) -> None:
    """Raise `PermissionDenied` unless a token of `token_role` may register a node of `node_role` (a role
    no token registers is left to the registry, which refuses it with `InvalidArgument`)."""
    if node_role in _KNOWN_NODE_ROLES and node_role not in NODE_ROLES.get(token_role, frozenset()):
        raise PermissionDenied(f"a {token_role!r} join token may not register a {node_role!r} node")


def is_admin(role: str) -> bool:
    return role == "admin"


def check_writer(nodes: Mapping[str, Any], owner: str, writer_node_id: str) -> None:
    """A non-admin caller (join token name `owner`) reserves only as a node it registered itself: raise
    `PermissionDenied` unless `writer_node_id` is "" or a live node of `nodes` (node id -> record with
    `alive` and `join_token`) that joined with that same token."""
    if not writer_node_id:
        return
    rec = nodes.get(writer_node_id)
    if rec is None or not rec.alive or rec.join_token != owner:
        raise PermissionDenied(
            f"writer_node_id {writer_node_id!r} is not a node this join token registered: a member writes "
            "only as itself"
        )
