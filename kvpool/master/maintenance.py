"""Background work of the master, one thread, one `tick()` at a time.

Each tick: dead-node detection (heartbeat timeout), lease and write-lease expiry, store inventories to
adopt (master restart / store restart: `adoption`, batch by batch), inventory blocks waiting for their
namespace indexed once it is registered or freed after the grace period, watermark eviction per store node,
reclamation of invalidated namespaces, expiry of idle ones (`bounds`), probes of stores whose data plane
failed (`dataplane_probe`), free orders, and re-replication (also what `Drain` needs).
Store calls happen outside the master's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.master import bounds, dataplane, dataplane_probe, node_death
from kvpool.master.adoption import Adoption
from kvpool.master.core import BlockKey
from kvpool.master.stores import copy_into
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _CopyJob:
    key: BlockKey
    parent: bytes
    src: Location
    src_data_address: str
    dst: Location
    dst_address: str
    checksum: int


class Maintenance:
    def __init__(self, master: Master) -> None:
        self.m = master
        self.adoption = Adoption(master)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-master-maint", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.m.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.m.wake.wait(self.m.settings.tick_ms / 1000)
            self.m.wake.clear()
            election = self.m.election
            if election is not None and not election.is_leader:
                continue  # only the leader orders stores about
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("master maintenance tick failed")

    def tick(self) -> None:
        m = self.m
        node_death.run_node_removals(m)  # a node declared dead since: its rows, in steps
        held_s = 0.0
        with m.lock:
            t0 = time.perf_counter()
            now = m.clock.now_ms()
            for rec in list(m.st.nodes.values()):
                if rec.alive and now - rec.last_seen_ms > m.settings.heartbeat_timeout_ms:
                    m.declare_dead(rec)
                elif not rec.alive and now - rec.last_seen_ms > m.settings.dead_node_retention_ms:
                    del m.st.nodes[rec.node_id]  # its blocks left the index when it died: only the record
                    log.info(
                        "node %s forgotten: dead for over %d ms",
                        rec.node_id,
                        m.settings.dead_node_retention_ms,
                    )
            m.index.expire_leases()
            m.publisher.expire(now)
            adopt = [(n, m.st.nodes[n].grpc_address, m.st.nodes[n].epoch) for n in m.st.to_adopt]
            m.st.to_adopt.clear()
            held_s = time.perf_counter() - t0
        node_death.run_node_removals(m)  # (one declared dead just now: before adopting a restarted store)
        for node_id, address, epoch in adopt:
            self.adoption.adopt(node_id, address, epoch)
        with m.lock:
            t0 = time.perf_counter()
            self.adoption.claim(m.clock.now_ms())
            self._watermarks()
            m.on_dropped(m.index.reclaim_invalidated(m.settings.reclaim_batch_blocks))
            bounds.expire_namespaces(m)  # idle namespaces: namespace_idle_expiry_s
            probes = dataplane_probe.due(m)  # stores whose data-plane back-off is over
            m.lock_holds.tick_s = max(held_s, time.perf_counter() - t0)
        for probe in probes:
            dataplane_probe.run(m, probe)
        m.flush_frees()
        self._rereplicate()

    # ---- watermarks -------------------------------------------------------------------------------
    def _watermarks(self) -> None:
        m, s = self.m, self.m.settings
        for rec in m.st.nodes.values():
            if not (rec.is_store and rec.alive and rec.ready) or rec.used_fraction <= s.high_watermark:
                continue
            want = rec.num_allocated - int(s.low_watermark * rec.num_slots)
            res = m.quotas.evict_on_node(m, rec.node_id, want, None)  # by tenants' shares
            m.counters.num_evictions += sum(1 for d in res.dropped if d.reason != "replica")
            m.on_dropped(res.dropped)
            log.info("node %s above its high watermark: freed %d slots", rec.node_id, res.num_freed_on_node)

    # ---- re-replication and drain -----------------------------------------------------------------
    def _rereplicate(self) -> None:
        m = self.m
        jobs: list[_CopyJob] = []
        with m.lock:
            keys = node_death.take_under_replicated(m, m.settings.rereplicate_batch_blocks)
            for key in keys:
                job, keep = self._plan(key)
                if not keep:
                    m.st.under_replicated.discard(key)
                if job is not None:
                    jobs.append(job)
        for job in jobs:
            self._copy(job)

    def _plan(self, key: BlockKey) -> tuple[_CopyJob | None, bool]:
        """Under the lock: (a copy to make, whether the key stays queued)."""
        m = self.m
        info = m.index.lookup(NamespaceId(key[0]), BlockHash(key[1]))
        meta = m.index.block_meta(NamespaceId(key[0]), BlockHash(key[1]))  # (checksum, target)
        if info is None or meta is None:
            return None, False
        nodes = m.st.nodes
        store_locs = [
            x for x in info.locations if not x.local and x.node_id in nodes and nodes[x.node_id].alive
        ]
        good = [x for x in store_locs if not nodes[x.node_id].draining]
        draining = [x for x in store_locs if nodes[x.node_id].draining]
        if len(good) >= meta[1] or (good and not draining and len(good) >= self._max_placeable()):
            if draining and info.num_leases:
                return None, True  # a reader may hold a draining replica: free it once the lease ends
            for loc in draining:
                m.on_dropped(m.index.remove_location(NamespaceId(key[0]), BlockHash(key[1]), loc))
                m.queue_free(loc)
            return None, False
        if not store_locs:
            return None, False
        have = {x.node_id for x in store_locs}
        high = m.settings.high_watermark
        dsts = [  # a copy never takes a store past its high watermark: its eviction would undo the copy
            n
            for n in nodes.values()
            if n.placeable
            and m.reachable(n)
            and dataplane.usable(m, n)
            and n.node_id not in have
            and n.free
            and n.num_allocated + 1 <= high * n.num_slots
        ]
        if not dsts:
            if draining and not good and not info.num_leases and not info.num_children:
                # nowhere to copy it: the drain evicts this leaf instead (its parent becomes a leaf next)
                for loc in draining:
                    m.on_dropped(m.index.remove_location(NamespaceId(key[0]), BlockHash(key[1]), loc))
                    m.queue_free(loc)
                m.counters.num_evictions += 1
                return None, False
            return None, bool(draining)
        dst_node = max(dsts, key=lambda n: len(n.free))
        dst = dst_node.take(1)[0]
        src = store_locs[0]
        job = _CopyJob(
            key,
            bytes(info.parent or b""),
            src,
            nodes[src.node_id].data_address,
            dst,
            dst_node.grpc_address,
            meta[0],
        )
        return job, True

    def _max_placeable(self) -> int:
        return sum(1 for n in self.m.st.nodes.values() if n.placeable)

    def _copy(self, job: _CopyJob) -> None:
        m = self.m
        ns, h = job.key
        err = copy_into(
            m.stores,
            m.capabilities,
            job.dst_address,
            job.src_data_address,
            job.key,
            job.parent,
            job.src,
            job.dst,
            job.checksum,
            m.settings.default_write_lease_ms,
            m.leader_epoch,
        )
        with m.lock:
            present = m.index.lookup(NamespaceId(ns), BlockHash(h)) is not None
            if err or not present:
                if err:
                    log.warning("re-replication of %s to %s failed: %s", h.hex(), job.dst.node_id, err)
                m.queue_free(job.dst)
                return
            m.index.add_location(NamespaceId(ns), BlockHash(h), job.dst)
            m.counters.num_rereplications += 1
