"""Bounded master state: the caps and expiries on what clients create, in one place.

What a client can create on the master, and what bounds it (settings of `MasterSettings`):
- namespaces (`RegisterNamespace`, a distinct cache salt each): `max_namespaces`,
  `max_namespaces_per_tenant`, and expiry after `namespace_idle_expiry_s` without blocks or use
  (`expire_namespaces`, each maintenance tick); model ids: `max_models` (`kvpool.master.namespaces`);
- index namespace slots: reused once empty (`kvpool.index.ns_slots`), so flushes and version switches
  leave O(live namespaces) of them;
- read leases (leased `MatchPrefix`): `max_leases` live at once, all clients (the request names no
  client); each ends by `max_lease_ttl_ms` and is reaped by the index's expiry heap;
- write leases (`Reserve`): `max_leases_per_client` open reservations per `writer_node_id`
  (`kvpool.master.publish`); each also holds store slots, so the pool's capacity bounds them all;
  a batch (`ReserveBatch` / `CommitBatch`): `max_batch_chains` chains and `max_batch_total_blocks`
  blocks per call (`kvpool.master.publish_batch`);
- adapters (`RegisterAdapter`): `max_adapters` names, all models, and as many fenced (reloaded or
  unloaded) digests remembered, the oldest forgotten first (`kvpool.master.adapters`);
- tenant quota bookkeeping: per tenant of the tenants file only, O(1) per reserve (`kvpool.master.quotas`).
Past a cap the answer is `ResourceExhausted` (gRPC RESOURCE_EXHAUSTED) naming the setting.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpool.errors import ResourceExhausted
from kvpool.master.namespaces import NamespaceLimits
from kvpool.types import NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master
    from kvpool.master.settings import MasterSettings

log = logging.getLogger(__name__)

EXPIRE_BATCH = 10_000
"""Namespaces looked at per maintenance tick at most (bounds the time the lock is held)."""


def namespace_limits(s: MasterSettings) -> NamespaceLimits:
    return NamespaceLimits(
        max_namespaces=s.max_namespaces,
        max_namespaces_per_tenant=s.max_namespaces_per_tenant,
        max_models=s.max_models,
        idle_expiry_ms=round(s.namespace_idle_expiry_s * 1000),
        max_adapters=s.max_adapters,
    )


def before_match(m: Master, ns: bytes, lease_ttl_ms: int) -> None:
    """Under the lock, before a match: refuse a leased one at the `max_leases` cap (after reaping the
    expired; O(1) amortised), and mark the namespace used (it does not expire while matched)."""
    if lease_ttl_ms > 0 and m.index.num_live_leases >= m.settings.max_leases:
        raise ResourceExhausted(
            f"{m.settings.max_leases} read leases are live: the master's max_leases; "
            "release leases (or match without one) and retry"
        )
    m.namespaces.touch(ns, m.clock.now_ms())


def expire_namespaces(m: Master) -> int:
    """Under the lock (maintenance): forget namespaces idle past `namespace_idle_expiry_s` that hold no
    blocks in the pool and no open reservation. Returns how many. O(1) when none is due."""
    reserved: set[bytes] | None = None

    def in_use(digest: bytes) -> bool:
        nonlocal reserved
        if m.index.num_blocks_in(NamespaceId(digest)) > 0:
            return True
        if reserved is None:  # once per tick that has a namespace due
            reserved = {r.ns for r in m.publisher.reservations.values()}
        return digest in reserved

    gone = m.namespaces.expire(m.clock.now_ms(), in_use, EXPIRE_BATCH)
    for record in gone:
        m.index.forget_namespace(record.digest)
    if gone:
        log.info("%d idle namespaces forgotten (%d left)", len(gone), len(m.namespaces))
    return len(gone)
