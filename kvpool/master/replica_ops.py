"""Replica removals reported to the master: admin removes, bad replicas seen by readers (B18), and node-local
tier events (B22). Each validates its input and runs under the master's lock."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import FailedPrecondition, NotFound
from kvpool.index.results import DroppedBlock
from kvpool.master import dataplane, node_death
from kvpool.master.core import check_hash
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)


def remove_blocks(m: Master, ns: bytes, block_hashes: Sequence[bytes], force: bool) -> int:
    check_hash(ns, "namespace")
    for i, h in enumerate(block_hashes):
        check_hash(h, f"block_hashes[{i}]")
    num = 0
    with m.lock:
        for h in block_hashes:
            info = m.index.lookup(NamespaceId(ns), BlockHash(h))
            if info is None:
                continue
            if info.num_leases and not force:
                raise FailedPrecondition(f"block {h.hex()} is leased (use force to break the lease)")
            if info.num_leases:
                log.warning("forced remove of leased block %s breaks its lease", h.hex())
            dropped: list[DroppedBlock] = []
            for loc in info.locations:
                try:
                    dropped.extend(m.index.remove_location(NamespaceId(ns), BlockHash(h), loc))
                except NotFound:
                    continue
                if not loc.local:
                    m.queue_free(loc)
            m.on_dropped(dropped)
            num += sum(1 for d in dropped if d.reason != "replica")
    return num


def report_bad_replica(m: Master, ns: bytes, block_hash: bytes, loc: Location, reason: str) -> None:
    """Drop one replica a reader could not read, so the next lookup does not offer it (B18). Bytes that
    failed their checksum also fail the store's data plane (`kvpool.master.dataplane`)."""
    check_hash(ns, "namespace")
    check_hash(block_hash, "block_hash")
    with m.lock:
        rec = m.st.nodes.get(loc.node_id)
        if rec is not None and rec.is_store and not loc.local and "checksum" in reason.lower():
            dataplane.report_failure(m, loc.node_id, rec.epoch, "checksum", reason)
        try:
            dropped = m.index.remove_location(NamespaceId(ns), BlockHash(block_hash), loc)
        except NotFound:
            return  # already gone: idempotent
        log.warning("bad replica %s of %s: %s", loc, block_hash.hex(), reason)
        m.counters.num_bad_replicas += 1
        if not loc.local:
            m.queue_free(loc)
        m.on_dropped(dropped)
        if not dropped and m.index.block_meta(NamespaceId(ns), BlockHash(block_hash)) is not None:
            m.st.under_replicated.add((ns, block_hash))
        m.wake.set()


def report_local(
    m: Master,
    node_id: str,
    epoch: int,
    ns: bytes,
    stored: Sequence[bytes],
    removed: Sequence[bytes],
    cleared: bool,
) -> None:
    """Node-local tier events become `local` locations; `cleared` purges the node's (B22)."""
    if ns or stored or removed:
        check_hash(ns, "namespace")
    for i, h in enumerate([*stored, *removed]):
        check_hash(h, f"block hash {i}")
    with m.lock:
        rec = m.node(node_id)
        if rec.epoch != epoch or not rec.alive:
            raise FailedPrecondition(f"node {node_id} epoch {epoch} is not current: re-register")
        if rec.is_store:
            raise FailedPrecondition("store nodes have no local tier")
        if cleared and m.index.begin_remove_node(node_id) is not None:
            node_death.finish_node_removals(m)  # (every step now, under the lock: a local tier is small)
        loc = Location(node_id, 0, 0, local=True)
        for h in removed:
            try:
                m.on_dropped(m.index.remove_location(NamespaceId(ns), BlockHash(h), loc))
            except NotFound:
                continue
        for h in stored:
            try:
                m.index.add_location(NamespaceId(ns), BlockHash(h), loc)
            except NotFound:
                continue  # not in the pool index: nothing to annotate
