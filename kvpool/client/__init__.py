"""The typed client library every node (and an external engine) uses; no proto type leaks out.

- `MasterClient`: the master's calls (match, leases, reserve/commit/abort, admin), deadlines, retries.
- `PoolClient`: whole-block reads and publishes over a `transfer.Transport`.
"""

from kvpool.client.master_client import MasterClient, MatchStream
from kvpool.client.pool_client import PoolClient
from kvpool.client.types import (
    BlockGet,
    CommitBlock,
    CommitResult,
    EngineNamespace,
    GetResult,
    MastersStatus,
    Match,
    NamespaceStatus,
    NodeInfo,
    NodeLoad,
    NodeStatus,
    PoolStats,
    PutResult,
    Registration,
    Reservation,
    ReservedBlock,
)

__all__ = [
    "BlockGet",
    "CommitBlock",
    "CommitResult",
    "GetResult",
    "MasterClient",
    "Match",
    "MatchStream",
    "NamespaceStatus",
    "EngineNamespace",
    "NodeInfo",
    "NodeLoad",
    "NodeStatus",
    "PoolClient",
    "MastersStatus",
    "PoolStats",
    "PutResult",
    "Registration",
    "Reservation",
    "ReservedBlock",
]
