"""The replica half of `Columns` (`ReplicaColumnsMixin`): each row's first replica in columns
(`rep_node`, `rep_slot`, `rep_gen`, `rep_local`), the rare further ones in the `extra` dict, and the
append-only table of node ids the `rep_node` column indexes."""

from __future__ import annotations

import numpy as np

from kvpool.types import Location


class ReplicaColumnsMixin:
    """Needs the columns and `extra`, `node_ids`, `_node_index`, `_next_row` of `Columns`."""

    rep_node: np.ndarray
    rep_slot: np.ndarray
    rep_gen: np.ndarray
    rep_local: np.ndarray
    has_extra: np.ndarray
    extra: dict[int, tuple[Location, ...]]
    node_ids: list[str]
    _node_index: dict[str, int]
    _next_row: int

    # ---- replicas ---------------------------------------------------------------------------------
    def node_index(self, node_id: str) -> int:
        k = self._node_index.get(node_id)
        if k is None:
            k = self._node_index[node_id] = len(self.node_ids)
            self.node_ids.append(node_id)
        return k

    def replicas(self, row: int) -> tuple[Location, ...]:
        k = int(self.rep_node[row])
        if k < 0:
            return ()
        first = Location(
            self.node_ids[k], int(self.rep_slot[row]), int(self.rep_gen[row]), bool(self.rep_local[row])
        )
        return (first, *self.extra[row]) if self.has_extra[row] else (first,)

    def add_replica(self, row: int, loc: Location) -> bool:
        """Append `loc` to the row's replicas; False (nothing changes) when it is already there."""
        current = self.replicas(row)
        if loc in current:
            return False
        if not current:
            self.rep_node[row] = self.node_index(loc.node_id)
            self.rep_slot[row] = loc.slot
            self.rep_gen[row] = loc.generation
            self.rep_local[row] = loc.local
        else:
            self.extra[row] = (*current[1:], loc)
            self.has_extra[row] = True
        return True

    def set_replicas(self, row: int, locs: tuple[Location, ...]) -> None:
        self.extra.pop(row, None)
        self.has_extra[row] = len(locs) > 1
        if not locs:
            self.rep_node[row] = -1
            return
        first = locs[0]
        self.rep_node[row] = self.node_index(first.node_id)
        self.rep_slot[row] = first.slot
        self.rep_gen[row] = first.generation
        self.rep_local[row] = first.local
        if len(locs) > 1:
            self.extra[row] = locs[1:]

    def rows_with_node(self, node_id: str) -> set[int]:
        """Rows with at least one replica on `node_id` (a scan: for node failures and accounting)."""
        return set(self.rows_on_node(node_id).tolist())

    def rows_on_node(self, node_id: str, *, multi_replica_only: bool = False) -> np.ndarray:
        """Sorted rows ((m,) int64) with at least one replica on `node_id`; with `multi_replica_only`,
        only rows with more than one replica. One vectorised pass over the first-replica column plus
        the rows with extra replicas."""
        k = self._node_index.get(node_id)
        n = self._next_row
        found = np.empty(0, np.int64)
        if k is not None:
            mask = self.rep_node[:n] == k
            if multi_replica_only:
                mask &= self.has_extra[:n]
            found = np.flatnonzero(mask)
        more = [r for r, locs in self.extra.items() if any(x.node_id == node_id for x in locs)]
        if more:
            found = np.union1d(found, np.array(more, dtype=np.int64))
        return found
