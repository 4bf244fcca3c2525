"""The router's own record of where recent prefixes went: prefix affinity without peeks.

Every request a prefill node served leaves its prompt's full blocks in that node's node-local tier, so
the router records, per chained block hash (a hash names its whole prefix), the last few nodes (id and
epoch) that served a prompt with that block. While the master is unreachable (no peek at the global
index) placement reads this record instead: `match` builds a `kvpool.client.types.Match` whose
locations are the recorded nodes' local tiers, so every policy sees the same picture as with a peek of
node-local locations only (pool copies on store nodes are not known to the router). A node's record
counts only while its epoch is the one listed (`kvpool.router.state.local_runs`), so a restarted node
attracts no traffic for blocks it lost.

Bounded: at most `capacity_blocks` block hashes, least recently recorded first out; each keeps at most
`NODES_PER_BLOCK` nodes, the latest first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvpool.client.types import Match, NodeInfo, NodeStatus
from kvpool.types import Location

NODES_PER_BLOCK = 4
"""Nodes remembered per block hash (the latest first)."""


class AffinityRecord:
    """Thread-safe LRU of block hash -> the nodes (id, epoch) that served a prompt holding that block."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        self._blocks: OrderedDict[bytes, tuple[tuple[str, int], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, hashes: Sequence[bytes], node: NodeStatus) -> None:
        """`node` served a prompt whose full blocks are `hashes` (they are now in its node-local tier)."""
        key = (node.node.node_id, node.node.epoch)
        with self._lock:
            for h in hashes:
                old = self._blocks.pop(h, ())
                self._blocks[h] = (key, *(k for k in old if k[0] != key[0]))[:NODES_PER_BLOCK]
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)

    def match(self, hashes: Sequence[bytes]) -> Match | None:
        """The leading blocks of `hashes` some node served, as a match of node-local locations; None when
        the first block is unknown."""
        replicas: list[tuple[Location, ...]] = []
        nodes: dict[str, NodeInfo] = {}
        with self._lock:
            for h in hashes:
                held = self._blocks.get(h)
                if not held:
                    break
                replicas.append(tuple(Location(node_id, 0, 0, local=True) for node_id, _ in held))
                for node_id, epoch in held:
                    nodes.setdefault(node_id, NodeInfo(node_id, "prefill", "", "", epoch))
        if not replicas:
            return None
        return Match(num_matched=len(replicas), replicas=replicas, lease_id=None, nodes=nodes)
