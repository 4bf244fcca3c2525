"""Settings and request helpers shared by the prefill and decode nodes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, field_validator

from kvpool.config import KVPoolSettings, check_host_port
from kvpool.errors import InvalidArgument, NotFound
from kvpool.model.settings import DEFAULT_MAX_MODEL_LEN

DEFAULT_MAX_PROMPT_TOKENS = 32_768
"""A node's `max_prompt_tokens` by default (the router's default is the same number)."""


class ServingSettings(KVPoolSettings):
    """Settings of a serving node (env `KVPOOL_<FIELD>`, or a TOML file, or CLI flags)."""

    master: str = Field(default="127.0.0.1:50051", description="master host:port")

    @field_validator("master")
    @classmethod
    def _master_address(cls, value: str) -> str:
        return check_host_port(value)

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


def prompt_token_limit(max_prompt_tokens: int, max_model_len: int) -> int:
    """The longest prompt accepted: at most `max_prompt_tokens`, and one position short of the model's
    context (the first generated token needs it). The one rule of the prefill and decode nodes, the
    router's `_check_prompt` and `kvpool bench ttft`'s check before it starts."""
    return min(max_prompt_tokens, max_model_len - 1)


def model_context_len(model_dir: str | Path | None) -> int:
    """`max_position_embeddings` of a model directory's config.json (None = the embedded model), read
    without torch or loading weights; `NotFound` without a config.json (as the runner), `InvalidArgument`
    when it is not JSON."""
    if model_dir is None:
        from kvpool.model.embedded import DEFAULT_SPEC

        return DEFAULT_SPEC.max_position_embeddings
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(f"no config.json in model directory {path.parent}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}") from None
    cfg = (raw.get("text_config") or raw) if isinstance(raw, dict) else {}
    return int(cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)


def validate_tokens(token_ids: Sequence[int], *, vocab_size: int, max_tokens: int) -> list[int]:
    """A prompt's token ids as a list; `InvalidArgument` when empty, longer than `max_tokens` (see
    `prompt_token_limit`) or out of the vocabulary."""
    tokens = list(token_ids)
    if not tokens:
        raise InvalidArgument("token_ids must not be empty")
    if len(tokens) > max_tokens:
        raise InvalidArgument(f"the prompt has {len(tokens)} tokens; the limit is {max_tokens} tokens")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the model's vocabulary of {vocab_size}")
    return tokens


def step_seed(seed: int, step: int) -> int:
    """The sampling seed for output position `step` of a request seeded with `seed`.

    Position-derived, so the same request samples the same tokens whether its prompt KV was reused or
    recomputed and wherever its first token was sampled (prefill) or the rest (decode).
    """
    return (seed * 1_000_003 + step * 7_919 + 1) % (2**63 - 1)
