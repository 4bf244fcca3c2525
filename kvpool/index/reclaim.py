"""Background reclamation of invalidated namespaces for `RadixIndex` (`invalidate_namespace` is O(1);
this drops their blocks a bounded batch at a time).

Leaves go first, so the tree stays prefix-closed: a dropped leaf's parent is queued once it has no
children left. Leased or locked blocks wait (they are retried on later calls). Work items carry the row's
generation, so a row dropped and reused meanwhile is skipped. Cost: O(max_blocks) per call, plus one
O(blocks of the namespace) scan for leaves when its work list is first built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.index import validate as v
from kvpool.index.columns import NO_ROW
from kvpool.index.results import DroppedBlock

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex


def reclaim_invalidated(index: RadixIndex, max_blocks: int) -> list[DroppedBlock]:
    """See `RadixIndex.reclaim_invalidated`. Raises `InvalidArgument` on a negative `max_blocks`."""
    v.check_count(max_blocks, "max_blocks")
    index.expire_leases()
    c, dropped = index._c, list[DroppedBlock]()
    for slot in list(index._pending):
        rows_map = index._ns_rows[slot]
        work = index._reclaim_work.get(slot)
        if not work:
            work = [(r, int(c.gen[r])) for r in rows_map.values() if c.num_children[r] == 0]
            index._reclaim_work[slot] = work
        blocked: list[tuple[int, int]] = []
        while work and len(dropped) < max_blocks:
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
        if not rows_map:
            index._pending.remove(slot)
            index._free_slot(slot)  # reused by the next namespace registered
        if len(dropped) >= max_blocks:
            break
    return dropped
