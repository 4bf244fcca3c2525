from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierMoveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_MOVE_STATUS_UNSPECIFIED: _ClassVar[TierMoveStatus]
    TIER_MOVE_OK: _ClassVar[TierMoveStatus]
    TIER_MOVE_FAILED: _ClassVar[TierMoveStatus]
    TIER_MOVE_STALE: _ClassVar[TierMoveStatus]
TIER_MOVE_STATUS_UNSPECIFIED: TierMoveStatus
TIER_MOVE_OK: TierMoveStatus
TIER_MOVE_FAILED: TierMoveStatus
TIER_MOVE_STALE: TierMoveStatus

class BlockLocation(_message.Message):
    __slots__ = ("node_id", "slot", "generation", "local", "capability", "capability_expiry_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    slot: int
    generation: int
    local: bool
    capability: bytes
    capability_expiry_ms: int
    def __init__(self, node_id: _Optional[str] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ..., local: _Optional[bool] = ..., capability: _Optional[bytes] = ..., capability_expiry_ms: _Optional[int] = ...) -> None: ...

class BlockReplicas(_message.Message):
    __slots__ = ("locations",)
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class NodeEndpoint(_message.Message):
    __slots__ = ("node_id", "role", "grpc_address", "data_address", "epoch", "url", "engine_namespace")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    grpc_address: str
    data_address: str
    epoch: int
    url: str
    engine_namespace: EngineNamespace
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., data_address: _Optional[str] = ..., epoch: _Optional[int] = ..., url: _Optional[str] = ..., engine_namespace: _Optional[_Union[EngineNamespace, _Mapping]] = ...) -> None: ...

class EngineNamespace(_message.Message):
    __slots__ = ("model_id", "weights_version", "layout_fingerprint", "engine")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_version: str
    layout_fingerprint: str
    engine: str
    def __init__(self, model_id: _Optional[str] = ..., weights_version: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., engine: _Optional[str] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("queue_len", "recompute_s_per_token", "recompute_s_per_token_ctx", "recompute_overhead_s", "link_alpha_s", "link_beta_bytes_per_s", "kv_usage")
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_PER_TOKEN_CTX_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    LINK_ALPHA_S_FIELD_NUMBER: _ClassVar[int]
    LINK_BETA_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    queue_len: int
    recompute_s_per_token: float
    recompute_s_per_token_ctx: float
    recompute_overhead_s: float
    link_alpha_s: float
    link_beta_bytes_per_s: float
    kv_usage: float
    def __init__(self, queue_len: _Optional[int] = ..., recompute_s_per_token: _Optional[float] = ..., recompute_s_per_token_ctx: _Optional[float] = ..., recompute_overhead_s: _Optional[float] = ..., link_alpha_s: _Optional[float] = ..., link_beta_bytes_per_s: _Optional[float] = ..., kv_usage: _Optional[float] = ...) -> None: ...

class SlotRef(_message.Message):
    __slots__ = ("slot", "generation")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "protocol_version", "layout_fingerprint", "num_slots", "block_nbytes", "challenge", "proof")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoint
    protocol_version: int
    layout_fingerprint: str
    num_slots: int
    block_nbytes: int
    challenge: bytes
    proof: bytes
    def __init__(self, node: _Optional[_Union[NodeEndpoint, _Mapping]] = ..., protocol_version: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., num_slots: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., challenge: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "master_epoch", "layout_fingerprint", "secured", "session", "leader_epoch", "leader_proof")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SECURED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_PROOF_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    master_epoch: int
    layout_fingerprint: str
    secured: bool
    session: bytes
    leader_epoch: int
    leader_proof: str
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., master_epoch: _Optional[int] = ..., layout_fingerprint: _Optional[str] = ..., secured: _Optional[bool] = ..., session: _Optional[bytes] = ..., leader_epoch: _Optional[int] = ..., leader_proof: _Optional[str] = ...) -> None: ...

class JoinChallengeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class JoinChallengeResponse(_message.Message):
    __slots__ = ("challenge", "expires_in_ms")
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    challenge: bytes
    expires_in_ms: int
    def __init__(self, challenge: _Optional[bytes] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "freed_slots", "num_used_slots", "load", "session", "disk")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FREED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    freed_slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    num_used_slots: int
    load: NodeLoad
    session: bytes
    disk: DiskTierInfo
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., freed_slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., num_used_slots: _Optional[int] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., session: _Optional[bytes] = ..., disk: _Optional[_Union[DiskTierInfo, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "master_epoch", "flush_epoch", "leader_epoch", "leader_proof")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    MASTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FLUSH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_PROOF_FIELD_NUMBER: _ClassVar[int]
    known: bool
    master_epoch: int
    flush_epoch: int
    leader_epoch: int
    leader_proof: str
    def __init__(self, known: _Optional[bool] = ..., master_epoch: _Optional[int] = ..., flush_epoch: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., leader_proof: _Optional[str] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "session")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    session: bytes
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("model_id", "weights_version", "layout_fingerprint", "cache_salt", "adapter_digest", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_version: str
    layout_fingerprint: str
    cache_salt: str
    adapter_digest: str
    extra: _containers.ScalarMap[str, str]
    def __init__(self, model_id: _Optional[str] = ..., weights_version: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., cache_salt: _Optional[str] = ..., adapter_digest: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace", "active_version")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    active_version: str
    def __init__(self, namespace: _Optional[bytes] = ..., active_version: _Optional[str] = ...) -> None: ...

class SetModelVersionRequest(_message.Message):
    __slots__ = ("model_id", "weights_version", "force")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_version: str
    force: bool
    def __init__(self, model_id: _Optional[str] = ..., weights_version: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class SetModelVersionResponse(_message.Message):
    __slots__ = ("previous_version", "num_namespaces_invalidated", "num_blocks_unreachable")
    PREVIOUS_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    previous_version: str
    num_namespaces_invalidated: int
    num_blocks_unreachable: int
    def __init__(self, previous_version: _Optional[str] = ..., num_namespaces_invalidated: _Optional[int] = ..., num_blocks_unreachable: _Optional[int] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "count_hit", "lease_ttl_ms", "request_id", "num_prompt_tokens", "packed_replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    COUNT_HIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PACKED_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    count_hit: bool
    lease_ttl_ms: int
    request_id: str
    num_prompt_tokens: int
    packed_replicas: bool
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., count_hit: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., packed_replicas: _Optional[bool] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("num_matched", "replicas", "lease_id", "lease_ttl_ms", "nodes", "request_id", "replica_node_ids", "replica_node", "replica_slot", "replica_generation", "replica_count", "replica_local", "replica_capability", "capability_expiry_ms", "leader_epoch", "leader_proof")
    NUM_MATCHED_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SLOT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_COUNT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LOCAL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_PROOF_FIELD_NUMBER: _ClassVar[int]
    num_matched: int
    replicas: _containers.RepeatedCompositeFieldContainer[BlockReplicas]
    lease_id: int
    lease_ttl_ms: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEndpoint]
    request_id: str
    replica_node_ids: _containers.RepeatedScalarFieldContainer[str]
    replica_node: _containers.RepeatedScalarFieldContainer[int]
    replica_slot: _containers.RepeatedScalarFieldContainer[int]
    replica_generation: _containers.RepeatedScalarFieldContainer[int]
    replica_count: _containers.RepeatedScalarFieldContainer[int]
    replica_local: _containers.RepeatedScalarFieldContainer[int]
    replica_capability: _containers.RepeatedScalarFieldContainer[bytes]
    capability_expiry_ms: int
    leader_epoch: int
    leader_proof: str
    def __init__(self, num_matched: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[BlockReplicas, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeEndpoint, _Mapping]]] = ..., request_id: _Optional[str] = ..., replica_node_ids: _Optional[_Iterable[str]] = ..., replica_node: _Optional[_Iterable[int]] = ..., replica_slot: _Optional[_Iterable[int]] = ..., replica_generation: _Optional[_Iterable[int]] = ..., replica_count: _Optional[_Iterable[int]] = ..., replica_local: _Optional[_Iterable[int]] = ..., replica_capability: _Optional[_Iterable[bytes]] = ..., capability_expiry_ms: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., leader_proof: _Optional[str] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl_ms: int
    def __init__(self, lease_id: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: int
    def __init__(self, ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ("num_released", "num_not_found")
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    num_not_found: int
    def __init__(self, num_released: _Optional[int] = ..., num_not_found: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace", "parent_hash", "block_hashes", "num_replicas", "block_nbytes", "recompute_cost_s", "write_lease_ms", "request_id", "writer_node_id", "flush_epoch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_S_FIELD_NUMBER: _ClassVar[int]
    WRITE_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FLUSH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    parent_hash: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_replicas: int
    block_nbytes: int
    recompute_cost_s: _containers.RepeatedScalarFieldContainer[float]
    write_lease_ms: int
    request_id: str
    writer_node_id: str
    flush_epoch: int
    def __init__(self, namespace: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_replicas: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., recompute_cost_s: _Optional[_Iterable[float]] = ..., write_lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., writer_node_id: _Optional[str] = ..., flush_epoch: _Optional[int] = ...) -> None: ...

class ReservedBlock(_message.Message):
    __slots__ = ("block_hash", "already_present", "locations")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    already_present: bool
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, block_hash: _Optional[bytes] = ..., already_present: _Optional[bool] = ..., locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "blocks", "write_lease_ms", "nodes", "num_replicas_placed", "leader_epoch", "leader_proof")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WRITE_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_PLACED_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_PROOF_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[ReservedBlock]
    write_lease_ms: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeEndpoint]
    num_replicas_placed: int
    leader_epoch: int
    leader_proof: str
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[ReservedBlock, _Mapping]]] = ..., write_lease_ms: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeEndpoint, _Mapping]]] = ..., num_replicas_placed: _Optional[int] = ..., leader_epoch: _Optional[int] = ..., leader_proof: _Optional[str] = ...) -> None: ...

