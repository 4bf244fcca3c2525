"""The typed client library every node (and an external engine) uses; no proto type leaks out.

- `MasterClient`: the master's calls (match, leases, reserve/commit/abort, admin), deadlines, retries.
- `MasterLink`: a process's membership of the pool (registration, heartbeats, deregistration, registering
  again with a restarted master or a new leader), for stores, serving nodes and vLLM engines alike.
- `PoolClient`: whole-block reads and publishes over a `transfer.Transport`.
- `StoreClient` (`kvpool.client.store_client`): the master's orders to store nodes (reserve, commit, free,
  copy, inventory); `node_identity`: a node's `GetInfo`.
"""

from kvpool.client.master_client import MasterClient, MatchStream
from kvpool.client.master_link import HeartbeatReport, MasterLink
from kvpool.client.pool_client import PoolClient
from kvpool.client.types import (
    BlockGet,
    ChainReserve,
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
    "ChainReserve",
    "CommitBlock",
    "CommitResult",
    "GetResult",
    "HeartbeatReport",
    "MasterClient",
    "MasterLink",
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
