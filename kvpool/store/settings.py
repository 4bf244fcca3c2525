"""Store node settings (defaults < TOML < `KVPOOL_*` env < CLI flags)."""

from __future__ import annotations

import re

import psutil
from pydantic import Field, field_validator, model_validator

from kvpool.config import KVPoolSettings, check_host_port
from kvpool.types import DEFAULT_LAYOUT, KVLayout

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000**4, "tb": 1000**4}


def parse_size(text: str | int) -> int:
    """Bytes from `4GiB`, `256MiB`, `1.5GB`, `4096` (binary units with `i`, decimal without)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"malformed size {text!r} (e.g. 256MiB, 4GiB, 1048576)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


class StoreSettings(KVPoolSettings):
    """Everything `kvpool store` can be told. Times in ms unless named `_s`."""

    node_id: str = ""  # empty: store-<host>-<pid>
    master: str = ""  # HOST:PORT of the master (HOST:PORT,HOST:PORT... for masters in HA); empty: standalone
    grpc_port: int = Field(default=0, ge=0, le=65535)  # 0 = ephemeral
    data_port: int = Field(default=0, ge=0, le=65535)  # 0 = ephemeral
    advertise_host: str = ""  # the host put in grpc/data addresses; empty: bind_host
    segment_size: str = "256MiB"
    layout: str = DEFAULT_LAYOUT
    pin_memory: str = "auto"  # auto (when CUDA is present) | on | off
    share_segment: bool = True  # same-host readers map the segment read-only (transfer.shared_segment)
    heartbeat_interval_ms: int = 1000  # until the master says otherwise
    reap_interval_ms: int = 100  # how often expired write leases are reclaimed
    max_batch_slots: int = 8192  # per control RPC
    endpoints_per_peer: int = 2
    transfer_timeout_s: float = 30.0
    max_workers: int = 16
    max_concurrent_rpcs: int = 256  # more in flight are refused with RESOURCE_EXHAUSTED (bounded queue)
    metrics: bool = True  # serve Prometheus /metrics (kvpool.metrics)
    metrics_port: int = Field(default=0, ge=0, le=65535)  # on bind_host; 0 = ephemeral
    disk_path: str = ""  # a directory for the disk tier (kvpool.store.disk_tier); empty: no disk tier
    disk_size: str = ""  # bytes of the disk tier, e.g. 64GiB (required with disk_path)
    metadata_only: bool = False  # benchmarks only: commits need no bytes, every read and write is refused
    disk_buffer_size: str = "256MiB"  # bounce buffers of disk reads and writes in flight (more: refused)
    disk_move_queue_blocks: int = Field(default=8192, ge=1)  # tier moves queued (more: refused)

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        for address in value.split(",") if value else ():  # several: masters in HA (kvpool.master.ha)
            check_host_port(address.strip())
        return value

    @field_validator("layout")
    @classmethod
    def _layout(cls, value: str) -> str:
        KVLayout.from_fingerprint(value)
        return value

    @field_validator("segment_size")
    @classmethod
    def _size(cls, value: str) -> str:
        nbytes = parse_size(value)
        total = psutil.virtual_memory().total
        if nbytes > total:  # the master would place blocks in it until the host runs out of memory
            raise ValueError(f"segment_size {value} is more than this host's memory ({total >> 20} MiB)")
        return value

    @field_validator("disk_size", "disk_buffer_size")
    @classmethod
    def _disk_size(cls, value: str) -> str:
        if value:
            parse_size(value)
        return value

    @model_validator(mode="after")
    def _disk(self) -> StoreSettings:
        if self.disk_path and not self.disk_size:
            raise ValueError("--disk-path needs --disk-size (e.g. --disk-size 64GiB)")
        if self.metadata_only and self.disk_path:
            raise ValueError("--metadata-only holds no bytes: it takes no --disk-path")
        return self

    @field_validator("pin_memory")
    @classmethod
    def _pin(cls, value: str) -> str:
        if value not in ("auto", "on", "off"):
            raise ValueError("pin_memory is auto, on or off")
        return value

    @property
    def segment_bytes(self) -> int:
        return parse_size(self.segment_size)

    @property
    def disk_buffer_bytes(self) -> int:
        return parse_size(self.disk_buffer_size)

    @property
    def disk_bytes(self) -> int:
        """Bytes of the disk tier (0: none)."""
        return parse_size(self.disk_size) if self.disk_path else 0

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout.from_fingerprint(self.layout)
