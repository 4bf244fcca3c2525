"""Lease bookkeeping for the radix index: which rows each read lease pins, and when it ends.

A lease pins the rows it was granted over (each row's lease count goes up by one) until it is
released or its expiry passes. Rows are recorded with their row generation, so a lease never unpins a
row that was dropped and reused meanwhile. Expiry is a min-heap with lazy deletion (a renewal pushes a
new entry; stale entries are skipped).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

_REMEMBER_EXPIRED = 65_536
"""How many expired lease ids are remembered, so a late renewal reports LeaseExpired, not NotFound."""


@dataclass(slots=True)
class Lease:
    """One live lease: `rows[i]` was pinned at row generation `gens[i]`; expiry on the index clock."""

    expiry_ms: int
    rows: np.ndarray
    gens: np.ndarray


class LeaseTable:
    """Live leases by id, an expiry heap, and the ids of recently expired ones. Pure bookkeeping:
    pinning and unpinning rows is the index's job (it receives the ended leases)."""

    def __init__(self) -> None:
        self.live: dict[int, Lease] = {}
        self._heap: list[tuple[int, int]] = []
        self._expired: OrderedDict[int, None] = OrderedDict()
        self._next_id = 1
        self.num_expired = 0
        """Leases that ended by expiry rather than release (a metric: B13 pins reclaimed)."""

    def grant(self, expiry_ms: int, rows: np.ndarray, gens: np.ndarray) -> int:
        lease_id = self._next_id
        self._next_id += 1
        self.live[lease_id] = Lease(expiry_ms, rows, gens)
        heapq.heappush(self._heap, (expiry_ms, lease_id))
        return lease_id

    def renew(self, lease_id: int, expiry_ms: int) -> None:
        lease = self.live[lease_id]
        lease.expiry_ms = expiry_ms
        heapq.heappush(self._heap, (expiry_ms, lease_id))

    def pop(self, lease_id: int) -> Lease:
        """Remove a live lease (release); raises KeyError when it is not live."""
        return self.live.pop(lease_id)

    def was_expired(self, lease_id: int) -> bool:
        return lease_id in self._expired

    def pop_expired(self, now_ms: int) -> list[Lease]:
        """Remove and return every lease whose expiry is at or before `now_ms`."""
        ended: list[Lease] = []
        heap = self._heap
        while heap and heap[0][0] <= now_ms:
            expiry_ms, lease_id = heapq.heappop(heap)
            lease = self.live.get(lease_id)
            if lease is None or lease.expiry_ms != expiry_ms:
                continue
            del self.live[lease_id]
            self._remember_expired(lease_id)
            ended.append(lease)
        if len(heap) > 2 * len(self.live) + 1024:
            self._heap = [(lease.expiry_ms, lid) for lid, lease in self.live.items()]
            heapq.heapify(self._heap)
        self.num_expired += len(ended)
        return ended

    def _remember_expired(self, lease_id: int) -> None:
        self._expired[lease_id] = None
        if len(self._expired) > _REMEMBER_EXPIRED:
            self._expired.popitem(last=False)
