"""The connector's settings: vLLM's `kv_connector_extra_config`, validated (pydantic).

    --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"master": "127.0.0.1:50051"}}'

Unknown keys are refused (a typo must not silently change nothing).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvpool.config import check_host_port, check_masters
from kvpool.errors import InvalidArgument


class ConnectorSettings(BaseModel):
    """`kv_connector_extra_config` keys; units in names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    master: str = Field(
        description="the kvpool master's host:port (required); host:port,host:port...: masters in HA"
    )
    node_id: str = Field(default="", description="this engine's id at the master (default: vllm-<engine_id>)")
    lease_ttl_ms: int = Field(
        default=10_000, gt=0, description="read lease a request holds until its load ends"
    )
    pull_timeout_s: float = Field(default=10.0, gt=0, description="the longest a pull may run")
    match_wait_s: float = Field(
        default=1.0,
        gt=0,
        description="a request waits at most this long for the master's match, then computes",
    )
    num_replicas: int = Field(default=1, ge=1, description="replicas of each published block")
    cost_margin: float = Field(default=0.1, ge=0.0, description="pulls are predicted this much slower")
    publish_max_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="host memory for blocks waiting to be published; past it, saves are dropped",
    )
    load_async: bool = Field(
        default=False,
        description="load between engine steps (the request waits, the batch runs) instead of inside the step",
    )
    save_decode_blocks: bool = Field(
        default=True, description="publish the blocks decode fills (next chat turn)"
    )
    flops_per_s: float = Field(
        default=0.0,
        ge=0.0,
        description="prefill FLOP/s of the start-up recompute model (0: measured at start)",
    )
    master_timeout_s: float = Field(default=2.0, gt=0, description="deadline of one master call")
    pd_wait_s: float = Field(
        default=2.0,
        ge=0.0,
        description="a decode request whose prefill engine published its prompt (kv_transfer_params "
        "kvpool_prefill) waits at most this long for those blocks to be committed, then loads what is there "
        "and computes the rest",
    )
    role: Literal["both", "prefill", "decode"] = Field(
        default="both",
        description="what the engine does in a prefill/decode split: registered as vllm, vllm-prefill or "
        "vllm-decode (the router sends prefills and decodes accordingly)",
    )
    url: str = Field(
        default="",
        description="the engine's OpenAI base URL (http://host:port) the router reaches it at; "
        "'' = not routed to",
    )

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        return check_masters(value)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        value = value.rstrip("/")
        scheme, sep, rest = value.partition("://")
        if value and (scheme not in ("http", "https") or not sep or "/" in rest):
            raise ValueError(f"must be http(s)://host:port, got {value!r}")
        if value:
            check_host_port(rest)
        return value

    @property
    def master_role(self) -> str:
        """The role the engine registers as (`kvpool.master.registry.ROLES`)."""
        return {"both": "vllm", "prefill": "vllm-prefill", "decode": "vllm-decode"}[self.role]

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's extra config; raises `InvalidArgument` with one line per bad key."""
        try:
            return cls(**(extra or {}))
        except ValidationError as exc:
            lines = [f"{'.'.join(str(x) for x in e['loc']) or '?'}: {e['msg']}" for e in exc.errors()]
            raise InvalidArgument("kv_connector_extra_config: " + "; ".join(lines)) from None
