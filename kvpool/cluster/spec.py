"""The TOML cluster spec of `kvpool up -c cluster.toml`: roles, counts, hosts, ports, model, pool settings.

    [cluster]
    model = ""              # model directory; "" = the embedded model
    block_size = 64
    device = "cpu"
    restart_backoff_s = 1.0     # a crashed role restarts after this, doubled per crash in the window
    restart_backoff_max_s = 30.0
    max_restarts = 5            # restarts allowed within restart_window_s; one more crash: kvpool up stops
    restart_window_s = 60.0
    masters = 1             # > 1: masters in HA on an embedded etcd (docs/ha.md)
    tls = true              # gRPC TLS: a fresh CA and certificate for every role (kvpool.cluster.tls); false = plaintext

    [master]
    host = "127.0.0.1"
    port = 50051            # 0 = ephemeral (single host only: other hosts need a fixed port); master i: port + i
    etcd_port = 0           # masters > 1: the embedded etcd's client port on 127.0.0.1 (0: a free one)
    replicas = 1
    eviction_policy = "tail"
    high_watermark = 0.9
    low_watermark = 0.8
    max_index_bytes = "8GiB"  # optional: the index's memory limit (unset: half of the host's memory)

    [store]
    count = 2
    hosts = ["127.0.0.1"]   # instance i runs on hosts[i % len(hosts)]
    segment_size = "256MiB"

    [prefill]
    count = 2

    [decode]
    count = 1

    [router]
    port = 8000
    policy = "cost"
    tenants = ""            # tenants TOML file; "" = single tenant

Every error names the file, the line (when the key is in the file) and the field. `kvpool.cluster.launch`
turns a spec into the role commands `kvpool up` starts.
"""

from __future__ import annotations

