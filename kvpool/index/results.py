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


@dataclass(frozen=True, slots=True, kw_only=True)
class DroppedRows:
    """Blocks that left the index together, as columns (n blocks): what a node removal's step returns.

    `ns_slot` ((n,) int32) indexes `ns_ids` (the namespace of each slot when they were dropped);
    `hashes` ((n, 2) uint64) are the block hashes as two little-endian halves; the first replica of each
    block is (`rep_node` ((n,) int32, index into `node_ids`, -1: none), `rep_slot` ((n,) int64),
    `rep_gen` ((n,) uint64), `rep_local` ((n,) bool)) and `extra[i]` holds block i's further replicas, in
    order (rare). Replicas on a dying node are included: the caller sends no free order to a dead node.
    No Python object is built per block (`blocks()` builds `DroppedBlock`s on demand, for tests and
    small callers)."""

    ns_ids: tuple[NamespaceId, ...]
    ns_slot: np.ndarray
    hashes: np.ndarray
    node_ids: Sequence[str]
    rep_node: np.ndarray
    rep_slot: np.ndarray
    rep_gen: np.ndarray
    rep_local: np.ndarray
    extra: dict[int, tuple[Location, ...]]
    reason: str

    def __len__(self) -> int:
        return len(self.ns_slot)

    def store_frees(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(node id, slots (m,) int64, generations (m,) uint64) of every non-local replica, by node."""
        out: list[tuple[str, np.ndarray, np.ndarray]] = []
        has = (self.rep_node >= 0) & ~self.rep_local
        nodes = self.rep_node[has]
        slots, gens = self.rep_slot[has], self.rep_gen[has]
        order = np.argsort(nodes, kind="stable")
        nodes, slots, gens = nodes[order], slots[order], gens[order]
        cuts = np.flatnonzero(np.diff(nodes)) + 1
        for part_n, part_s, part_g in zip(
            np.split(nodes, cuts), np.split(slots, cuts), np.split(gens, cuts), strict=True
        ):
            if part_n.size:
                out.append((self.node_ids[int(part_n[0])], part_s, part_g))
        for locs in self.extra.values():
            for x in locs:
                if not x.local:
                    out.append((x.node_id, np.array([x.slot], np.int64), np.array([x.generation], np.uint64)))
        return out

    def blocks(self) -> list[DroppedBlock]:
        """One `DroppedBlock` per block (O(n) Python objects: for tests and small drops)."""
        raw = self.hashes.astype("<u8").tobytes()
        out = []
        for i in range(len(self)):
            k = int(self.rep_node[i])
            first = (
                (
                    Location(
                        self.node_ids[k], int(self.rep_slot[i]), int(self.rep_gen[i]), bool(self.rep_local[i])
                    ),
                )
                if k >= 0
                else ()
            )
            locs = (*first, *self.extra.get(i, ()))
            out.append(
                DroppedBlock(
                    self.ns_ids[int(self.ns_slot[i])], BlockHash(raw[16 * i : 16 * i + 16]), locs, self.reason
                )
            )
        return out


@dataclass(frozen=True, slots=True)
class Survivors:
    """Blocks that lost a replica on a dying node but keep another (to re-replicate), as columns:
    `ns_slot` ((n,) int32) indexing `ns_ids`, `hashes` ((n, 2) uint64)."""

    ns_ids: tuple[NamespaceId, ...]
    ns_slot: np.ndarray
    hashes: np.ndarray

    def __len__(self) -> int:
        return len(self.ns_slot)

    def keys(self) -> list[tuple[bytes, bytes]]:
        """(namespace, block hash) per block (O(n) tuples: take a bounded slice first)."""
        raw = self.hashes.astype("<u8").tobytes()
        return [
            (bytes(self.ns_ids[int(s)]), raw[16 * i : 16 * i + 16])
            for i, s in enumerate(self.ns_slot.tolist())
        ]

    def __getitem__(self, sel: slice) -> Survivors:
        return Survivors(self.ns_ids, self.ns_slot[sel], self.hashes[sel])


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
