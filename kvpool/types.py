"""Value types shared by every role: block hashes, namespaces, KV layout, locations, clocks, and the nodes of a
pool (`NodeInfo`, `NodeLoad`, `NodeStatus`) and a prefix match (`Match`).

This module imports nothing from the project at run time (`kvpool.hashing.EngineNamespace` only in annotations);
`kvpool.index` depends on it alone.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType, Protocol

if TYPE_CHECKING:
    import numpy as np

    from kvpool.hashing import EngineNamespace

HASH_NBYTES = 16
"""Length in bytes of a block hash and of a namespace digest (128 bits)."""

BlockHash = NewType("BlockHash", bytes)
"""A 16-byte chained block hash (see `kvpool.hashing`)."""

NamespaceId = NewType("NamespaceId", bytes)
"""The 16-byte digest of a `kvpool.hashing.Namespace`: the root of every hash chain."""

_DTYPE_NBYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


DEFAULT_LAYOUT = "kv1:float32:b64:l4:h4:d32"
"""The KV layout of the embedded model at its default block size (64): the default of `kvpool master` and
`kvpool store`, so a cluster started with defaults serves the default prefill/decode nodes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """The layout of one KV block: `[num_layers, 2 (K,V), num_kv_heads, block_size, head_dim]`.

    `dtype` is a torch dtype name without the `torch.` prefix (e.g. "float32", "bfloat16").
    Raises `ValueError` on a non-positive dimension or an unknown dtype.
    """

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NBYTES:
            raise ValueError(f"unknown KV dtype {self.dtype!r}; expected one of {sorted(_DTYPE_NBYTES)}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @property
    def dtype_nbytes(self) -> int:
        return _DTYPE_NBYTES[self.dtype]

    @property
    def token_nbytes(self) -> int:
        """Bytes of KV per token over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: `token_nbytes * block_size`."""
        return self.token_nbytes * self.block_size

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def fingerprint(self) -> str:
        """A canonical text form, equal on every node for equal layouts (part of the namespace)."""
        return f"kv1:{self.dtype}:b{self.block_size}:l{self.num_layers}:h{self.num_kv_heads}:d{self.head_dim}"

    @classmethod
    def from_fingerprint(cls, text: str) -> KVLayout:
        """Inverse of `fingerprint()`; raises `ValueError` on malformed text."""
        parts = text.split(":")
        if len(parts) != 6 or parts[0] != "kv1":
            raise ValueError(f"malformed KV layout fingerprint {text!r}")
        try:
            return cls(
                dtype=parts[1],
                block_size=int(parts[2].removeprefix("b")),
                num_layers=int(parts[3].removeprefix("l")),
                num_kv_heads=int(parts[4].removeprefix("h")),
                head_dim=int(parts[5].removeprefix("d")),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV layout fingerprint {text!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Location:
    """One replica of a block: a slot on a store node, valid for one slot generation.

    `local=True` marks a node-local tier copy (visible to the router's peek, never readable by others).
    `capability` is the master's opaque grant to read (match) or write (reserve) this replica until
    `capability_expiry_ms` (b"" when none); it is not part of the location's identity (equality, hash).
    """

    node_id: str
    slot: int
    generation: int
    local: bool = False
    capability: bytes = field(default=b"", compare=False, repr=False)
    capability_expiry_ms: int = field(default=0, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class InventoryItem:
    """One committed block a store node holds (what a restarted master rebuilds its index from).

    `parent_hash` is b"" for the first block of a chain; `checksum` is xxh3_64 of the block's bytes.
    """

    namespace: bytes
    block_hash: bytes
    parent_hash: bytes
    slot: int
    generation: int
    checksum: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class InventoryBatch:
    """Committed blocks of one store node, as columns (one entry per block, `n` entries): what a master adopts
    from a store's `Inventory` stream, one batch per message.

    `namespaces`: the distinct namespace digests (16 bytes each) of this batch; `ns_index` (n,) int32 indexes
    into it. `block_hashes` and `parent_hashes`: (n, 16) uint8, one hash per row; `has_parent` (n,) bool is
    False for the first block of a chain (its `parent_hashes` row is zeros). `slots`, `generations` (n,)
    uint64; `checksums` (n,) uint64 (xxh3_64 of the block's bytes); `size_bytes` (n,) uint64.
    `next_slot`: the resume cursor, the first slot after this batch (ask again from it after a broken
    stream); -1 when the inventory is complete. `medium` (n,) uint8: `MEDIUM_MEMORY` or `MEDIUM_DISK` per
    block (a store with a disk tier lists its disk blocks after its memory ones); None: all in memory.
    """

    namespaces: list[bytes]
    ns_index: np.ndarray
    block_hashes: np.ndarray
    parent_hashes: np.ndarray
    has_parent: np.ndarray
    slots: np.ndarray
    generations: np.ndarray
    checksums: np.ndarray
    size_bytes: np.ndarray
    next_slot: int
    medium: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def in_memory(self) -> np.ndarray:
        """(n,) bool: the blocks held in the store's memory (not on its disk tier)."""
        import numpy as np  # noqa: PLC0415 - this module imports no numpy at run time

        if self.medium is None:
            return np.ones(len(self.slots), dtype=np.bool_)
        return self.medium == MEDIUM_MEMORY


@dataclass(frozen=True, slots=True)
class DiskTierReport:
    """A store's disk tier as it reports it (`GetInfo`, each heartbeat; proto `DiskTierInfo`): slot numbers
    `first_slot` .. `first_slot + num_slots - 1`; blocks of `block_nbytes`; `num_used_slots` committed blocks,
    `num_reserved_slots` reserved or being moved into; `first_generation`, every slot's generation when this
    boot began (a free slot may be reserved at it or above); the measured read cost `alpha_s` (seconds per
    call) and `beta_s_per_byte` (NaN: not measured); `degraded` "" or why writes are refused; `direct`: the
    page cache is bypassed; `recovered_blocks`: verified blocks found at start-up."""

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


MEDIUM_MEMORY = 0
"""A replica in a store's memory segment."""
MEDIUM_DISK = 1
"""A replica on a store's disk tier (slot numbers from the tier's first slot, 2**31, on)."""


def with_medium(b: InventoryBatch, medium: int) -> InventoryBatch:
    """`b` with every block on `medium`."""
    import numpy as np  # noqa: PLC0415 - this module imports no numpy at run time

    return dataclasses.replace(b, medium=np.full(len(b), medium, dtype=np.uint8))


@dataclass(frozen=True, slots=True)
class SlotOrder:
    """One slot the master reserves on a store node for a block: the slot and its generation, and the block
    (namespace, hash, parent hash: b"" for the first block of a chain) it will hold."""

    slot: int
    generation: int
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes


class Clock(Protocol):
    """Injected time source (milliseconds, monotonic)."""

    def now_ms(self) -> int: ...


class MonotonicClock:
    """Wall-independent monotonic clock in integer milliseconds."""

    def now_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000


class FakeClock:
    """A clock that moves only when told to (tests, trace replay)."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now_ms = start_ms

    def now_ms(self) -> int:
        return self._now_ms

    def advance(self, delta_ms: int) -> None:
        if delta_ms < 0:
            raise ValueError("a clock never goes back")
        self._now_ms += delta_ms

    def set(self, now_ms: int) -> None:
        if now_ms < self._now_ms:
            raise ValueError("a clock never goes back")
        self._now_ms = now_ms


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
class NodeStatus:
    node: NodeInfo
    alive: bool
    draining: bool
    num_slots: int
    num_used_slots: int
    num_blocks: int
    used_bytes: int
    load: NodeLoad
    dataplane_state: str = (
        ""  # a store's data plane: ok | suspect | failed | probe | trial (kvpool.master.dataplane)
    )
    num_dataplane_failures: int = 0
    silent_s: float = 0.0  # since the master last heard from it (heartbeat or registration), seconds


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
