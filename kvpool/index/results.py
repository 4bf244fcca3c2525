"""Value types returned by `RadixIndex` (slotted; frozen but for `MatchResult`, whose `locations` are
built lazily from its replica columns; lists and arrays are the caller's to keep)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.types import BlockHash, Location, NamespaceId

DROP_REASONS = ("evict", "orphan", "invalidate", "replica")
"""Why a block (or one replica of it) left the index: policy eviction; no replica left (or an ancestor
was dropped); namespace reclamation; one replica freed by a per-node eviction while the block stays."""


_NO_ROWS = np.empty(0, np.int64)


class MatchResult:
    """The longest run of leading blocks present under a namespace.

    Replicas come as columns, one entry per matched block for its first replica: `replica_node` (index
    into `node_ids`), `replica_slot`, `replica_generation`, `replica_local` (numpy arrays over a snapshot
    of the matched rows taken by the match, the caller's to keep); `extra[i]` holds block i's further replicas, in order, when it has more than one.
    `locations[i]` are all replicas of block i as `Location`s (built on first access, then cached;
    `len(locations) == num_matched`). `lease_id` is set when a lease was taken (`lease_ttl_ms > 0` and
    `num_matched > 0`); `lease_expiry_ms` is its expiry on the index clock (0 without a lease).
    `node_ids` is the index's append-only node table (read it, do not change it).
    """

    __slots__ = ("_locations", "_records", "extra", "lease_expiry_ms", "lease_id", "node_ids", "num_matched")

    def __init__(
        self,
        num_matched: int = 0,
        lease_id: int | None = None,
        lease_expiry_ms: int = 0,
        *,
        node_ids: Sequence[str] = (),
        records: np.ndarray | None = None,
        extra: dict[int, tuple[Location, ...]] | None = None,
    ) -> None:
        self.num_matched = num_matched
        self.lease_id = lease_id
        self.lease_expiry_ms = lease_expiry_ms
        self.node_ids = node_ids
        self._records = records
        self.extra = extra or {}
        self._locations: list[tuple[Location, ...]] | None = None

    def _field(self, name: str) -> np.ndarray:
        return _NO_ROWS if self._records is None else self._records[name]

    @property
    def replica_node(self) -> np.ndarray:
        return self._field("rep_node")

    @property
    def replica_slot(self) -> np.ndarray:
        return self._field("rep_slot")

    @property
    def replica_generation(self) -> np.ndarray:
        return self._field("rep_gen")

    @property
    def replica_local(self) -> np.ndarray:
        return self._field("rep_local")

    @property
    def locations(self) -> list[tuple[Location, ...]]:
        if self._locations is None:
            names, extra = self.node_ids, self.extra
            firsts = [
                Location(names[k], s, g, loc)
                for k, s, g, loc in zip(
                    self.replica_node.tolist(),
                    self.replica_slot.tolist(),
                    self.replica_generation.tolist(),
                    self.replica_local.tolist(),
                    strict=True,
                )
            ]
            self._locations = [
                (first, *extra[i]) if i in extra else (first,) for i, first in enumerate(firsts)
            ]
        return self._locations

    def node_names(self) -> list[str]:
        """The distinct store node ids named by the replicas (first seen first)."""
        names = [self.node_ids[k] for k in dict.fromkeys(self.replica_node.tolist())]
        for locs in self.extra.values():
            names.extend(x.node_id for x in locs)
        return list(dict.fromkeys(names))

    def __repr__(self) -> str:
        return (
            f"MatchResult(num_matched={self.num_matched}, locations={self.locations!r}, "
            f"lease_id={self.lease_id}, lease_expiry_ms={self.lease_expiry_ms})"
        )


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


@dataclass(frozen=True, slots=True)
class BulkInsertResult:
    """What `RadixIndex.insert_bulk` did with each of its n blocks: four (n,) bool arrays, exactly one
    True per block. `inserted`: a new row. `merged`: already present under the same parent, this
    location added as a replica (or already there). `waiting`: its parent is neither in the index nor
    inserted by this batch (the caller keeps it for a later batch). `refused`: present under another
    parent, or a repeat of an earlier block of the batch."""

    inserted: np.ndarray
    merged: np.ndarray
    waiting: np.ndarray
    refused: np.ndarray
