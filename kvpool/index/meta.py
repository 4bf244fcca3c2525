"""Block metadata, per-node keys, bulk insert and memory accounting of `RadixIndex` (`BlockMetaMixin`).

The master keeps per block a checksum and a replica target; they live in the index's columns
(`checksum` uint64, `target_replicas` uint8, 0 while never set), so no per-block Python object holds
them. `keys_on_node` answers which blocks a store holds from the replica columns (no per-store set).
`insert_bulk` (in `bulk_insert.py`) adopts a store's inventory in columns. `memory_bytes` is the index's
own account of its resident memory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound
from kvpool.index import validate as v
from kvpool.index.results import BulkInsertResult
from kvpool.types import BlockHash, NamespaceId

if TYPE_CHECKING:
    from kvpool.index.columns import Columns
    from kvpool.index.hashtable import HashTable
    from kvpool.index.node_removal import NodeRemoval

_MAX_TARGET = 255
_ENTRY_BYTES = 200
"""Bytes charged per Python-held entry (a heap tuple with its key, or an extra replica tuple)."""


class BlockMetaMixin:
    """The metadata half of `RadixIndex` (which provides the columns, table and namespace slots)."""

    _c: Columns
    _table: HashTable
    _ns_active: dict[NamespaceId, int]
    _ns_ids: list[NamespaceId]
    _heap: list[tuple[float, int, int, int]]
    node_removals: list[NodeRemoval]

    def present_many(self, ns: NamespaceId, block_hashes: Sequence[bytes]) -> list[bool]:
        """Per block of `block_hashes`: whether `lookup` would find it, in one batch probe of the table
        (a publish asks this of every block it reserves and commits)."""
        slot = self._ns_active.get(ns)
        if slot is None or not block_hashes:
            return [False] * len(block_hashes)
        if any(not isinstance(h, bytes) or len(h) != 16 for h in block_hashes) or self.node_removals:
            lookup = self.lookup  # type: ignore[attr-defined]
            return [lookup(ns, BlockHash(h)) is not None for h in block_hashes]
        rows = self._table.find_many(slot, np.frombuffer(b"".join(block_hashes), "<u8").reshape(-1, 2))
        return (rows >= 0).tolist()  # type: ignore[no-any-return]

    def set_block_meta(
        self,
        ns: NamespaceId,
        block_hashes: Sequence[BlockHash],
        checksums: Sequence[int],
        target_replicas: int,
        *,
        only_unset: bool = True,
    ) -> None:
        """Record each block's `checksums[i]` (an int in [0, 2**64)) and the namespace's
        `target_replicas` (an int in [1, 255]) for the resident `block_hashes` (16 bytes each) of the
        active `ns`. With `only_unset` (default), blocks whose metadata was already set keep it.

        Raises (before changing anything) `InvalidArgument` for mismatched lengths, a hash that is not
        16 bytes, a checksum or target out of range, or an unknown namespace; `NotFound` when a block is
        not resident."""
        if len(block_hashes) != len(checksums):
            raise InvalidArgument(f"{len(checksums)} checksums for {len(block_hashes)} blocks")
        if not isinstance(target_replicas, int) or not 1 <= target_replicas <= _MAX_TARGET:
            raise InvalidArgument(
                f"target_replicas must be an int in [1, {_MAX_TARGET}], got {target_replicas!r}"
            )
        hashes = [v.check_hash(h, f"block_hashes[{i}]") for i, h in enumerate(block_hashes)]
        for i, value in enumerate(checksums):
            if not isinstance(value, int | np.integer) or not 0 <= int(value) < 2**64:
                raise InvalidArgument(f"checksums[{i}] must be an int in [0, 2**64), got {value!r}")
        slot = self._ns_active.get(ns)
        if slot is None:
            raise InvalidArgument(f"namespace {bytes(ns).hex()} is not registered (or was invalidated)")
        if not hashes:
            return
        keys = np.frombuffer(b"".join(hashes), "<u8").reshape(-1, 2)
        rows = self._table.find_many(slot, keys)
        missing = np.flatnonzero(rows < 0)
        if missing.size:
            raise NotFound(f"block {hashes[int(missing[0])].hex()} is not in namespace {bytes(ns).hex()}")
        values = np.array([int(x) for x in checksums], dtype=np.uint64)
        c = self._c
        if only_unset:
            unset = c.target_replicas[rows] == 0
            rows, values = rows[unset], values[unset]
        c.checksum[rows] = values
        c.target_replicas[rows] = target_replicas

    def block_meta(self, ns: NamespaceId, block_hash: BlockHash) -> tuple[int, int] | None:
        """(checksum, target_replicas) of a resident block of the active `ns`; None when the block is
        absent (or not a 16-byte hash) or its metadata was never set."""
        slot = self._ns_active.get(ns)
        if slot is None or not isinstance(block_hash, bytes) or len(block_hash) != 16:
            return None
        row = self._table.find(slot, block_hash)
        if row < 0 or self._c.target_replicas[row] == 0:
            return None
        return int(self._c.checksum[row]), int(self._c.target_replicas[row])

    def keys_on_node(
        self, node_id: str, *, multi_replica_only: bool = False, limit: int | None = None
    ) -> list[tuple[NamespaceId, BlockHash]]:
        """(namespace, block hash) of the resident blocks with a replica on `node_id`, in row order
        (blocks of invalidated namespaces awaiting reclamation included: their slots are still held);
        with `multi_replica_only`, only blocks with more than one replica; at most `limit` (a
        non-negative int) of them. One vectorised pass over the first-replica column plus the rare rows
        with extra replicas. Raises `InvalidArgument` on a negative `limit`."""
        if limit is not None:
            v.check_count(limit, "limit")
        c = self._c
        rows = c.rows_on_node(node_id)
        if multi_replica_only:
            rows = rows[c.has_extra[rows]]
        if limit is not None:
            rows = rows[:limit]
        ns_ids = self._ns_ids
        return list(zip([ns_ids[s] for s in c.ns_slot[rows].tolist()], c.hashes_of(rows), strict=True))

    def insert_bulk(
        self,
        ns: NamespaceId,
        block_hashes: np.ndarray,
        parent_hashes: np.ndarray,
        has_parent: np.ndarray,
        node_id: str,
        slots: np.ndarray,
        generations: np.ndarray,
        size_bytes: int,
        checksums: np.ndarray,
        target_replicas: int,
    ) -> BulkInsertResult:
        """Adopt n blocks of one store node in columns; see `bulk_insert.insert_bulk` for the shapes,
        the outcome of each block and the errors. `FailedPrecondition` while a node removal runs
        (`begin_remove_node`): nothing is inserted, the caller retries once it has ended."""
        from kvpool.index.bulk_insert import insert_bulk

        if self.node_removals:  # (a child could land below a block it drops after its closure was taken)
            raise FailedPrecondition("a node removal runs: adopt once it has ended")
        return insert_bulk(
            self,  # type: ignore[arg-type]
            ns,
            block_hashes,
            parent_hashes,
            has_parent,
            node_id,
            slots,
            generations,
            size_bytes,
            checksums,
            target_replicas,
        )

    def grow_step(self, positions: int = 16384) -> bool:
        """Move up to `positions` (and the rest of a probe run) of the hash table's old table into its
        new one, while it is growing (`kvpool.index.hashtable`); True while some are left. O(positions)."""
        return self._table.step(positions)

    def memory_bytes(self) -> int:
        """The index's resident memory in bytes, by its own accounting: the touched rows of the row
        arrays (whole pages), the hash table, the free list, the eviction heap and the extra replicas
        (`_ENTRY_BYTES` per entry), and the node and namespace tables. Within ~10 % of the measured RSS
        growth of a process holding one index of 1 M+ blocks (checked by `tests/test_index_memory.py`)."""
        c = self._c
        heap = sys.getsizeof(self._heap) + _ENTRY_BYTES * len(self._heap)
        extra = sys.getsizeof(c.extra) + _ENTRY_BYTES * sum(len(x) for x in c.extra.values())
        small = 200 * (len(c.node_ids) + len(self._ns_ids))
        return c.memory_bytes() + self._table.nbytes + heap + extra + small
