"""Admin operations on the master: drain a node, evict a fraction of blocks."""

from __future__ import annotations

import math

from kvpool.errors import FailedPrecondition, InvalidArgument
from kvpool.master.core import Master


def drain(m: Master, node_id: str) -> int:
    """No new placements on `node_id`; its blocks are copied elsewhere, then its replicas freed.

    It serves reads until each of its blocks has a copy on another node. Returns the blocks to move.
    """
    with m.lock:
        rec = m.node(node_id)
        if not rec.is_store:
            raise FailedPrecondition(f"node {node_id} is a {rec.role} node, not a store")
        if not rec.alive:
            raise FailedPrecondition(f"node {node_id} is dead")
        others = [
            n for n in m.st.nodes.values() if n.is_store and n.alive and not n.draining and n is not rec
        ]
        if not rec.draining and not others:
            raise FailedPrecondition(
                f"node {node_id} is the only live store taking blocks: draining it would leave no store for "
                "new blocks and nowhere to copy its own (start another store first)"
            )
        rec.draining = True
        for ns, h in m.index.keys_on_node(node_id):  # its blocks, to copy elsewhere
            if m.index.block_meta(ns, h) is not None:
                m.st.under_replicated.add((bytes(ns), bytes(h)))
        m.wake.set()
        return m.index.num_blocks_on_node(node_id)


def undrain(m: Master, node_id: str) -> int:
    """Cancel a drain of `node_id`: it takes new blocks again and keeps the blocks it still holds (those a
    drain already moved stay where they went). Returns the blocks it holds; a no-op on a node not draining."""
    with m.lock:
        rec = m.node(node_id)
        if not rec.is_store:
            raise FailedPrecondition(f"node {node_id} is a {rec.role} node, not a store")
        rec.draining = False
        m.wake.set()
        return m.index.num_blocks_on_node(node_id)


def admin_evict(m: Master, fraction: float, node_id: str) -> tuple[int, int]:
    """Evict `fraction` of the resident blocks (of one node's slots with `node_id`): (evicted, shortfall)."""
    if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise InvalidArgument(f"fraction must be in (0, 1], got {fraction}")
    with m.lock:
        if node_id:
            rec = m.node(node_id)
            if not rec.is_store:  # a serving node's local tier is its own: the master cannot evict it
                raise FailedPrecondition(f"node {node_id} is a {rec.role} node, not a store")
            want = math.ceil(fraction * m.index.num_blocks_on_node(node_id))
        else:
            want = math.ceil(fraction * m.index.num_blocks)
        if want == 0:
            return 0, 0
        res = m.index.evict(want, node_id=node_id or None)
        evicted = sum(1 for d in res.dropped if d.reason != "replica")
        m.counters.num_evictions += evicted
        m.on_dropped(res.dropped)
    m.flush_frees()
    return (res.num_freed_on_node if node_id else evicted), res.shortfall
