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
Pool-full eviction (a store node full when placing, or above its high watermark) goes by shares: a
tenant's **share** is its quota, scaled down in proportion when the quotas add up to more than the
pool (live stores' slots / `replicas`), so the shares always fit. The victims on that node are, in the
pool's eviction policy order: leaves of tenants over their share (at most their excess) and of
namespaces without a quota (no share); then, for a write, the writer's own leaves. Leaves of another
tenant at or under its share are never evicted to make room: the write is refused instead
(`ResourceExhausted`; the request still succeeds). With no quotas configured, eviction is the plain
per-node policy order. Dropping a spare replica (the block stays on another node) always comes first.
Cost: O(1) per reserve under the quota (the tenant's resident blocks are an index group count, its
reserved blocks a counter); eviction to make room costs what `RadixIndex.evict` does.
Reload: the master re-reads the tenants file when it changes (the router's mechanism,
`kvpool.tenants.Tenants.refresh`: its modification time looked at most every `RELOAD_CHECK_S`), at the
next `Reserve`, pool-full eviction or `/metrics` scrape: changed quotas apply from then on, a tenant given
a quota has its namespaces grouped for it, and a tenant whose quota was removed is no longer limited
(its blocks are evicted as those of a namespace without a quota). A file that no longer loads keeps the
previous quotas (logged).
Metrics (a tenant by its opaque id, never its name): `kvpool_master_tenant_pool_blocks{tenant}`, `..._tenant_pool_quota_blocks{tenant}`,
`..._tenant_quota_evictions_total`, `..._tenant_quota_refusals_total`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import ResourceExhausted
from kvpool.index.results import DroppedBlock, EvictResult
from kvpool.tenants import Tenant, Tenants
from kvpool.types import BlockHash, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)


