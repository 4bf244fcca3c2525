"""Leases and locks of the radix index: the lease table, and `LeaseLockMixin` (the index's lease and
lock methods: renew, release, expire, lock, unlock).

Lease bookkeeping: which rows each read lease pins, and when it ends.
A lease pins the rows it was granted over (each row's lease count goes up by one) until it is
released or its expiry passes. Rows are recorded with their row generation, so a lease never unpins a
row that was dropped and reused meanwhile. Expiry is a min-heap with lazy deletion (a renewal pushes a
new entry; stale entries are skipped).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.errors import FailedPrecondition, InvalidArgument, LeaseExpired, NotFound
from kvpool.index.columns import NO_ROW, Columns
from kvpool.types import BlockHash, Clock, NamespaceId

_REMEMBER_EXPIRED = 65_536
"""How many expired lease ids are remembered, so a late renewal reports LeaseExpired, not NotFound."""


@dataclass(slots=True)
class Lease:
    """One live lease: `rows[i]` was pinned at row generation `gens[i]`; expiry on the index clock."""

    expiry_ms: int
    rows: np.ndarray
    gens: np.ndarray
    owner: str = ""  # who may renew or release it (the master's caller; "" when unbound)


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


class LeaseLockMixin:
    """The lease and lock half of `RadixIndex` (which provides the state and `_row` / `_push`)."""

    _c: Columns
    _clock: Clock
    _leases: LeaseTable

    def _row(self, ns: NamespaceId, block_hash: BlockHash, *, include_invalidated: bool = False) -> int:
        raise NotImplementedError

    def _push(self, row: int) -> None:
        raise NotImplementedError

    def renew_lease(self, lease_id: int, ttl_ms: int) -> int:
        """Extend a live lease to now + `ttl_ms`; returns the new expiry. Raises `InvalidArgument`
        (ttl_ms <= 0), `LeaseExpired` (it already ended by expiry), `NotFound` (never granted/released)."""
        if ttl_ms <= 0:
            raise InvalidArgument(f"ttl_ms must be > 0, got {ttl_ms}")
        self.expire_leases()
        if lease_id not in self._leases.live:
            if self._leases.was_expired(lease_id):
                raise LeaseExpired(f"lease {lease_id} expired")
            raise NotFound(f"no lease {lease_id}")
        expiry_ms = self._clock.now_ms() + ttl_ms
        self._leases.renew(lease_id, expiry_ms)
        return expiry_ms

    def set_lease_owner(self, lease_id: int, owner: str) -> None:
        """Bind a live lease to `owner` (a no-op for one that is not live)."""
        lease = self._leases.live.get(lease_id)
        if lease is not None:
            lease.owner = owner

    def lease_owned_by(self, lease_id: int, owner: str) -> bool:
        """False only for a live lease bound to someone other than `owner`."""
        lease = self._leases.live.get(lease_id)
        return lease is None or lease.owner == owner

    def release_lease(self, lease_id: int) -> None:
        """End a lease now. A lease that already expired is a no-op; an unknown or already released
        one raises `NotFound`."""
        try:
            lease = self._leases.pop(lease_id)
        except KeyError:
            if self._leases.was_expired(lease_id):
                return
            raise NotFound(f"no lease {lease_id}") from None
        self._unpin(lease)

    def expire_leases(self) -> int:
        """Drop every lease past its expiry; returns how many ended (also done lazily)."""
        ended = self._leases.pop_expired(self._clock.now_ms())
        for lease in ended:
            self._unpin(lease)
        return len(ended)

    @property
    def num_live_leases(self) -> int:
        self.expire_leases()
        return len(self._leases.live)

    @property
    def num_leases_expired(self) -> int:
        """Leases reclaimed by expiry rather than released (B13's metric)."""
        return self._leases.num_expired

    def lock(self, ns: NamespaceId, block_hashes: Sequence[BlockHash]) -> None:
        """Pin the chain `block_hashes` and every ancestor of its first block (SGLang's `inc_lock_ref`
        up to the root). Raises `NotFound` (absent block) or `InvalidArgument` (not a chain)."""
        rows = self._chain_rows(ns, block_hashes)
        self._c.pin(rows, locks=1)

    def unlock(self, ns: NamespaceId, block_hashes: Sequence[BlockHash]) -> None:
        """Undo one `lock` of the same chain. Raises `FailedPrecondition` if any block is not locked
        (nothing changes then)."""
        rows = self._chain_rows(ns, block_hashes)
        c = self._c
        if rows.size and (c.lock_ref[rows] <= 0).any():
            raise FailedPrecondition("unlock of a block that is not locked")
        c.pin(rows, locks=-1)
        for row in rows[(c.lock_ref[rows] == 0) & (c.num_children[rows] == 0)]:
            self._push(int(row))

    def _chain_rows(self, ns: NamespaceId, block_hashes: Sequence[BlockHash]) -> np.ndarray:
        rows = [self._row(ns, h) for h in block_hashes]
        c = self._c
        for i in range(1, len(rows)):
            if c.parent[rows[i]] != rows[i - 1]:
                raise InvalidArgument(f"block_hashes[{i}] is not a child of block_hashes[{i - 1}]")
        if rows:
            up = int(c.parent[rows[0]])
            while up != NO_ROW:
                rows.append(up)
                up = int(c.parent[up])
        return np.array(rows, dtype=np.int64)

    def _unpin(self, lease: Lease) -> None:
        c = self._c
        rows = lease.rows[(c.gen[lease.rows] == lease.gens) & c.alive[lease.rows]]
        c.pin(rows, leases=-1)
        for row in rows[(c.num_leases[rows] == 0) & (c.num_children[rows] == 0)]:
            self._push(int(row))
