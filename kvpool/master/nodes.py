"""The node registry's records: endpoints, epochs, liveness and each store node's slot free list.

The master is the one allocator of slots: a slot is free for placement only after the store acknowledged
its free order (with the slot's new generation), so a reader holding an old (slot, generation) can never
see another block's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.master.dataplane import DataPlaneHealth
from kvpool.master.free_slots import FreeSlots
from kvpool.types import Location, NodeLoad


@dataclass(slots=True)
class NodeRecord:
    """One registered node (any role). Mutated only under the master's lock."""

    node_id: str
    role: str
    grpc_address: str
    data_address: str
    epoch: int
    num_slots: int = 0
    block_nbytes: int = 0
    last_seen_ms: int = 0
    alive: bool = True
    draining: bool = False
    ready: bool = False  # store: its inventory was adopted, slots may be placed
    registered_ms: int = 0
    adopt_failures: int = 0  # store: failed inventory reads since it registered
    unreachable_until_ms: int = 0  # a control call to it failed: no placements or free orders till then
    dataplane: DataPlaneHealth = field(default_factory=DataPlaneHealth)  # store: kvpool.master.dataplane
    num_used_slots_reported: int = 0
    load: NodeLoad = field(default_factory=NodeLoad)
    free: FreeSlots = field(init=False)  # store: acknowledged free slots and pending frees, as columns
    session: bytes = b""  # secured cluster: what its heartbeats carry (RegisterNodeResponse.session)
    join_token: str = ""  # secured cluster, non-store: the name of the join token it joined with
    url: str = ""  # a vLLM engine's OpenAI base URL
    engine_namespace: tuple[str, ...] = ()  # a vLLM engine's (model, weights, layout, engine)

    def __post_init__(self) -> None:
        self.free = FreeSlots(self.num_slots)

    @property
    def is_store(self) -> bool:
        return self.role == "store"

    @property
    def placeable(self) -> bool:
        return self.is_store and self.alive and self.ready and not self.draining

    def reachable(self, now_ms: int, stale_ms: int) -> bool:
        """Heard from within `stale_ms` and not backing off after a failed call: a node cut off the
        network (alive until its heartbeat timeout) gets no new work meanwhile."""
        return now_ms >= self.unreachable_until_ms and now_ms - self.last_seen_ms <= stale_ms

    @property
    def num_allocated(self) -> int:
        """Slots holding a block or a reservation, or waiting for a free acknowledgement."""
        return self.num_slots - len(self.free)

    @property
    def used_fraction(self) -> float:
        return self.num_allocated / self.num_slots if self.num_slots else 0.0

    def take(self, n: int) -> list[Location]:
        """Allocate `n` free slots, oldest free first (caller checked `len(free) >= n`)."""
        slots, gens = self.free.take(n)
        return [Location(self.node_id, s, g) for s, g in zip(slots.tolist(), gens.tolist(), strict=True)]

    def give_back(self, slot: int, generation: int) -> None:
        """A slot is free at `generation` (never handed out twice)."""
        self.free.give_back(slot, generation)

    def reset_slots(self, used: np.ndarray, generation_of_free: int) -> None:
        """Start over from an inventory: every slot not marked in `used` ((num_slots,) bool) is free at
        `generation_of_free`."""
        self.free.allocate_all()
        self.free.release_unused(used, generation_of_free)