class TenantQuotas:
    """Not thread-safe: the master calls it under its lock. State per tenant of the tenants file only
    (bounded by it, never per namespace or salt): its quota and name, and its reserved-block count; its
    resident blocks are counted by the index (the tenant is the index *group* of its namespaces), so
    `usage` and the check in `make_room` are O(1)."""

    def __init__(self, tenants: dict[str, Tenant], source: Tenants | None = None) -> None:
        self.quota_blocks: dict[str, int] = {}
        """Tenant cache salt -> quota in blocks."""
        self.ids: dict[str, str] = {}
        """Tenant cache salt -> its opaque id (metrics never name a tenant)."""
        self._reserved: dict[str, int] = {}  # tenant salt -> new blocks reserved (every salt ever grouped)
        self._source = source  # the tenants file, re-read when it changes (`refresh`)
        self._set(tenants)
        self.num_quota_evictions = 0
        self.num_refused = 0

    @classmethod
    def from_file(cls, path: str | None, salt_key_file: str | None = None) -> TenantQuotas:
        """Quotas of a tenants file (None: no quotas), its derived salts keyed by the salt key in
        `salt_key_file`; the file is re-read when it changes (`refresh`). `InvalidArgument` on a bad file."""
        tenants = Tenants.from_settings(path, salt_key_file)
        return cls(tenants.with_pool_quota(), tenants if path else None)

    def _set(self, tenants: dict[str, Tenant]) -> None:
        self.quota_blocks = {salt: t.pool_quota_blocks or 0 for salt, t in tenants.items()}
        self.ids = {salt: t.tenant_id for salt, t in tenants.items()}
        for salt in self.quota_blocks:
            self._reserved.setdefault(salt, 0)

    def refresh(self, m: Master) -> bool:
        """Under the lock: re-read the tenants file if it changed (module docstring); True when new
        quotas took effect. The namespaces of a tenant newly given a quota join its index group."""
        if self._source is None or not self._source.refresh():
            return False
        before = set(self._reserved)
        self._set(self._source.with_pool_quota())
        new = set(self.quota_blocks) - before
        if new:
            for record in m.namespaces.records():
                if record.tenant in new and m.namespaces.is_active(record.digest):
                    m.index.register_namespace(NamespaceId(record.digest), record.tenant)
        log.info("tenant quotas reloaded: %d tenants with a pool quota", len(self.quota_blocks))
        return True

    def group(self, tenant: str | None) -> str | None:
        """The index group of a namespace of tenant salt `tenant`: the tenant when it has (or had, since
        this master started) a quota."""
        return tenant if tenant is not None and tenant in self._reserved else None

    def usage(self, m: Master, salt: str) -> int:
        """Resident + reserved blocks of the tenant with cache salt `salt` (blocks); O(1)."""
        return m.index.num_blocks_in_group(salt) + self._reserved.get(salt, 0)

    def note_reserved(self, tenant: str | None, delta: int) -> None:
        """A reservation of the tenant's took (delta > 0) or gave back (delta < 0) new blocks."""
        if tenant in self._reserved and delta:
            self._reserved[tenant] += delta

    def usage_by_tenant(self, m: Master) -> dict[str, tuple[int, int]]:
        """Under the lock: tenant id (`kvpool.tenants.tenant_id`) -> (blocks used, quota in blocks)."""
        self.refresh(m)
        return {self.ids[s]: (self.usage(m, s), q) for s, q in self.quota_blocks.items()}

    def make_room(self, m: Master, ns: bytes, num_new: int, keep: Sequence[bytes]) -> None:
        """Under the lock, before placing `num_new` new blocks under `ns`: evict the tenant's own leaves
        until they fit, or raise `ResourceExhausted`. `keep`: blocks of the reservation (never evicted)."""
        self.refresh(m)
        salt = self.group(m.namespaces.tenant_of(ns))
        if salt is None or salt not in self.quota_blocks or num_new <= 0:
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
            res = m.index.evict(over, group=salt)
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

    def shares(self, m: Master) -> dict[str, int]:
        """Under the lock: tenant salt -> its share of the pool in blocks (its quota, scaled down in
        proportion when the quotas add up to more than the pool's capacity)."""
        live = [r for r in m.st.nodes.values() if r.is_store and r.alive]
        capacity = sum(r.num_slots for r in live) // max(1, m.settings.replicas)
        total = sum(self.quota_blocks.values())
        if total <= capacity:
            return dict(self.quota_blocks)
        return {salt: q * capacity // total for salt, q in self.quota_blocks.items()}

    def evict_on_node(self, m: Master, node_id: str, want: int, writer_ns: bytes | None) -> EvictResult:
        """Under the lock: free up to `want` slots on `node_id` for a full pool, by shares (module
        docstring): over-share tenants and namespaces without a quota first, then the writer's own
        leaves (`writer_ns`: the namespace written, None for background eviction), never another
        tenant's under its share. The caller accounts the dropped blocks (`on_dropped`)."""
        self.refresh(m)
        if not self.quota_blocks:
            return m.index.evict(want, node_id=node_id)
        shares = self.shares(m)
        budgets: dict[str | None, int] = {None: want}
        budgets |= {salt: want for salt in self._reserved if salt not in shares}  # quota removed: no share
        for salt, share in shares.items():
            if (excess := min(m.index.num_blocks_in_group(salt), self.usage(m, salt) - share)) > 0:
                budgets[salt] = excess
        first = m.index.evict(want, node_id=node_id, group_budgets=budgets)
        left = want - first.num_freed_on_node
        writer = self.group(m.namespaces.tenant_of(writer_ns)) if writer_ns is not None else None
        if left <= 0 or writer is None or writer not in shares:
            return first
        own = m.index.evict(left, node_id=node_id, group_budgets={writer: left})
        self.num_quota_evictions += len(own.dropped)
        dropped: list[DroppedBlock] = [*first.dropped, *own.dropped]
        freed = first.num_freed_on_node + own.num_freed_on_node
        return EvictResult(dropped, freed, max(0, want - freed))