import re
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpool.errors import InvalidArgument
from kvpool.index import DEFAULT_POLICY, POLICY_NAMES

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_EVICTION = tuple(n for n in POLICY_NAMES if n != "opt")  # opt is an offline oracle
_POLICIES = ("cost", "affinity", "least-load", "round-robin")
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
"""Refused as a master, store or serving host: each binds to its configured host, the cluster interface."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClusterSection(_Section):
    model: str = ""
    block_size: int = Field(default=64, gt=0, le=4096)
    device: str = "cpu"
    restart_backoff_s: float = Field(
        default=1.0,
        ge=0.0,
        le=3600.0,
        description="first restart delay of a crashed role (s), doubled per crash",
    )
    restart_backoff_max_s: float = Field(
        default=30.0, ge=0.0, le=3600.0, description="longest restart delay (s)"
    )
    max_restarts: int = Field(
        default=5,
        ge=0,
        le=1000,
        description="restarts of one role within restart_window_s; then kvpool up stops",
    )
    restart_window_s: float = Field(
        default=60.0, gt=0.0, description="window that counts a role's crashes (s)"
    )
    masters: int = Field(
        default=1,
        ge=1,
        le=7,
        description="masters; > 1: high availability on an embedded single-node etcd (docs/ha.md)",
    )
    tls: bool = Field(
        default=True,
        description="gRPC TLS between every role: a fresh CA and certificate (kvpool.cluster.tls); "
        "false = plaintext gRPC (debugging)",
    )

    @model_validator(mode="after")
    def _backoff(self) -> ClusterSection:
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_s")
        return self


class MasterSection(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=50051, ge=0, le=65535)
    replicas: int = Field(default=1, ge=1, le=16)
    eviction_policy: str = DEFAULT_POLICY
    high_watermark: float = Field(default=0.9, gt=0.0, le=1.0)
    low_watermark: float = Field(default=0.8, gt=0.0, le=1.0)
    heartbeat_timeout_ms: int = Field(default=10_000, gt=0)
    max_index_bytes: ByteSize | None = Field(
        default=None,
        description="each master's index memory limit (8GiB, 1.5GB or bytes; unset: half the host's memory)",
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus /metrics port (0: ephemeral)"
    )
    etcd_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="[cluster] masters > 1: the embedded etcd's client port on 127.0.0.1 (0: a free one)",
    )

    @field_validator("eviction_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in _EVICTION:
            raise ValueError(f"must be one of {', '.join(_EVICTION)}, got {v!r}")
        return v

    @model_validator(mode="after")
    def _marks(self) -> MasterSection:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must be <= high_watermark")
        return self


class RoleSection(_Section):
    count: int = Field(default=1, ge=0, le=256)
    hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1"], min_length=1)
    port: int = Field(
        default=0, ge=0, le=65535, description="first port; instance i uses port + i (0: ephemeral)"
    )
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="first /metrics port; instance i uses + i (0: ephemeral)"
    )


class ServingSection(RoleSection):
    """A prefill or decode role: kvpool's own node, or a vLLM OpenAI server with kvpool's connector."""

    engine: Literal["kvpool", "vllm"] = "kvpool"
    python: str = Field(
        default="",
        description="engine = vllm: the Python that has vllm ('' = .venv-vllm/bin/python when it exists)",
    )
    engine_args: list[str] = Field(
        default_factory=list, description="engine = vllm: more arguments of vLLM's api_server"
    )
    kv_cache_gib: float = Field(
        default=1.0, gt=0, description="engine = vllm: its CPU KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)"
    )
    connector: dict[str, Any] = Field(
        default_factory=dict,
        description="engine = vllm: more kv_connector_extra_config keys (docs/vllm.md), e.g. match_wait_s",
    )

    @field_validator("connector")
    @classmethod
    def _connector(cls, v: dict[str, Any]) -> dict[str, Any]:
        from kvpool.vllm.settings import ConnectorSettings

        set_here = {"master", "role", "url", "node_id"} & set(v)
        if set_here:
            raise ValueError(f"{', '.join(sorted(set_here))}: set by kvpool up")
        unknown = set(v) - set(ConnectorSettings.model_fields)
        if unknown:
            raise ValueError(f"unknown connector keys: {', '.join(sorted(unknown))}")
        return v

    @model_validator(mode="after")
    def _vllm_port(self) -> ServingSection:
        if self.engine == "vllm" and self.port == 0 and any(not is_local(h) for h in self.hosts):
            raise ValueError("a vLLM engine on another host needs a fixed port (its URL is registered)")
        return self


class StoreSection(RoleSection):
    count: int = Field(default=2, ge=1, le=256)
    segment_size: str = "256MiB"

    @field_validator("segment_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if parse_size(v) is None:
            raise ValueError(f"must be a size like 256MiB or 4GiB, got {v!r}")
        return v


class RouterSection(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: str = "cost"
    tenants: str = ""

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in _POLICIES:
            raise ValueError(f"must be one of {', '.join(_POLICIES)}, got {v!r}")
        return v


class ClusterSpec(_Section):
    cluster: ClusterSection = Field(default_factory=ClusterSection)
    master: MasterSection = Field(default_factory=MasterSection)
    store: StoreSection = Field(default_factory=StoreSection)
    prefill: ServingSection = Field(default_factory=ServingSection)
    decode: ServingSection = Field(default_factory=ServingSection)
    router: RouterSection = Field(default_factory=RouterSection)

    @model_validator(mode="after")
    def _multi_host(self) -> ClusterSpec:
        hosts = {h for s in (self.store, self.prefill, self.decode) for h in s.hosts} | {self.router.host}
        if self.master.port == 0 and any(not is_local(h) for h in hosts):
            raise ValueError("master.port must be fixed (not 0) when roles run on other hosts")
        for where, listen in (
            ("master.host", [self.master.host]),
            ("store.hosts", self.store.hosts),
            ("prefill.hosts", self.prefill.hosts),
            ("decode.hosts", self.decode.hosts),
        ):
            if any(h.strip("[]") in WILDCARD_HOSTS for h in listen):
                raise ValueError(
                    f"{where}: a wildcard address listens on every interface; give the cluster "
                    "interface's address (masters, stores, serving nodes and engines bind to it)"
                )
        if self.prefill.count < 1 or self.decode.count < 1:
            raise ValueError("a cluster needs at least one prefill and one decode node")
        if self.master.port and self.master.port + self.cluster.masters - 1 > 65535:
            raise ValueError(
                "master.port + cluster.masters - 1 must be <= 65535 (master i listens on port + i)"
            )
        if self.cluster.masters > 1 and not is_local(self.master.host):
            raise ValueError(
                "cluster.masters > 1: the masters and their embedded etcd run on this host "
                "(master.host must be local)"
            )
        if self.router.enabled and self.prefill.engine != self.decode.engine:
            raise ValueError(
                "the router routes prefill and decode to one kind of engine: set prefill.engine and "
                "decode.engine alike, or [router] enabled = false"
            )
        return self


def parse_size(text: str) -> int | None:
    m = _SIZE.match(text)
    if m is None:
        return None
    unit = m.group(2) or "B"
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KiB": 2**10, "MiB": 2**20,
            "GiB": 2**30, "TiB": 2**40}[unit]  # fmt: skip
    return int(float(m.group(1)) * mult)


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS or host in (socket.gethostname(), socket.getfqdn())


def _line_of(text: str, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of `[section]` / `key =` named by a validation error location (best effort)."""
    lines = text.splitlines()
    section = str(loc[0]) if loc else ""
    key = str(loc[1]) if len(loc) > 1 else None
    start = next((i for i, ln in enumerate(lines) if ln.strip() == f"[{section}]"), None)
    if start is None:  # a top-level key (a stray one, or a section written as `name = value`)
        first = next((i for i, ln in enumerate(lines) if ln.strip().startswith("[")), len(lines))
        at = (i for i in range(first) if re.match(rf"^\s*{re.escape(section)}\s*=", lines[i]))
        found = next(at, None)
        return None if found is None else found + 1
    if key is None:
        return start + 1
    for i in range(start + 1, len(lines)):
        s = lines[i].strip()
        if s.startswith("["):
            break
        if re.match(rf"^{re.escape(key)}\s*=", s):
            return i + 1
    return start + 1


def text_line_of_byte(data: bytes, offset: int) -> int:
    """The 1-based line holding byte `offset` of `data`."""
    return data.count(b"\n", 0, offset) + 1


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster spec; `InvalidArgument("FILE:LINE: FIELD: message")` on any error."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{p}: cannot read cluster spec: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        at = text_line_of_byte(p.read_bytes(), exc.start)
        raise InvalidArgument(f"{p}:{at}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{p}: invalid TOML: {exc}") from None
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        msgs = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            where = ".".join(str(x) for x in loc) or "(top level)"
            line = _line_of(text, loc)
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"{p}:{line}: {where}: {msg}" if line else f"{p}: {where}: {msg}")
        raise InvalidArgument("\n".join(msgs)) from None
