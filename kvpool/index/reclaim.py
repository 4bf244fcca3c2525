"""Background reclamation of invalidated namespaces for `RadixIndex` (`invalidate_namespace` is O(1);
this drops their blocks a bounded batch at a time).

Leaves go first, so the tree stays prefix-closed: a dropped leaf's parent is queued once it has no
children left. Leased or locked blocks wait (they are retried on later calls). Work items carry the row's
generation, so a row dropped and reused meanwhile is skipped. The namespace's leaves are found by a
vectorised scan of the `ns_slot` column, `_SCAN_ROWS` rows at a time from a cursor kept per slot (no
per-block structure names a namespace's rows), at most `_SCAN_STEPS` windows per call. Cost per call:
O(max_blocks) Python steps plus O(_SCAN_ROWS * _SCAN_STEPS) numpy work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool.index import validate as v
from kvpool.index.columns import NO_ROW
from kvpool.index.results import DroppedBlock

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex

_SCAN_ROWS = 1 << 20
_SCAN_STEPS = 4


def reclaim_invalidated(index: RadixIndex, max_blocks: int) -> list[DroppedBlock]:
    """See `RadixIndex.reclaim_invalidated`. Raises `InvalidArgument` on a negative `max_blocks`."""
    v.check_count(max_blocks, "max_blocks")
    index.expire_leases()
    c, dropped = index._c, list[DroppedBlock]()
    for slot in list(index._pending):
        work = index._reclaim_work.setdefault(slot, [])
        blocked: list[tuple[int, int]] = []
        scans = 0
        while len(dropped) < max_blocks:
            if not work:
                cursor = index._reclaim_cursor.get(slot, 0)
                if cursor >= c.high_water or scans == _SCAN_STEPS:
                    break
                end = min(cursor + _SCAN_ROWS, c.high_water)
                window = slice(cursor, end)
                leaves = np.flatnonzero(
                    (c.ns_slot[window] == slot) & c.alive[window] & (c.num_children[window] == 0)
                )
                leaves += cursor
                work.extend(zip(leaves.tolist()[::-1], c.gen[leaves].tolist()[::-1], strict=True))
                index._reclaim_cursor[slot] = end
                scans += 1
                continue
            row, gen = work.pop()
            if not c.alive[row] or c.gen[row] != gen or c.ns_slot[row] != slot or c.num_children[row]:
                continue
            if c.num_leases[row] or c.lock_ref[row]:
                blocked.append((row, gen))
                continue
            parent = int(c.parent[row])
            dropped.append(index._drop_row(row, "invalidate"))
            if parent != NO_ROW and c.num_children[parent] == 0:
                work.append((parent, int(c.gen[parent])))
        work.extend(blocked)
        if not index._ns_count[slot]:
            index._pending.remove(slot)
            index._free_slot(slot)  # reused by the next namespace registered
        if len(dropped) >= max_blocks:
            break
    return dropped
