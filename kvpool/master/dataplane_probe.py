"""The master's probe of a store whose data plane failed (`kvpool.master.dataplane`, state `probe`).

Once its back-off is over, the store copies one committed block into a spare slot of its own through the
data plane, the way a re-replication does (reserve → `CopyBlocks` → commit, outside the master's lock): the
source is one of its own replicas when it holds any (the bytes leave through its own UCX listener and land
in its own memory; both ends compare checksums), else a replica on a healthy store (its write path). The
spare slot is freed right after; the index never sees it. Passed → `trial`; failed → `failed` again with a
doubled back-off. A store with no spare slot, or a pool with no block to copy, goes to `trial` unprobed
(real transfers are then the probe). A result that proves nothing about the store (the source block was
freed or moved on during the copy) leaves it due, and the next tick probes again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.master import dataplane
from kvpool.master.stores import copy_into
from kvpool.types import Location

if TYPE_CHECKING:
    from kvpool.master.core import BlockKey, Master
    from kvpool.master.nodes import NodeRecord

log = logging.getLogger(__name__)

MAX_CANDIDATES = 64
"""Blocks looked at per store to find a probe source (bounded work under the lock)."""
INCONCLUSIVE = ("StaleGeneration", "NotFound", "LeaseExpired")
"""Copy errors about the source block (freed or moved on meanwhile), not the probed store."""


@dataclass(frozen=True, slots=True)
class Probe:
    node_id: str
    epoch: int
    address: str  # the probed store's gRPC address
    key: BlockKey | None = None  # None: nothing to copy (no block, or no spare slot)
    parent: bytes = b""
    src: Location | None = None
    src_data_address: str = ""
    dst: Location | None = None
    checksum: int = 0


def due(m: Master) -> list[Probe]:
    """Under the lock: one planned probe per live store whose back-off is over (its spare slot taken)."""
    now = m.clock.now_ms()
    out = []
    for rec in m.st.nodes.values():
        live = rec.is_store and rec.alive and rec.ready
        if live and rec.dataplane.refresh(now, m.dataplane_policy) == "probe":
            out.append(_plan(m, rec))
    return out


def _plan(m: Master, rec: NodeRecord) -> Probe:
    bare = Probe(rec.node_id, rec.epoch, rec.grpc_address)
    if not rec.free:
        return bare
    found = _source(m, rec.node_id)
    if found is None:
        healthy = (
            n
            for n in m.st.nodes.values()
            if n.is_store
            and n.alive
            and n.node_id != rec.node_id
            and m.reachable(n)
            and dataplane.usable(m, n)
        )
        found = next((f for n in healthy if (f := _source(m, n.node_id)) is not None), None)
    if found is None:
        return bare
    key, parent, src, checksum = found
    dst = rec.take(1)[0]
    src_address = m.st.nodes[src.node_id].data_address
    return Probe(rec.node_id, rec.epoch, rec.grpc_address, key, parent, src, src_address, dst, checksum)


def _source(m: Master, node_id: str) -> tuple[BlockKey, bytes, Location, int] | None:
    """Under the lock: a committed block with a replica on `node_id`: (key, parent, that replica,
    checksum)."""
    for ns, h in m.index.keys_on_node(node_id, limit=MAX_CANDIDATES):
        key = (bytes(ns), bytes(h))
        info = m.index.lookup(ns, h)
        meta = m.index.block_meta(ns, h)
        if info is None or meta is None:
            continue
        for loc in info.locations:
            if loc.node_id == node_id and not loc.local:
                return key, bytes(info.parent or b""), loc, meta[0]
    return None


def run(m: Master, probe: Probe) -> None:
    """Outside the lock: carry out `probe` and record its result (see the module docstring)."""
    ok, detail = True, "nothing to copy: on trial"
    if probe.key is not None and probe.src is not None and probe.dst is not None:
        detail = copy_into(
            m.stores,
            m.capabilities,
            probe.address,
            probe.src_data_address,
            probe.key,
            probe.parent,
            probe.src,
            probe.dst,
            probe.checksum,
            m.settings.default_write_lease_ms,
            m.leader_epoch,
        )
        ok = not detail
        if not ok and any(marker in detail for marker in INCONCLUSIVE):
            with m.lock:
                m.queue_free(probe.dst)
            log.info("probe of store %s inconclusive (%s): probing again", probe.node_id, detail)
            return
        detail = detail or f"copied block {probe.key[1].hex()[:16]} through its data plane"
    with m.lock:
        if probe.dst is not None:
            m.queue_free(probe.dst)  # the spare slot never enters the index
        rec = m.st.nodes.get(probe.node_id)
        if rec is None or rec.epoch != probe.epoch:
            return
        rec.dataplane.probe_done(ok, detail, m.clock.now_ms(), m.dataplane_policy)
        backoff_ms = rec.dataplane.backoff_ms
    if ok:
        log.info("store %s passed its data-plane probe (%s): on trial", probe.node_id, detail)
    else:
        log.warning(
            "store %s failed its data-plane probe (%s): not placed on or read from for %d ms",
            *(probe.node_id, detail, backoff_ms),
        )
