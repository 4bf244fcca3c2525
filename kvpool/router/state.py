"""The router's view of the serving nodes: its own in-flight requests and the per-request node states.

`Inflight` counts the requests this router sent to each node that are not done yet (for a prefill node:
until its first token; for a decode node: until the last token), with their predicted seconds. It is
keyed by (node id, epoch): a restarted node starts with nothing in flight.

`node_states` turns a peek (`kvpool.client.types.Match`) and the master's node list into one
`NodeState` per live prefill node. A node's `local_blocks` is the leading run of the prompt's blocks
that carry a `local` location naming it, and only when the peek's record of that node has the epoch the
node list reports: local locations of an older incarnation never attract traffic (field case B22; the
master also purges them when the node re-registers with a new epoch or reports `cleared`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.client.types import Match, NodeStatus
from kvpool.router.policy import NodeState


@dataclass(slots=True)
class _Slot:
    count: int = 0
    seconds: float = 0.0


class Inflight:
    """Thread-safe in-flight counters per (node id, epoch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], _Slot] = {}

    def begin(self, node_id: str, epoch: int, seconds: float = 0.0) -> None:
        with self._lock:
            slot = self._slots.setdefault((node_id, epoch), _Slot())
            slot.count += 1
            slot.seconds += seconds

    def end(self, node_id: str, epoch: int, seconds: float = 0.0) -> None:
        """Called exactly once per `begin`, with the same seconds."""
        with self._lock:
            slot = self._slots.get((node_id, epoch))
            if slot is None:
                return
            slot.count -= 1
            slot.seconds -= seconds
            if slot.count <= 0:
                del self._slots[(node_id, epoch)]

    def get(self, node_id: str, epoch: int) -> tuple[int, float]:
        with self._lock:
            slot = self._slots.get((node_id, epoch))
            return (slot.count, max(0.0, slot.seconds)) if slot is not None else (0, 0.0)

    def total(self) -> int:
        with self._lock:
            return sum(s.count for s in self._slots.values())


def serving_nodes(nodes: Sequence[NodeStatus], role: str) -> list[NodeStatus]:
    """Alive, not draining nodes of `role`, sorted by id."""
    out = [n for n in nodes if n.node.role == role and n.alive and not n.draining]
    return sorted(out, key=lambda n: n.node.node_id)


def local_runs(match: Match | None, epochs: dict[str, int], max_blocks: int) -> dict[str, int]:
    """Per node id: the leading run of blocks (of the first `max_blocks`) with a current local location."""
    if match is None:
        return {}
    runs: dict[str, int] = {}
    alive: set[str] | None = None
    for i, replicas in enumerate(match.replicas[: min(match.num_matched, max_blocks)]):
        here = set()
        for loc in replicas:
            if not loc.local:
                continue
            info = match.nodes.get(loc.node_id)
            if info is not None and epochs.get(loc.node_id) != info.epoch:
                continue  # an older incarnation's record (B22)
            if loc.node_id not in epochs:
                continue
            here.add(loc.node_id)
        alive = here if alive is None else alive & here
        if not alive:
            break
        for node_id in alive:
            runs[node_id] = i + 1
    return runs


def node_states(
    prefill: Sequence[NodeStatus], match: Match | None, inflight: Inflight, max_blocks: int
) -> list[NodeState]:
    """One `NodeState` per node of `prefill` for the prompt the peek `match` describes."""
    epochs = {n.node.node_id: n.node.epoch for n in prefill}
    runs = local_runs(match, epochs, max_blocks)
    out = []
    for n in prefill:
        count, seconds = inflight.get(n.node.node_id, n.node.epoch)
        out.append(
            NodeState(
                node_id=n.node.node_id,
                epoch=n.node.epoch,
                load=n.load,
                inflight=count,
                inflight_s=seconds,
                local_blocks=runs.get(n.node.node_id, 0),
            )
        )
    return out
