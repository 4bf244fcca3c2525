"""Settings shared by the prefill and decode nodes.

The prompt limits live in `kvpool.prompt` and the model's context length in `kvpool.model.settings`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvpool.config import KVPoolSettings, check_masters
from kvpool.prompt import DEFAULT_MAX_PROMPT_TOKENS


class ServingSettings(KVPoolSettings):
    """Settings of a serving node (env `KVPOOL_<FIELD>`, or a TOML file, or CLI flags)."""

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
        description="at start, how long to retry an unreachable master (with back-off) before exiting",
    )
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port (0 = ephemeral)")
    node_id: str = ""
    model: str | None = Field(default=None, description="HF model directory; None = the embedded model")
    device: str = "cpu"

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        from kvpool.model.settings import check_device

        return check_device(value)

    block_size: int = Field(default=64, gt=0)
    local_tier_bytes: int = Field(default=256 * 1024 * 1024, ge=0, description="node-local tier capacity")
    num_replicas: int = Field(default=1, ge=1)
    lease_ttl_ms: int = Field(default=10_000, gt=0)
    pull_timeout_s: float = Field(default=10.0, gt=0)
    max_prompt_tokens: int = Field(default=DEFAULT_MAX_PROMPT_TOKENS, gt=0)
    max_batch_size: int = Field(default=8, gt=0)
    cost_margin: float = Field(default=0.1, ge=0.0)
    pull_endpoints_per_peer: int = Field(default=2, ge=1, le=16, description="UCX endpoints per store node")
    pull_blocks_per_message: int = Field(
        default=64, ge=1, le=4096, description="blocks per UCX read message (a pull splits into messages)"
    )
    metrics: bool = Field(default=True, description="serve Prometheus /metrics (kvpool.metrics)")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="/metrics port on bind_host (0 = ephemeral)"
    )
