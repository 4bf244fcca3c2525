"""Values the client library returns (frozen dataclasses; no proto type leaves `kvpool.client`).

The node values (`NodeInfo`, `NodeLoad`, `NodeStatus`, `Match`) live in `kvpool.types` and `EngineNamespace` in
`kvpool.hashing`; they are re-exported here for callers of the client library."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.hashing import EngineNamespace as EngineNamespace
from kvpool.types import Location
from kvpool.types import Match as Match
from kvpool.types import NodeInfo as NodeInfo
from kvpool.types import NodeLoad as NodeLoad
from kvpool.types import NodeStatus as NodeStatus


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """A registered adapter (`MasterClient.list_adapters`): its content digest and what the pool holds
    under it (the model's namespaces built with that digest and their blocks)."""

    model_id: str
    name: str
    digest: str
    num_namespaces: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class NamespaceStatus:
    """A registered namespace: its digest, model and weights version, whether reachable, its blocks."""

    namespace: bytes
    model_id: str
    weights_version: str
    active: bool
    num_blocks: int


@dataclass(frozen=True, slots=True)
class HeartbeatAnswer:
    """`known`: the master knows this node and epoch (else register again); `flush_epoch` changes whenever
    a namespace is invalidated (a serving node then drops its local tier)."""

    known: bool
    master_epoch: int
    flush_epoch: int
    leader_epoch: int = 0
    """The answering master's leader epoch (0: a single master); `leader_proof` proves it (secured HA)."""
    leader_proof: str = ""


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What a store, prefill or decode node answers `GetInfo` with: its id, its process's epoch, and the
    fingerprint of its KV layout (`kvpool.types.KVLayout.fingerprint`)."""

    node_id: str
    epoch: int
    layout_fingerprint: str


@dataclass(frozen=True, slots=True)
class Registration:
    heartbeat_interval_ms: int
    master_epoch: int
    layout_fingerprint: str
    leader_epoch: int = 0  # as `HeartbeatAnswer.leader_epoch`
    leader_proof: str = ""


@dataclass(frozen=True, slots=True)
class ReservedBlock:
    block_hash: bytes
    already_present: bool
    locations: tuple[Location, ...]


@dataclass(frozen=True, slots=True)
class Reservation:
    """Slots to write: `reservation_id` is 0 when every block was already present."""

    reservation_id: int
    blocks: list[ReservedBlock]
    write_lease_ms: int
    nodes: dict[str, NodeInfo]
    num_replicas_placed: int


@dataclass(frozen=True, slots=True)
class CommitBlock:
    """One written block: its checksum and the replicas whose write succeeded."""

    block_hash: bytes
    checksum: int
    written: tuple[Location, ...]


@dataclass(frozen=True, slots=True)
class CommitResult:
    num_committed: int
    num_existing: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    used_bytes: int
    capacity_bytes: int
    num_live_leases: int
    num_evictions: int
    num_match_requests: int
    requested_tokens: int
    hit_tokens: int
    requested_blocks: int
    hit_blocks: int
    uptime_s: float
    num_namespaces: int
    num_reserved_blocks: int
    num_rereplications: int
    block_size: int
    nodes: list[NodeStatus] = field(default_factory=list)
    namespaces: list[NamespaceStatus] = field(default_factory=list)
    index_bytes: int = 0  # the master's index memory by its own accounting
    index_bytes_limit: int = 0  # its limit (--max-index-bytes)
    num_admission_refusals: int = 0  # Reserves refused at that limit

    @property
    def hit_rate(self) -> float:
        """Hit tokens / requested tokens of counted matches (0 before any)."""
        return self.hit_tokens / self.requested_tokens if self.requested_tokens else 0.0


@dataclass(frozen=True, slots=True)
class BlockGet:
    """One block of `PoolClient.get_blocks`: `data` on success, else `error` (the caller recomputes)."""

    block_hash: bytes
    ok: bool
    data: bytes | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class GetResult:
    """`num_matched` blocks were in the pool; `blocks` has one entry per matched block, in order.

    `num_ok` is the leading run of blocks read successfully: the prefix the caller may reuse.
    """

    num_matched: int
    blocks: list[BlockGet]

    @property
    def num_ok(self) -> int:
        n = 0
        for b in self.blocks:
            if not b.ok:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class PutResult:
    num_committed: int
    num_existing: int
    num_failed: int
    num_replicas_placed: int


@dataclass(frozen=True, slots=True)
class MastersStatus:
    """`Masters` as answered by one master. `ha` False: a single master without etcd (the rest is empty).
    `role` is the answering master's ("leader" | "standby" | "deposed"); `leader` "" while unknown."""

    ha: bool
    address: str
    role: str
    leader: str
    epoch: int
    standbys: tuple[str, ...]
    etcd_endpoints: tuple[str, ...]
    lease_ttl_s: int
    elections: int
    failovers: int
