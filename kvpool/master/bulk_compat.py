"""Bulk insertion of a store's inventory blocks into the master's index, and the master's per-block
bookkeeping beside it (`MasterState.meta`, `node_blocks`, `under_replicated`).

TO SWITCH: once `RadixIndex.insert_bulk` / `set_block_meta` / `keys_on_node` are on main, the index keeps the
block metadata and answers which blocks a node holds; this module then calls `index.insert_bulk` only.
Until then it inserts block by block with `RadixIndex.insert` (same outcome per block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import InvalidArgument, NotFound
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master


@dataclass(frozen=True, slots=True)
class BulkInsertResult:
    """Per block exactly one of: inserted (a new row), merged (present under the same parent: a replica
    added), waiting (its parent is not indexed), refused (present under another parent, or a repeat)."""

    inserted: np.ndarray
    merged: np.ndarray
    waiting: np.ndarray
    refused: np.ndarray


def insert_bulk(
    m: Master,
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
    """Under the master's lock: insert n blocks held by `node_id` (columns as in `kvpool.types.InventoryBatch`)
    parent-first. Raises `InvalidArgument` for a namespace that is not active."""
    from kvpool.master.core import BlockMeta

    n = len(slots)
    hashes = [BlockHash(x) for x in _rows(block_hashes)]
    parents = [
        BlockHash(p) if hp else None for p, hp in zip(_rows(parent_hashes), has_parent.tolist(), strict=True)
    ]
    locs = [Location(node_id, s, g) for s, g in zip(slots.tolist(), generations.tolist(), strict=True)]
    state = np.zeros(n, dtype=np.int8)  # 0 waiting, 1 inserted, 2 merged, 3 refused
    seen: set[bytes] = set()
    for i, h in enumerate(hashes):
        if h in seen:
            state[i] = 3
        seen.add(h)
    progress = True
    while progress:
        progress = False
        for i in np.flatnonzero(state == 0).tolist():
            try:
                r = m.index.insert(
                    ns, [hashes[i]], parent=parents[i], locations=[[locs[i]]], size_bytes=size_bytes
                )
            except NotFound:
                continue
            except InvalidArgument:
                if not m.namespaces.is_active(bytes(ns)):
                    raise
                state[i] = 3
                continue
            state[i] = 2 if r.num_existing else 1
            progress = True
            key = (bytes(ns), bytes(hashes[i]))
            m.note_replicas(key[0], key[1], [locs[i]])
            m.st.meta.setdefault(key, BlockMeta(int(checksums[i]), target_replicas))
            if state[i] == 1 and target_replicas > 1:
                m.st.under_replicated.add(key)
    return BulkInsertResult(state == 1, state == 2, state == 0, state == 3)


def _rows(a: np.ndarray) -> list[bytes]:
    raw = np.ascontiguousarray(a, dtype=np.uint8).tobytes()
    w = a.shape[1] if a.ndim == 2 else 16
    return [raw[i : i + w] for i in range(0, len(raw), w)]
