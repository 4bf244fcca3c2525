"""The master's Prometheus metrics, read from its live state at scrape time (no second bookkeeping).

Hit rate = `kvpool_master_hit_tokens_total / kvpool_master_requested_tokens_total`: the denominator is
explicit (every prompt token of every counted match; the router's peeks and decode matches count none).
Pool usage per store node: `kvpool_master_store_used_slots{node}` of `kvpool_master_store_capacity_slots`,
and the same in bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.master import dataplane
from kvpool.master.core import Master
from kvpool.master.registry import ROLES

P = "kvpool_master_"


class MasterCollector(Collector):
    """Collects from `master` under its lock (as the `Stats` RPC does)."""

    def __init__(self, master: Master) -> None:
        self.m = master

    def collect(self) -> Iterator[Metric]:
        m, c = self.m, self.m.counters
        counters = [
            ("match_requests", "Prefix matches that counted a hit (prefill requests).", c.num_match_requests),
            (
                "requested_tokens",
                "Prompt tokens of counted matches (prefill requests), recorded with hit_tokens by "
                "the same match: the pool hit-rate denominator.",
                c.requested_tokens,
            ),
            (
                "hit_tokens",
                "Prompt tokens found in the pool by counted matches: matched (on offer), not "
                "necessarily reused (reused: kvpool_prefill_reused_tokens_total); at most requested_tokens.",
                c.hit_tokens,
            ),
            ("requested_blocks", "Full blocks of counted matches.", c.requested_blocks),
            ("hit_blocks", "Blocks found in the pool by counted matches.", c.hit_blocks),
            ("evictions", "Blocks evicted (watermark, admin or policy).", c.num_evictions),
            ("rereplications", "Block copies made to restore the replica count.", c.num_rereplications),
            ("bad_replicas", "Replicas reported unreadable by readers.", c.num_bad_replicas),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(P + name, doc, value=value)
        a = m.admission
        yield CounterMetricFamily(
            P + "admission_refusals",
            "Reserves (and inventory batches at adoption) refused at the index memory limit (--max-index-bytes).",
            value=a.num_refusals,
        )
        yield CounterMetricFamily(
            P + "admission_evictions",
            "Blocks evicted to keep the index within its memory limit (also in evictions).",
            value=a.num_evictions,
        )
        ad = m.adoption_stats
        yield CounterMetricFamily(
            P + "adopted_blocks", "Blocks indexed from store inventories.", value=ad.num_adopted_blocks
        )
        yield CounterMetricFamily(
            P + "inventory_resumes",
            "Broken inventory streams read again from their cursor.",
            value=ad.num_inventory_resumes,
        )
        yield GaugeMetricFamily(
            P + "adoption_lock_hold_max_seconds",
            "The longest the master's lock was held for one inventory batch.",
            value=ad.max_lock_hold_s,
        )
        yield GaugeMetricFamily(
            P + "last_adoption_seconds",
            "Wall clock of the last complete inventory adoption (first read to last block indexed).",
            value=ad.last_adoption_s,
        )
        holds = m.lock_holds
        yield GaugeMetricFamily(
            P + "node_death_lock_ms",
            "The longest single hold of the master's lock during the last node death (its replicas leave "
            "the index in steps, the lock released between them), ms.",
            value=holds.node_death_s * 1e3,
        )
        yield GaugeMetricFamily(
            P + "watermark_tick_ms",
            "The longest single hold of the master's lock in the last maintenance tick (watermark "
            "evictions, reclamation, expiries; node-death steps not included), ms.",
            value=holds.tick_s * 1e3,
        )
        yield CounterMetricFamily(
            P + "node_deaths",
            "Node removals finished (dead, deregistered or re-registered nodes).",
            value=holds.num_node_deaths,
        )
        with m.lock:
            index_bytes = a.index_bytes()
        yield GaugeMetricFamily(
            P + "index_memory_bytes",
            "The index's memory by its own accounting (what --max-index-bytes limits).",
            value=index_bytes,
        )
        yield GaugeMetricFamily(
            P + "index_memory_bytes_limit",
            "The index's memory limit (--max-index-bytes).",
            value=a.limit_bytes,
        )
        used_slots = GaugeMetricFamily(
            P + "store_used_slots", "Allocated slots per store node.", labels=["node"]
        )
        cap_slots = GaugeMetricFamily(P + "store_capacity_slots", "Slots per store node.", labels=["node"])
        used_bytes = GaugeMetricFamily(
            P + "store_used_bytes", "Bytes of indexed blocks per store node.", labels=["node"]
        )
        cap_bytes = GaugeMetricFamily(
            P + "store_capacity_bytes", "Segment bytes per store node.", labels=["node"]
        )
        alive = GaugeMetricFamily(P + "nodes_alive", "Registered live nodes by role.", labels=["role"])
        dp_failed = GaugeMetricFamily(
            P + "store_dataplane_failed",
            "1 while a store's data plane is failed (not placed on, its replicas not offered).",
            labels=["node"],
        )
        dp_failures = CounterMetricFamily(
            P + "store_dataplane_failures",
            "Data-plane failures reported per store since it registered.",
            labels=["node"],
        )
        dp_probes = CounterMetricFamily(
            P + "store_dataplane_probes",
            "Data-plane probes of a failed store (a block copied through its data plane), by result.",
            labels=["node", "result"],
        )
        unwritten = CounterMetricFamily(
            P + "store_unwritten_slots",
            "Slots reserved on a store for a writer and not written (or not committed) at commit.",
            labels=["node"],
        )
        grayed = CounterMetricFamily(
            P + "store_write_grayed",
            "Times a store's writes failed at `dataplane_fail_after` commits in a row (it then gets no new "
            "reservation while a healthy store has room).",
            labels=["node"],
        )
        with m.lock:
            num_blocks = m.index.num_blocks
            num_leases = m.index.num_live_leases
            num_reserved = m.publisher.num_reserved_blocks
            num_namespaces = len(m.namespaces)
            tenants = m.quotas.usage_by_tenant(m)
            by_role = dict.fromkeys(ROLES, 0)
            total_bytes = 0
            for rec in m.st.nodes.values():
                if rec.alive:
                    by_role[rec.role] = by_role.get(rec.role, 0) + 1
                if not (rec.is_store and rec.alive):
                    continue
                node_bytes = m.index.bytes_on_node(rec.node_id)
                total_bytes += node_bytes
                used_slots.add_metric([rec.node_id], rec.num_allocated)
                cap_slots.add_metric([rec.node_id], rec.num_slots)
                used_bytes.add_metric([rec.node_id], node_bytes)
                cap_bytes.add_metric([rec.node_id], rec.num_slots * rec.block_nbytes)
                dp_failed.add_metric([rec.node_id], 0.0 if dataplane.usable(m, rec) else 1.0)
                dp_failures.add_metric([rec.node_id], rec.dataplane.num_failures)
                num_failed = rec.dataplane.num_probes_failed
                dp_probes.add_metric([rec.node_id, "passed"], rec.dataplane.num_probes - num_failed)
                dp_probes.add_metric([rec.node_id, "failed"], num_failed)
                unwritten.add_metric([rec.node_id], rec.dataplane.num_unwritten_slots)
                grayed.add_metric([rec.node_id], rec.dataplane.num_grayed)
        for role, n in sorted(by_role.items()):
            alive.add_metric([role], n)
        yield from (used_slots, cap_slots, used_bytes, cap_bytes, alive, dp_failed, dp_failures, dp_probes)
        yield from (unwritten, grayed)
        yield GaugeMetricFamily(P + "index_blocks", "Blocks in the index (resident).", value=num_blocks)
        yield GaugeMetricFamily(
            P + "index_bytes", "Bytes of block replicas on live store nodes.", value=total_bytes
        )
        yield GaugeMetricFamily(
            P + "live_leases", "Read leases not yet released or expired.", value=num_leases
        )
        yield GaugeMetricFamily(
            P + "reserved_blocks", "Slots reserved by unfinished publishes.", value=num_reserved
        )
        yield GaugeMetricFamily(P + "namespaces", "Registered namespaces.", value=num_namespaces)
        yield from _tenant_metrics(m, tenants)
        yield from _ha_metrics(m)


def _ha_metrics(m: Master) -> Iterator[Metric]:
    """Leadership (`kvpool.master.ha`): a single master without etcd always leads, at epoch 0."""
    election = m.election
    view = election.view() if election is not None else None
    leads = view is None or view.role == "leader"
    yield GaugeMetricFamily(
        P + "leader", "1 while this master leads (takes writes); 0 on a standby or deposed one.", value=leads
    )
    yield GaugeMetricFamily(
        P + "leader_epoch",
        "The leader's epoch as this master knows it (etcd create revision; 0 without HA).",
        value=view.epoch if view is not None else 0,
    )
    yield CounterMetricFamily(
        P + "elections", "Elections this master won.", value=view.elections if view is not None else 0
    )
    yield CounterMetricFamily(
        P + "failovers",
        "Changes of leader this master saw (a new leader after another one).",
        value=view.failovers if view is not None else 0,
    )
    yield CounterMetricFamily(
        P + "orders_withheld",
        "Store orders this master did not send because it no longer surely led (its lease not renewed in "
        "time): a deposed leader's late orders.",
        value=m.stores.num_withheld,
    )


def _tenant_metrics(m: Master, tenants: dict[str, tuple[int, int]]) -> Iterator[Metric]:
    """Per-tenant pool usage and quota (tenants with a `pool_quota_blocks`: `kvpool.master.quotas`), each
    labelled by its opaque id (`kvpool.tenants.tenant_id`): the unauthenticated /metrics names no tenant."""
    used = GaugeMetricFamily(
        P + "tenant_pool_blocks",
        "Blocks (resident + reserved) per tenant (its opaque id).",
        labels=["tenant"],
    )
    quota = GaugeMetricFamily(
        P + "tenant_pool_quota_blocks", "Pool quota per tenant (its opaque id).", labels=["tenant"]
    )
    for tid, (n, q) in sorted(tenants.items()):
        used.add_metric([tid], n)
        quota.add_metric([tid], q)
    yield from (used, quota)
    quotas = m.quotas
    yield CounterMetricFamily(
        P + "tenant_quota_evictions",
        "Blocks evicted to keep a tenant in its quota.",
        value=quotas.num_quota_evictions,
    )
    yield CounterMetricFamily(
        P + "tenant_quota_refusals", "Reserves refused by a tenant quota.", value=quotas.num_refused
    )


def master_registry(master: Master) -> CollectorRegistry:
    """A fresh registry holding one `MasterCollector` (one per master instance)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MasterCollector(master))
    return registry
