"""Values the client library returns (frozen dataclasses; no proto type leaves `kvpool.client`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.hashing import Namespace
from kvpool.types import KVLayout, Location


@dataclass(frozen=True, slots=True)
class EngineNamespace:
    """What a vLLM engine's namespaces are built from besides a request's cache salt and adapter
    (`kvpool.vllm.identity`): a router rebuilds the request's namespace with `namespace(cache_salt)`, so
    its keys are the engine's by construction (field cases B30/B31: one key function)."""

    model_id: str
    weights_version: str
    layout_fingerprint: str
    engine: str  # vllm-<version>-<device>-<kernel>

    def namespace(self, cache_salt: str = "", adapter_digest: str = "") -> Namespace:
        """The namespace of a request with `cache_salt` and adapter (`""`: the base model); the engine's
        connector builds its namespaces with this same function. `ValueError` on a bad layout."""
        return Namespace(
            model_id=self.model_id,
            weights_version=self.weights_version,
            layout=KVLayout.from_fingerprint(self.layout_fingerprint),
            cache_salt=cache_salt,
            adapter_digest=adapter_digest,
            extra=(("engine", self.engine),),
        )


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
class NodeInfo:
    node_id: str
    role: str
    grpc_address: str
    data_address: str
    epoch: int
    url: str = ""  # a vLLM engine's OpenAI base URL
    engine_namespace: EngineNamespace | None = None  # a vLLM engine's namespace base


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


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """Load and calibration figures a node reports with its heartbeats."""

    queue_len: int = 0
    recompute_s_per_token: float = 0.0
    recompute_s_per_token_ctx: float = 0.0
    recompute_overhead_s: float = 0.0
    link_alpha_s: float = 0.0
    link_beta_bytes_per_s: float = 0.0
    kv_usage: float = 0.0  # fraction of the node's KV cache in use (vLLM engines)


@dataclass(frozen=True, slots=True)
class Registration:
    heartbeat_interval_ms: int
    master_epoch: int
    layout_fingerprint: str


@dataclass(frozen=True, slots=True)
class Match:
    """A prefix match: `replicas[i]` are block i's locations; `nodes` maps node id -> endpoint.

    `lease_id` is None without a lease; release it (or let it expire) when done reading.
    """

    num_matched: int
    replicas: list[tuple[Location, ...]]
    lease_id: int | None
    nodes: dict[str, NodeInfo]

    def data_address(self, node_id: str) -> str:
        """The UCX address of a store node named in `replicas` ("" when unknown)."""
        node = self.nodes.get(node_id)
        return node.data_address if node is not None else ""


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
class NodeStatus:
    node: NodeInfo
    alive: bool
    draining: bool
    num_slots: int
    num_used_slots: int
    num_blocks: int
    used_bytes: int
    load: NodeLoad
    dataplane_state: str = ""  # a store's data plane: ok | suspect | failed | trial (kvpool.master.dataplane)
    num_dataplane_failures: int = 0
    silent_s: float = 0.0  # since the master last heard from it (heartbeat or registration), seconds


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
