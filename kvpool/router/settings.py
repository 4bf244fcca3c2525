"""Router settings (defaults < TOML < `KVPOOL_*` env < CLI flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from kvpool.config import KVPoolSettings, check_masters
from kvpool.prompt import DEFAULT_MAX_PROMPT_TOKENS
from kvpool.router.policy import POLICIES


class RouterSettings(KVPoolSettings):
    master: str = Field(
        default="127.0.0.1:50051",
        description="master host:port (host:port,host:port...: masters in HA, the leader followed)",
    )

    @field_validator("master")
    @classmethod
    def _master_address(cls, value: str) -> str:
        return check_masters(value)

    master_wait_s: float = Field(
        default=30.0,
        ge=0.0,
        description="at start, how long to retry an unreachable master (with back-off) before exiting; "
        "a router given block_size starts at once and answers 503 until the master is back",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port (0 = ephemeral)")
    policy: str = Field(default="cost", description="cost | affinity | least-load | round-robin")
    engines: Literal["kvpool", "vllm"] = Field(
        default="kvpool",
        description="what serves: kvpool's prefill/decode nodes (gRPC), or vLLM engines with kvpool's connector "
        "(OpenAI HTTP; prefill/decode through the pool, kvpool.router.vllm_pd)",
    )
    model: str | None = Field(default=None, description="model directory; None = the embedded model")
    served_model_name: str | None = Field(default=None, description="API model name (default: model id)")
    tenants: str | None = Field(
        default=None,
        description="tenants TOML file (mode 0600; re-read when it changes); None = single tenant",
    )
    tenant_salt_key_file: str | None = Field(
        default=None,
        description="the key of tenants' derived cache salts (HMAC-SHA256; a 0600 file of at least 16 bytes, "
        "the master's too; env KVPOOL_TENANT_SALT_KEY_FILE); needed by a tenants file with a tenant "
        "without cache_salt",
    )
    block_size: int | None = Field(default=None, gt=0, description="None = the master's block size")
    seed: int = Field(default=0, description="seed of the tie-breaking random choice")
    max_prompt_tokens: int = Field(default=DEFAULT_MAX_PROMPT_TOKENS, gt=0)
    max_tokens_limit: int = Field(default=4096, gt=0, description="largest max_tokens a request may ask")
    max_inflight: int = Field(default=64, gt=0, description="concurrent requests; more are answered 429")
    max_inflight_per_tenant: int | None = Field(
        default=None,
        gt=0,
        description="requests in flight per tenant (with a tenants file; from headers to last byte), more "
        "are answered 429 with Retry-After; None = half of max_inflight (at least 1)",
    )
    max_connections: int = Field(
        default=1024,
        gt=0,
        description="open HTTP connections served at once; a request on one more is answered 503",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a request body not received within this many seconds is answered 408",
    )
    max_request_bytes: int = Field(
        default=16 * 2**20,
        gt=0,
        description="largest request body (bytes); a longer one is answered 413 before it is parsed",
    )
    refresh_interval_s: float = Field(default=0.25, gt=0, description="node list refresh period")
    request_timeout_s: float = Field(default=300.0, gt=0)
    node_backoff_s: float = Field(
        default=5.0,
        ge=0,
        description="a node a call could not reach (UNAVAILABLE) is avoided this long, or until it answers",
    )
    node_retries: int = Field(
        default=2,
        ge=0,
        description="other nodes a request is retried on when its node cannot be reached (0 = none)",
    )
    namespace_cache_size: int = Field(
        default=4096,
        gt=0,
        description="cache salts whose namespace digest is kept (LRU; one more is recomputed and registered "
        "with the master again on its next request, so a client sending a new cache_salt per request "
        "grows no state)",
    )
    node_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="keep routing to the last live nodes this long when the master answers but lists none "
        "(while it does not answer: for the whole outage)",
    )
    affinity_blocks: int = Field(
        default=65536,
        gt=0,
        description="block hashes in the router's own record of which prefill node served them (LRU): "
        "placement while the master is unreachable (no peeks)",
    )

    @property
    def tenant_inflight_limit(self) -> int:
        """`max_inflight_per_tenant`, or its default: half of `max_inflight` (at least 1)."""
        return self.max_inflight_per_tenant or max(1, self.max_inflight // 2)

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown routing policy {value!r}; expected one of {', '.join(POLICIES)}")
        return value
