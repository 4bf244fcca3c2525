"""Value types returned by `RadixIndex` (frozen, slotted; lists are the caller's to keep)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.types import BlockHash, Location, NamespaceId

DROP_REASONS = ("evict", "orphan", "invalidate", "replica")
"""Why a block (or one replica of it) left the index: policy eviction; no replica left (or an ancestor
was dropped); namespace reclamation; one replica freed by a per-node eviction while the block stays."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest run of leading blocks present under a namespace.

    `locations[i]` are the replicas of block i (`len(locations) == num_matched`). `lease_id` is set when a
    lease was taken (`lease_ttl_ms > 0` and `num_matched > 0`); `lease_expiry_ms` is its expiry on the
    index clock (0 without a lease).
    """

    num_matched: int
    locations: list[tuple[Location, ...]]
    lease_id: int | None
    lease_expiry_ms: int


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`num_existing` leading blocks were already present; `num_inserted` new blocks follow them."""

    num_existing: int
    num_inserted: int


@dataclass(frozen=True, slots=True)
class DroppedBlock:
    """A block that left the index (or, for reason "replica", one replica that left a kept block).

    `locations` are the slots the caller (the master) must now order freed.
    """

    ns: NamespaceId
    block_hash: BlockHash
    locations: tuple[Location, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class EvictResult:
    """`dropped`: what left, with the slots to free. `num_freed_on_node`: slots freed on the node asked
    for (without a node: the number of blocks evicted). `shortfall`: how many of the requested blocks or
    slots could not be freed (everything left is leased, locked, or interior)."""

    dropped: list[DroppedBlock]
    num_freed_on_node: int
    shortfall: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockInfo:
    """A snapshot of one resident block (`parent=None`: the block hangs from the namespace root)."""

    ns: NamespaceId
    block_hash: BlockHash
    parent: BlockHash | None
    locations: tuple[Location, ...]
    size_bytes: int
    recompute_cost_s: float
    hit_count: int
    last_access_ms: int
    num_leases: int
    lock_ref: int
    num_children: int
