"""The dying-node half of `RadixIndex` (`NodeRemovalMixin`): marking a node dying, running its removal's
steps (`node_removal.py`), and what every reader and writer checks while one runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import FailedPrecondition
from kvpool.index.results import DroppedBlock, DroppedRows, Survivors
from kvpool.types import Location

if TYPE_CHECKING:
    from kvpool.index.columns import Columns
    from kvpool.index.node_removal import NodeRemoval
    from kvpool.index.space import NodeSpace


class NodeRemovalMixin:
    """Needs `_c`, `_space`, `node_removals`, `_dying`, `_dying_mask`, `_doomed_tag` of `RadixIndex`."""

    _c: Columns
    _space: NodeSpace
    node_removals: list[NodeRemoval]
    _dying: dict[int, NodeRemoval]
    _dying_mask: np.ndarray
    _doomed_tag: np.ndarray

    def remove_node(self, node_id: str) -> list[DroppedBlock]:
        """A node died: forget all its replicas; blocks left without any are dropped with their
        descendants (reason "orphan", with the replicas elsewhere that must be freed). Every step of
        `begin_remove_node` at once (and of the removals queued before it), in one call: for tests and
        small nodes; the master runs the steps with its lock released between them."""
        from kvpool.index.bulk_drop import remove_node

        return remove_node(self, node_id)  # type: ignore[arg-type]

    def begin_remove_node(self, node_id: str) -> NodeRemoval | None:
        """Mark `node_id` dying, O(1): from now on no match or lookup offers a replica there, nor a block
        left without another (nor anything below one), and inserts refuse them (see `node_removal.py`).
        The removal itself runs in `remove_node_step` calls. Returns it (the running one when the node is
        already dying), or None when the index holds nothing on the node."""
        from kvpool.index.node_removal import NodeRemoval

        c = self._c
        k = c._node_index.get(node_id)
        if k is not None and k in self._dying:
            return self._dying[k]
        if not self._space.has(node_id):
            return None
        removal = NodeRemoval(self, node_id)  # type: ignore[arg-type]
        self._space.forget(node_id)  # its slots and bytes: every replica counted there is gone
        self._dying[removal.k] = removal
        self.dying_mask()[removal.k] = True
        if not len(self._doomed_tag):
            self._doomed_tag = np.zeros(c.capacity, np.uint32)  # (pages committed only where marked)
        self.node_removals.append(removal)
        return removal

    def remove_node_step(self, max_rows: int | None = None) -> tuple[DroppedRows | None, Survivors | None]:
        """One bounded step of the first running node removal (see `node_removal.py`): (the blocks it
        dropped, as columns, with the replicas elsewhere to free; the blocks that lost a replica there but
        keep another). (None, None) when no removal runs."""
        from kvpool.index.node_removal import STEP_ROWS

        if not self.node_removals:
            return None, None
        removal = self.node_removals[0]
        out = removal.step(max_rows or STEP_ROWS)
        if removal.done:
            self.node_removals.pop(0)
            del self._dying[removal.k]
            self.dying_mask()[removal.k] = False
            if not self.node_removals:
                self._doomed_tag = np.zeros(0, np.uint32)
        return out

    def node_removals_ids(self) -> list[str]:
        """The dying nodes, in the order their removals run."""
        return [r.node_id for r in self.node_removals]

    def dying_mask(self) -> np.ndarray:
        """(len(node_ids),) bool: which node indices are dying."""
        n = len(self._c.node_ids)
        if len(self._dying_mask) < n:
            grown = np.zeros(n, np.bool_)
            grown[: len(self._dying_mask)] = self._dying_mask
            self._dying_mask = grown
        return self._dying_mask

    def is_dying(self, node_id: str) -> bool:
        k = self._c._node_index.get(node_id)
        return k is not None and k in self._dying

    def _hidden(self, row: int) -> bool:
        """While a node removal runs: the row will be dropped, or every replica of it is on a dying node."""
        if not self._dying:
            return False
        from kvpool.index.node_removal import is_doomed

        if is_doomed(self, np.array([row], np.int64))[0]:  # type: ignore[arg-type]
            return True
        return all(self.is_dying(x.node_id) for x in self._c.replicas(row))

    def _live_locations(self, row: int) -> tuple[Location, ...]:
        locs = self._c.replicas(row)
        if self._dying:
            locs = tuple(x for x in locs if not self.is_dying(x.node_id))
        return locs

    def _check_not_dying(self, locs: Sequence[Location], what: str) -> None:
        for loc in locs:
            if self.is_dying(loc.node_id):
                raise FailedPrecondition(f"{what}: node {loc.node_id} is being removed (it died)")
