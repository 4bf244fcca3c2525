"""Per-tenant pool quotas: a tenant's namespaces hold at most `pool_quota_blocks` blocks of the pool.

Configuration: the master's `tenants` setting names the router's tenants file (`kvpool.tenants`); a
tenant with `pool_quota_blocks = N` gets a quota, keyed by its cache salt. A namespace belongs to the
tenant whose salt is its cache salt's part before the first "/" (a client's sub-salt follows it, so
sub-partitions share their tenant's quota). Namespaces of other salts have no quota.

Semantics (checked at `Reserve`, under the master's lock):
- usage = the tenant's resident blocks (active namespaces, counted once whatever their replica count)
  + the new blocks of its reservations not yet committed or aborted;
- a reservation whose new blocks would take usage past N first evicts the tenant's **own** unleased,
  unlocked leaf blocks (the pool's eviction policy order, never another tenant's block, never a block
  of the reservation itself);
- if that cannot make room (the rest is leased or interior), or the reservation alone exceeds N,
  `Reserve` fails with `ResourceExhausted` (a prefill node then reports `publish_failed`; the request
  still succeeds). Blocks of fenced (old-version) namespaces are not counted: they are unreachable and
  reclaimed in the background. A tenant found above its quota (blocks adopted from store inventories
  after a master restart) is brought back under it by its next reservation.
Metrics: `kvpool_master_tenant_pool_blocks{tenant}`, `..._tenant_pool_quota_blocks{tenant}`,
`..._tenant_quota_evictions_total`, `..._tenant_quota_refusals_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import ResourceExhausted
from kvpool.tenants import Tenant, Tenants, tenant_salt
from kvpool.types import BlockHash, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)


class TenantQuotas:
    """Not thread-safe: the master calls it under its lock."""

    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self.quota_blocks = {salt: t.pool_quota_blocks or 0 for salt, t in tenants.items()}
        """Tenant cache salt -> quota in blocks."""
        self.names = {salt: t.name for salt, t in tenants.items()}
        self._namespaces: dict[str, set[bytes]] = {}  # tenant salt -> its namespace digests
        self._tenant_of: dict[bytes, str] = {}
        self.num_quota_evictions = 0
        self.num_refused = 0

    @classmethod
    def from_file(cls, path: str | None) -> TenantQuotas:
        """Quotas of a tenants file (None: no quotas). `InvalidArgument` on a bad file."""
        return cls(Tenants.load(path).with_pool_quota() if path else {})

    def note_namespace(self, digest: bytes, cache_salt: str) -> None:
        """A namespace was registered: remember its tenant when that tenant has a quota."""
        salt = tenant_salt(cache_salt)
        if salt in self.quota_blocks:
            self._namespaces.setdefault(salt, set()).add(bytes(digest))
            self._tenant_of[bytes(digest)] = salt

    def usage(self, m: Master, salt: str) -> int:
        """Resident + reserved blocks of the tenant with cache salt `salt` (blocks)."""
        digests = self._namespaces.get(salt, set())
        resident = sum(m.index.num_blocks_in(NamespaceId(d)) for d in digests)
        reserved = sum(
            1 for r in m.publisher.reservations.values() if r.ns in digests for locs in r.locations if locs
        )
        return resident + reserved

    def usage_by_tenant(self, m: Master) -> dict[str, tuple[int, int]]:
        """Under the lock: tenant name -> (blocks used, quota in blocks)."""
        return {self.names[s]: (self.usage(m, s), q) for s, q in self.quota_blocks.items()}

    def make_room(self, m: Master, ns: bytes, num_new: int, keep: Sequence[bytes]) -> None:
        """Under the lock, before placing `num_new` new blocks under `ns`: evict the tenant's own leaves
        until they fit, or raise `ResourceExhausted`. `keep`: blocks of the reservation (never evicted)."""
        salt = self._tenant_of.get(bytes(ns))
        if salt is None or num_new <= 0:
            return
        quota = self.quota_blocks[salt]
        over = self.usage(m, salt) + num_new - quota
        if over <= 0:
            return
        if num_new > quota:
            self.num_refused += 1
            raise ResourceExhausted(f"{num_new} new blocks exceed the tenant's pool quota of {quota}")
        kept = [BlockHash(h) for h in keep if m.index.lookup(NamespaceId(ns), BlockHash(h)) is not None]
        for h in kept:
            m.index.lock(NamespaceId(ns), [h])
        try:
            res = m.index.evict(over, namespaces=[NamespaceId(d) for d in self._namespaces[salt]])
        finally:
            for h in kept:
                m.index.unlock(NamespaceId(ns), [h])
        evicted = len(res.dropped)
        self.num_quota_evictions += evicted
        m.counters.num_evictions += evicted
        m.on_dropped(res.dropped)
        if evicted < over:
            self.num_refused += 1
            raise ResourceExhausted(
                f"tenant pool quota of {quota} blocks: {over - evicted} more blocks are leased or in use"
            )
        log.debug("tenant quota: evicted %d of its own blocks to fit %d new", evicted, num_new)
