"""Master settings (defaults < TOML < `KVPOOL_*` env < CLI flags)."""

from __future__ import annotations

from pydantic import ByteSize, Field, field_validator, model_validator

from kvpool.config import KVPoolSettings
from kvpool.index import DEFAULT_POLICY
from kvpool.index.policies import ONLINE_POLICY_NAMES
from kvpool.master.admission import default_max_index_bytes
from kvpool.types import DEFAULT_LAYOUT, KVLayout


class MasterSettings(KVPoolSettings):
    """Everything `kvpool master` can be told. Times in ms unless named `_s`."""

    port: int = Field(default=50051, ge=0, le=65535)  # 0 = ephemeral
    layout: str = DEFAULT_LAYOUT
    heartbeat_interval_ms: int = 500
    heartbeat_timeout_ms: int = 10_000  # generous: a store starved by a long prefill on a small box is not dead (stale_after_ms already stops placements)
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    replicas: int = 1
    policy: str = DEFAULT_POLICY
    max_batch_blocks: int = 8192
    max_batch_chains: int = Field(
        default=256, ge=1, description="chains (or commits) per ReserveBatch / CommitBatch call"
    )
    max_batch_total_blocks: int = Field(
        default=8192,
        ge=1,
        description="blocks in all the chains of one ReserveBatch / CommitBatch call (a store's order of "
        "one batch stays within its max_batch_slots)",
    )
    max_lease_ttl_ms: int = 600_000
    default_write_lease_ms: int = 30_000
    max_write_lease_ms: int = 600_000
    rebuild_grace_ms: int = 30_000
    max_index_bytes: ByteSize = Field(
        default_factory=lambda: ByteSize(default_max_index_bytes()),
        ge=1,
        description="the index's memory limit (its own accounting): past it the master evicts leaves or "
        "refuses new blocks (RESOURCE_EXHAUSTED); bytes or a size (8GiB, 1.5GB); default half of the host's "
        "memory",
    )
    inventory_batch_blocks: int = Field(
        default=65_536, ge=1, le=262_144, description="blocks per message of a store's inventory stream"
    )
    tick_ms: int = 100
    reclaim_batch_blocks: int = 4096
    placement_run_blocks: int = 16  # consecutive new blocks of a publish placed on the same nodes
    rereplicate_batch_blocks: int = 256
    store_timeout_s: float = (
        3.0  # below clients' 5 s deadline, so a call to a cut-off store leaves time to answer
    )
    stale_after_ms: int = 2000  # no heartbeat for this long: no new placements there (still alive)
    dead_node_retention_ms: int = Field(
        default=600_000, ge=0
    )  # a dead (or deregistered) node stays listed, alive=false, this long after its last heartbeat; then forgotten
    unreachable_backoff_ms: int = 5000  # after a failed call to a store: no placements or calls to it
    # ---- data-plane health of stores (kvpool.master.dataplane): reported failures, back-off, probe --
    dataplane_fail_after: int = Field(
        default=3,
        ge=1,
        description="reported data-plane failures of a store within dataplane_window_ms that fail it",
    )
    dataplane_window_ms: int = Field(default=10_000, ge=1, description="the window of dataplane_fail_after")
    dataplane_coalesce_ms: int = Field(
        default=1_000,
        ge=0,
        description="failures of one store closer than this count once (one pull, one burst)",
    )
    dataplane_backoff_ms: int = Field(
        default=5_000,
        ge=1,
        description="a failed store is neither placed on nor read from this long, then probed",
    )
    dataplane_max_backoff_ms: int = Field(
        default=60_000, ge=1, description="the back-off doubles on each failed probe or trial, up to this"
    )
    dataplane_trial_ms: int = Field(
        default=10_000, ge=0, description="after a passed probe: one more failure within this fails it again"
    )
    max_workers: int = 16
    max_concurrent_rpcs: int = 256  # more in flight are refused with RESOURCE_EXHAUSTED (bounded queue)
    tenants: str | None = None  # tenants TOML (kvpool.tenants): per-tenant pool quotas (master.quotas)
    tenant_salt_key_file: str | None = None  # the router's salt key (kvpool.tenants): derived salts
    metrics: bool = True  # serve Prometheus /metrics (kvpool.metrics)
    # on bind_host; 0 = ephemeral (announced as metrics_address)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    join_tokens_file: str = Field(
        default="",
        description="JSON file of the join tokens' SHA-256 digests (`kvpool token`), re-read when it "
        "changes; a secured master admits non-store nodes and clients presenting one of them",
    )
    challenge_ttl_ms: int = Field(
        default=30_000, ge=100, description="a join challenge must be answered within this"
    )
    max_spent_challenges_per_node: int = Field(
        default=16,
        ge=1,
        description="spent join challenges remembered per store node id against replays (past it the "
        "oldest is forgotten and every older challenge of that node is refused; kvpool.master.challenges)",
    )
    join_rate_per_s: float = Field(
        default=20.0,
        ge=0.0,
        description="JoinChallenge and RegisterNode calls per second per peer address (a token bucket; "
        "RESOURCE_EXHAUSTED past it; 0 = no limit; kvpool.master.ratelimit)",
    )
    join_burst: int = Field(
        default=200, ge=1, description="a peer's token bucket size for the open calls (join_rate_per_s)"
    )
    max_rate_limited_peers: int = Field(
        default=4096,
        ge=1,
        description="peer addresses with a token bucket at once (the least recently seen is forgotten)",
    )
    # ---- bounded state: everything a client can create has a cap or an expiry -----------
    max_namespaces: int = Field(
        default=100_000,
        ge=1,
        description="namespaces registered at once, all tenants (RESOURCE_EXHAUSTED past it; idle ones expire)",
    )
    max_namespaces_per_tenant: int = Field(
        default=25_000,
        ge=1,
        description="namespaces registered at once per tenant, i.e. per cache salt before its first '/' "
        "(kvpool.tenants): one tenant's distinct salts cannot take every namespace",
    )
    namespace_idle_expiry_s: float = Field(
        default=600.0,
        ge=60.0,
        description="a namespace with no blocks in the pool, not registered or matched for this long (s), "
        "is forgotten (a later RegisterNamespace recreates it; serving nodes re-register within 60 s)",
    )
    max_models: int = Field(
        default=10_000,
        ge=1,
        description="model ids with an active-version record; past it a new model id is refused unless a "
        "model with no namespaces left, never set by SetModelVersion, can be forgotten",
    )
    max_adapters: int = Field(
        default=10_000,
        ge=1,
        description="adapter names registered at once (RegisterAdapter), all models, and as many fenced "
        "adapter digests remembered (reloaded or unloaded; the oldest is forgotten first)",
    )
    max_leases: int = Field(
        default=200_000,
        ge=1,
        description="live read leases (leased matches), all clients: MatchPrefix carries no client "
        "identity, so the cap is global; leases expire (at most max_lease_ttl_ms) and are reaped",
    )
    max_leases_per_client: int = Field(
        default=10_000,
        ge=1,
        description="live write leases (open reservations) per writer_node_id of Reserve",
    )

    # ---- high availability (kvpool.master.ha): several masters, one leader elected through etcd ------
    etcd: str = Field(
        default="",
        description="etcd endpoints HOST:PORT[,HOST:PORT...]: campaign for leadership there (HA); empty: a "
        "single master, no etcd",
    )
    ha_prefix: str = Field(
        default="/kvpool/master",
        min_length=2,
        description="etcd key prefix of the election: masters sharing a pool share it",
    )
    ha_lease_ttl_s: int = Field(
        default=5,
        ge=2,
        le=60,
        description="etcd lease TTL (s): a dead leader is replaced about this long after its last keep-alive "
        "(sent every TTL/3); a leader with no keep-alive answered for TTL - max(0.5, TTL/5) s stops taking "
        "writes",
    )
    etcd_user: str = Field(
        default="", description="etcd user of the election (etcd auth on); with etcd_password_file"
    )
    etcd_password_file: str = Field(
        default="", description="file holding etcd_user's password (first line; mode 0600)"
    )
    etcd_ca_file: str = Field(default="", description="PEM CA of etcd's TLS certificate: reach etcd over TLS")
    etcd_cert_file: str = Field(
        default="", description="PEM client certificate for etcd (with etcd_key_file)"
    )
    etcd_key_file: str = Field(default="", description="PEM key of etcd_cert_file")
    advertise_address: str = Field(
        default="",
        description="HOST:PORT other masters and clients reach this master at (named as the leader); empty: "
        "the bind host (127.0.0.1 for a wildcard bind) and the bound port",
    )

    @field_validator("etcd")
    @classmethod
    def _etcd(cls, value: str) -> str:
        if value:
            from kvpool.master.ha.endpoints import parse_endpoints

            parse_endpoints(value)
        return value

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in (*ONLINE_POLICY_NAMES, "default"):
            offline = " (opt is offline-only: it needs each block's next use; `kvpool bench trace` runs it)"
            raise ValueError(
                f"policy must be one of {', '.join(ONLINE_POLICY_NAMES)}{offline}, got {value!r}"
            )
        return value

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        KVLayout.from_fingerprint(value)
        return value

    @model_validator(mode="after")
    def _ranges(self) -> MasterSettings:
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ValueError(
                "need 0 < low_watermark <= high_watermark <= 1 (--low-watermark, --high-watermark); "
                f"got {self.low_watermark:g} and {self.high_watermark:g}"
            )
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.heartbeat_timeout_ms <= self.heartbeat_interval_ms:
            raise ValueError("heartbeat_timeout_ms must exceed heartbeat_interval_ms")
        if self.placement_run_blocks < 1:
            raise ValueError("placement_run_blocks must be >= 1")
        if self.dataplane_max_backoff_ms < self.dataplane_backoff_ms:
            raise ValueError("dataplane_max_backoff_ms must be >= dataplane_backoff_ms")
        if self.stale_after_ms <= 0 or self.unreachable_backoff_ms < 0:
            raise ValueError("stale_after_ms must be > 0 and unreachable_backoff_ms >= 0")
        return self

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.from_fingerprint(self.layout)