class CommittedBlock(_message.Message):
    __slots__ = ("block_hash", "checksum", "written")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    checksum: int
    written: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    def __init__(self, block_hash: _Optional[bytes] = ..., checksum: _Optional[int] = ..., written: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[CommittedBlock]
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[CommittedBlock, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("num_committed", "num_existing")
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    num_committed: int
    num_existing: int
    def __init__(self, num_committed: _Optional[int] = ..., num_existing: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    def __init__(self, reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoveBlocksRequest(_message.Message):
    __slots__ = ("namespace", "block_hashes", "force")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    force: bool
    def __init__(self, namespace: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveBlocksResponse(_message.Message):
    __slots__ = ("num_removed",)
    NUM_REMOVED_FIELD_NUMBER: _ClassVar[int]
    num_removed: int
    def __init__(self, num_removed: _Optional[int] = ...) -> None: ...

class ReportBadReplicaRequest(_message.Message):
    __slots__ = ("namespace", "block_hash", "location", "reason")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    block_hash: bytes
    location: BlockLocation
    reason: str
    def __init__(self, namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., location: _Optional[_Union[BlockLocation, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportBadReplicaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportDataPlaneFailureRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "kind", "detail")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    kind: str
    detail: str
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., kind: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportDataPlaneFailureResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportLocalRequest(_message.Message):
    __slots__ = ("node_id", "epoch", "namespace", "stored", "removed", "cleared")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    namespace: bytes
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    cleared: bool
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., namespace: _Optional[bytes] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., cleared: _Optional[bool] = ...) -> None: ...

class ReportLocalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node", "alive", "draining", "num_slots", "num_used_slots", "num_blocks", "used_bytes", "load", "dataplane_state", "num_dataplane_failures", "silent_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_DATAPLANE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SILENT_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoint
    alive: bool
    draining: bool
    num_slots: int
    num_used_slots: int
    num_blocks: int
    used_bytes: int
    load: NodeLoad
    dataplane_state: str
    num_dataplane_failures: int
    silent_ms: int
    def __init__(self, node: _Optional[_Union[NodeEndpoint, _Mapping]] = ..., alive: _Optional[bool] = ..., draining: _Optional[bool] = ..., num_slots: _Optional[int] = ..., num_used_slots: _Optional[int] = ..., num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ..., dataplane_state: _Optional[str] = ..., num_dataplane_failures: _Optional[int] = ..., silent_ms: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks", "used_bytes", "capacity_bytes", "num_live_leases", "num_evictions", "num_match_requests", "requested_tokens", "hit_tokens", "requested_blocks", "hit_blocks", "uptime_s", "nodes", "num_namespaces", "num_reserved_blocks", "num_rereplications", "block_size", "namespaces", "index_bytes", "index_bytes_limit", "num_admission_refusals")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REREPLICATIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    NUM_ADMISSION_REFUSALS_FIELD_NUMBER: _ClassVar[int]
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
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    num_namespaces: int
    num_reserved_blocks: int
    num_rereplications: int
    block_size: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    index_bytes: int
    index_bytes_limit: int
    num_admission_refusals: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_live_leases: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_match_requests: _Optional[int] = ..., requested_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., requested_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., uptime_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ..., num_namespaces: _Optional[int] = ..., num_reserved_blocks: _Optional[int] = ..., num_rereplications: _Optional[int] = ..., block_size: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ..., index_bytes: _Optional[int] = ..., index_bytes_limit: _Optional[int] = ..., num_admission_refusals: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace", "model_id", "weights_version", "active", "num_blocks")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    model_id: str
    weights_version: str
    active: bool
    num_blocks: int
    def __init__(self, namespace: _Optional[bytes] = ..., model_id: _Optional[str] = ..., weights_version: _Optional[str] = ..., active: _Optional[bool] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "cancel")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cancel: bool
    def __init__(self, node_id: _Optional[str] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_blocks_to_move",)
    NUM_BLOCKS_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    num_blocks_to_move: int
    def __init__(self, num_blocks_to_move: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("fraction", "node_id")
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    fraction: float
    node_id: str
    def __init__(self, fraction: _Optional[float] = ..., node_id: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_evicted", "shortfall")
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    SHORTFALL_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    shortfall: int
    def __init__(self, num_evicted: _Optional[int] = ..., shortfall: _Optional[int] = ...) -> None: ...

class InvalidateNamespaceRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: bytes
    def __init__(self, namespace: _Optional[bytes] = ...) -> None: ...

class InvalidateNamespaceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("model_id", "name", "digest")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    digest: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class RegisterAdapterResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class ReloadAdapterRequest(_message.Message):
    __slots__ = ("model_id", "name", "digest")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    digest: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("model_id", "name")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class AdapterChangeResponse(_message.Message):
    __slots__ = ("previous_digest", "num_namespaces_invalidated", "num_blocks_invalidated")
    PREVIOUS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    previous_digest: str
    num_namespaces_invalidated: int
    num_blocks_invalidated: int
    def __init__(self, previous_digest: _Optional[str] = ..., num_namespaces_invalidated: _Optional[int] = ..., num_blocks_invalidated: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("model_id", "name", "digest", "num_namespaces", "num_blocks")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    digest: str
    num_namespaces: int
    num_blocks: int
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., digest: _Optional[str] = ..., num_namespaces: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class MastersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MastersResponse(_message.Message):
    __slots__ = ("ha", "address", "role", "leader", "epoch", "standbys", "etcd_endpoints", "lease_ttl_s", "elections", "failovers")
    HA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STANDBYS_FIELD_NUMBER: _ClassVar[int]
    ETCD_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    ELECTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    ha: bool
    address: str
    role: str
    leader: str
    epoch: int
    standbys: _containers.RepeatedScalarFieldContainer[str]
    etcd_endpoints: _containers.RepeatedScalarFieldContainer[str]
    lease_ttl_s: int
    elections: int
    failovers: int
    def __init__(self, ha: _Optional[bool] = ..., address: _Optional[str] = ..., role: _Optional[str] = ..., leader: _Optional[str] = ..., epoch: _Optional[int] = ..., standbys: _Optional[_Iterable[str]] = ..., etcd_endpoints: _Optional[_Iterable[str]] = ..., lease_ttl_s: _Optional[int] = ..., elections: _Optional[int] = ..., failovers: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("node", "layout_fingerprint", "num_slots", "block_nbytes", "segment_bytes", "num_used_slots", "num_inflight_transfers", "rss_bytes", "disk")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    node: NodeEndpoint
    layout_fingerprint: str
    num_slots: int
    block_nbytes: int
    segment_bytes: int
    num_used_slots: int
    num_inflight_transfers: int
    rss_bytes: int
    disk: DiskTierInfo
    def __init__(self, node: _Optional[_Union[NodeEndpoint, _Mapping]] = ..., layout_fingerprint: _Optional[str] = ..., num_slots: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., segment_bytes: _Optional[int] = ..., num_used_slots: _Optional[int] = ..., num_inflight_transfers: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., disk: _Optional[_Union[DiskTierInfo, _Mapping]] = ...) -> None: ...

class DiskTierInfo(_message.Message):
    __slots__ = ("first_slot", "num_slots", "block_nbytes", "num_used_slots", "num_reserved_slots", "first_generation", "alpha_s", "beta_s_per_byte", "degraded", "direct", "recovered_blocks")
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ALPHA_S_FIELD_NUMBER: _ClassVar[int]
    BETA_S_PER_BYTE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    first_slot: int
    num_slots: int
    block_nbytes: int
    num_used_slots: int
    num_reserved_slots: int
    first_generation: int
    alpha_s: float
    beta_s_per_byte: float
    degraded: str
    direct: bool
    recovered_blocks: int
    def __init__(self, first_slot: _Optional[int] = ..., num_slots: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., num_used_slots: _Optional[int] = ..., num_reserved_slots: _Optional[int] = ..., first_generation: _Optional[int] = ..., alpha_s: _Optional[float] = ..., beta_s_per_byte: _Optional[float] = ..., degraded: _Optional[str] = ..., direct: _Optional[bool] = ..., recovered_blocks: _Optional[int] = ...) -> None: ...

class SlotReservation(_message.Message):
    __slots__ = ("slot", "generation", "namespace", "block_hash", "parent_hash")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., namespace: _Optional[bytes] = ..., block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ...) -> None: ...

class ReserveSlotsRequest(_message.Message):
    __slots__ = ("slots", "write_lease_ms", "leader_epoch")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WRITE_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotReservation]
    write_lease_ms: int
    leader_epoch: int
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotReservation, _Mapping]]] = ..., write_lease_ms: _Optional[int] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class ReserveSlotsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitSlotsRequest(_message.Message):
    __slots__ = ("slots", "leader_epoch")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    leader_epoch: int
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class SlotResult(_message.Message):
    __slots__ = ("slot", "generation", "ok", "error")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    slot: int
    generation: int
    ok: bool
    error: str
    def __init__(self, slot: _Optional[int] = ..., generation: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class CommitSlotsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SlotResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SlotResult, _Mapping]]] = ...) -> None: ...

class FreeSlotsRequest(_message.Message):
    __slots__ = ("slots", "leader_epoch")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[SlotRef]
    leader_epoch: int
    def __init__(self, slots: _Optional[_Iterable[_Union[SlotRef, _Mapping]]] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class FreedSlot(_message.Message):
    __slots__ = ("slot", "new_generation", "deferred")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NEW_GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    slot: int
    new_generation: int
    deferred: bool
    def __init__(self, slot: _Optional[int] = ..., new_generation: _Optional[int] = ..., deferred: _Optional[bool] = ...) -> None: ...

class FreeSlotsResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[FreedSlot]
    def __init__(self, slots: _Optional[_Iterable[_Union[FreedSlot, _Mapping]]] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("after_slot", "max_entries")
    AFTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    after_slot: int
    max_entries: int
    def __init__(self, after_slot: _Optional[int] = ..., max_entries: _Optional[int] = ...) -> None: ...

class InventoryResponse(_message.Message):
    __slots__ = ("epoch", "num_entries", "namespaces", "ns_index", "block_hashes", "parent_hashes", "has_parent", "slots", "generations", "checksums", "size_bytes", "next_slot", "medium")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    NS_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NEXT_SLOT_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_entries: int
    namespaces: _containers.RepeatedScalarFieldContainer[bytes]
    ns_index: bytes
    block_hashes: bytes
    parent_hashes: bytes
    has_parent: bytes
    slots: bytes
    generations: bytes
    checksums: bytes
    size_bytes: bytes
    next_slot: int
    medium: bytes
    def __init__(self, epoch: _Optional[int] = ..., num_entries: _Optional[int] = ..., namespaces: _Optional[_Iterable[bytes]] = ..., ns_index: _Optional[bytes] = ..., block_hashes: _Optional[bytes] = ..., parent_hashes: _Optional[bytes] = ..., has_parent: _Optional[bytes] = ..., slots: _Optional[bytes] = ..., generations: _Optional[bytes] = ..., checksums: _Optional[bytes] = ..., size_bytes: _Optional[bytes] = ..., next_slot: _Optional[int] = ..., medium: _Optional[bytes] = ...) -> None: ...

class CopyBlock(_message.Message):
    __slots__ = ("src", "dst", "checksum", "src_capability", "src_capability_expiry_ms")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SRC_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SRC_CAPABILITY_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    src: SlotRef
    dst: SlotRef
    checksum: int
    src_capability: bytes
    src_capability_expiry_ms: int
    def __init__(self, src: _Optional[_Union[SlotRef, _Mapping]] = ..., dst: _Optional[_Union[SlotRef, _Mapping]] = ..., checksum: _Optional[int] = ..., src_capability: _Optional[bytes] = ..., src_capability_expiry_ms: _Optional[int] = ...) -> None: ...

class CopyBlocksRequest(_message.Message):
    __slots__ = ("src_data_address", "blocks", "leader_epoch")
    SRC_DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    src_data_address: str
    blocks: _containers.RepeatedCompositeFieldContainer[CopyBlock]
    leader_epoch: int
    def __init__(self, src_data_address: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[CopyBlock, _Mapping]]] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class CopyBlocksResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SlotResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SlotResult, _Mapping]]] = ...) -> None: ...

class TierMove(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: SlotRef
    dst: SlotRef
    def __init__(self, src: _Optional[_Union[SlotRef, _Mapping]] = ..., dst: _Optional[_Union[SlotRef, _Mapping]] = ...) -> None: ...

class TierMoveRequest(_message.Message):
    __slots__ = ("moves", "leader_epoch")
    MOVES_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    moves: _containers.RepeatedCompositeFieldContainer[TierMove]
    leader_epoch: int
    def __init__(self, moves: _Optional[_Iterable[_Union[TierMove, _Mapping]]] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class TierMoveResult(_message.Message):
    __slots__ = ("src", "dst", "status", "error")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    src: SlotRef
    dst: SlotRef
    status: TierMoveStatus
    error: str
    def __init__(self, src: _Optional[_Union[SlotRef, _Mapping]] = ..., dst: _Optional[_Union[SlotRef, _Mapping]] = ..., status: _Optional[_Union[TierMoveStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...

class TierMoveResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TierMoveResult]
    def __init__(self, results: _Optional[_Iterable[_Union[TierMoveResult, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "has_seed", "max_tokens", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "cache_salt", "publish", "use_cache")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    USE_CACHE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    publish: bool
    use_cache: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., publish: _Optional[bool] = ..., use_cache: _Optional[bool] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_matched_tokens", "num_reused_tokens", "num_pulled_tokens", "num_local_tokens", "pulled_bytes", "decision", "match_s", "pull_s", "compute_s", "ttft_s", "predicted_pull_s", "predicted_recompute_s", "num_failed_blocks", "predicted_compute_s")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    MATCH_S_FIELD_NUMBER: _ClassVar[int]
    PULL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_PULL_S_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_matched_tokens: int
    num_reused_tokens: int
    num_pulled_tokens: int
    num_local_tokens: int
    pulled_bytes: int
    decision: str
    match_s: float
    pull_s: float
    compute_s: float
    ttft_s: float
    predicted_pull_s: float
    predicted_recompute_s: float
    num_failed_blocks: int
    predicted_compute_s: float
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_matched_tokens: _Optional[int] = ..., num_reused_tokens: _Optional[int] = ..., num_pulled_tokens: _Optional[int] = ..., num_local_tokens: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., decision: _Optional[str] = ..., match_s: _Optional[float] = ..., pull_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., predicted_pull_s: _Optional[float] = ..., predicted_recompute_s: _Optional[float] = ..., num_failed_blocks: _Optional[int] = ..., predicted_compute_s: _Optional[float] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "block_hashes", "stats")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    stats: PrefillStats
    def __init__(self, token_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., stats: _Optional[_Union[PrefillStats, _Mapping]] = ...) -> None: ...

class PrefillPublished(_message.Message):
    __slots__ = ("status", "num_blocks", "num_existing", "publish_s", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXISTING_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: str
    num_blocks: int
    num_existing: int
    publish_s: float
    error: str
    def __init__(self, status: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_existing: _Optional[int] = ..., publish_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "published")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    first_token: PrefillFirstToken
    published: PrefillPublished
    def __init__(self, first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., published: _Optional[_Union[PrefillPublished, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "first_token", "block_hashes", "sampling", "cache_salt", "prompt_committed", "publish", "use_cache")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    USE_CACHE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    sampling: SamplingParams
    cache_salt: str
    prompt_committed: bool
    publish: bool
    use_cache: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., prompt_committed: _Optional[bool] = ..., publish: _Optional[bool] = ..., use_cache: _Optional[bool] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_reused_tokens", "num_pulled_tokens", "pulled_bytes", "decision", "load_s", "decode_s", "num_generated", "finish_reason", "num_published_blocks")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PUBLISHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_reused_tokens: int
    num_pulled_tokens: int
    pulled_bytes: int
    decision: str
    load_s: float
    decode_s: float
    num_generated: int
    finish_reason: str
    num_published_blocks: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_reused_tokens: _Optional[int] = ..., num_pulled_tokens: _Optional[int] = ..., pulled_bytes: _Optional[int] = ..., decision: _Optional[str] = ..., load_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., num_generated: _Optional[int] = ..., finish_reason: _Optional[str] = ..., num_published_blocks: _Optional[int] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token_ids", "finished", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    stats: DecodeStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., stats: _Optional[_Union[DecodeStats, _Mapping]] = ...) -> None: ...
