"""The commit phase of two-phase publish and the release of reservations (`Publisher` runs it).

`commit` makes the written replicas of a reservation visible in the index (after `Store.CommitSlots`
succeeded for them), `abort` and expiry free its slots; a namespace invalidated or fenced meanwhile refuses
the commit (`VersionFenced`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import (
    InvalidArgument,
    KVPoolError,
    LeaseExpired,
    NotFound,
    PermissionDenied,
    VersionFenced,
)
from kvpool.master import dataplane
from kvpool.master.placement import CommitBlock, Reservation, new_replicas
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

_DONE_KEEP = 4096


class CommitPhase:
    """Commit, abort and the release of a reservation's slots, over the publisher's open reservations."""

    m: Master
    reservations: dict[int, Reservation]
    done: OrderedDict[int, tuple[int, int]]
    next_rid: int
    _by_writer: dict[str, int]

    def _unlock_parent(self, ns: bytes, parent: bytes | None, locked: bool) -> None:
        if not locked or not parent:
            return
        # the parent may have been dropped meanwhile (its node died): then there is nothing to unpin
        with contextlib.suppress(KVPoolError):
            self.m.index.unlock(NamespaceId(ns), [BlockHash(parent)])

    def _requota(self, r: Reservation) -> None:
        """Under the lock: recount the reservation's new blocks that still hold a slot (its quota usage)."""
        n = sum(1 for locs in r.locations if locs) if r.rid in self.reservations else 0
        self.m.quotas.note_reserved(r.quota_tenant, n - r.quota_blocks)
        r.quota_blocks = n

    def _drop(self, r: Reservation) -> None:
        """Under the lock: forget a reservation and free every slot it holds."""
        self._drop_quiet(r)
        for locs in r.locations:
            for loc in locs:
                self.m.queue_free(loc)
        self.m.wake.set()

    def flush(self, ns: bytes) -> None:
        """Namespace `ns` was invalidated: its open reservations will be refused at commit. Lock held."""
        for r in self.reservations.values():
            if r.ns == ns:
                r.flushed = True

    # ---- commit / abort ---------------------------------------------------------------------------
    def commit(self, rid: int, blocks: Sequence[CommitBlock], *, owner: str | None = None) -> tuple[int, int]:
        """Make the written blocks visible; idempotent (a repeat returns the first answer). `owner` (a
        secured master's caller, None: any): `PermissionDenied` unless that token made the reservation."""
        m = self.m
        if rid <= 0:
            raise InvalidArgument("reservation_id must be > 0")
        with m.lock:
            if rid in self.done:
                return self.done[rid]
            r = self.reservations.get(rid)
            if r is None:
                raise NotFound(f"no reservation {rid} (expired, aborted or never made)")
            _check_owner(r, rid, owner)
            if r.committing:
                raise InvalidArgument(f"reservation {rid} is being committed")
            written: dict[bytes, tuple[int, set[Location]]] = {}
            index_of = {h: i for i, h in enumerate(r.hashes)}
            for b in blocks:
                i = index_of.get(b.block_hash)
                if i is None:
                    raise InvalidArgument(f"block {b.block_hash.hex()} is not in reservation {rid}")
                bad = [loc for loc in b.written if loc not in r.locations[i]]
                if bad:
                    raise InvalidArgument(f"block {b.block_hash.hex()}: {bad[0]} was not reserved for it")
                written[b.block_hash] = (b.checksum, set(b.written))
            if not m.namespaces.is_active(r.ns) or r.flushed:
                self._drop(r)
                why = "invalidated after this reservation" if r.flushed else "fenced"
                raise VersionFenced(f"namespace {r.ns.hex()} was {why}: commit refused")
            if m.clock.now_ms() > r.expiry_ms:
                self._drop(r)
                raise LeaseExpired(f"write lease of reservation {rid} expired")
            r.committing = True
            by_node: dict[str, list[Location]] = {}
            for _, wlocs in written.values():
                for loc in wlocs:
                    by_node.setdefault(loc.node_id, []).append(loc)
            addresses = {n: m.st.nodes[n].grpc_address for n in by_node if n in m.st.nodes}
        ok: set[Location] = set()
        ok_per_node: dict[str, int] = {}  # written and committed, per node (gray failures: dataplane)
        for node_id, node_locs in by_node.items():
            try:
                errs = m.stores.commit(addresses[node_id], node_locs)
            except (KVPoolError, KeyError) as exc:
                m.mark_unreachable(node_id, exc)
                continue
            before = len(ok)
            ok.update(loc for loc in node_locs if not errs.get((loc.slot, loc.generation)))
            ok_per_node[node_id] = len(ok) - before
        with m.lock:
            dataplane.note_commit(m, r.per_node, ok_per_node)
            return self._finish(r, written, ok)

    def _finish(
        self, r: Reservation, written: dict[bytes, tuple[int, set[Location]]], ok: set[Location]
    ) -> tuple[int, int]:
        m = self.m
        self._drop_quiet(r)
        if r.aborted or r.flushed or not m.namespaces.is_active(r.ns):
            self._free_all(r)
            raise VersionFenced(f"namespace {r.ns.hex()} was fenced or invalidated during the commit")
        ns = NamespaceId(r.ns)
        chain: list[BlockHash] = []
        chain_locs: list[list[Location]] = []
        for i, h in enumerate(r.hashes):
            got = [loc for loc in r.locations[i] if loc in ok and loc in written.get(h, (0, set()))[1]]
            info = m.index.lookup(ns, BlockHash(h))
            if info is not None:  # committed meanwhile by another writer: only replicas it still lacks
                got = new_replicas(info.locations, got, r.target)
            elif not got:
                break
            chain.append(BlockHash(h))
            chain_locs.append(got)
        used = {loc for locs in chain_locs for loc in locs}
        # maintenance is woken only for work this commit left it (frees to send, replicas to add): a wake
        # per commit would run a tick per commit under a busy publish (its next tick sees the rest)
        wake = False
        for locs in r.locations:
            for loc in locs:
                if loc not in used:
                    m.queue_free(loc)
                    wake = True
        if not chain:
            result = (0, 0)
        else:
            try:
                res = m.index.insert(
                    ns,
                    chain,
                    parent=BlockHash(r.parent) if r.parent else None,
                    locations=chain_locs,
                    size_bytes=m.layout.block_nbytes,
                    recompute_cost_s=r.costs[: len(chain)],
                )
            except KVPoolError:
                for loc in used:
                    m.queue_free(loc)
                m.wake.set()
                raise
            placed = [h for h, locs in zip(chain, chain_locs, strict=True) if locs]
            m.index.set_block_meta(ns, placed, [written[bytes(h)][0] for h in placed], r.target)
            if r.target > 1:
                for h in chain:
                    info = m.index.lookup(ns, h)
                    if info is not None and len(info.locations) < r.target:
                        m.st.under_replicated.add((r.ns, bytes(h)))
                        wake = True
            result = (res.num_inserted, res.num_existing)
        self.done[r.rid] = result
        while len(self.done) > _DONE_KEEP:
            self.done.popitem(last=False)
        if wake:
            m.wake.set()
        return result

    def _drop_quiet(self, r: Reservation) -> None:
        if self.reservations.pop(r.rid, None) is not None:
            self._requota(r)  # gives its blocks back to its tenant's quota
            n = self._by_writer[r.writer] - 1
            if n:
                self._by_writer[r.writer] = n
            else:
                del self._by_writer[r.writer]
        self._unlock_parent(r.ns, r.parent, r.parent_locked)
        r.parent_locked = False

    def _free_all(self, r: Reservation) -> None:
        for locs in r.locations:
            for loc in locs:
                self.m.queue_free(loc)
        self.m.wake.set()

    def abort(self, rid: int, *, owner: str | None = None) -> None:
        """Free a reservation's slots; idempotent for reservations already finished. `owner`: as `commit`'s."""
        if rid <= 0:
            raise InvalidArgument("reservation_id must be > 0")
        with self.m.lock:
            if rid >= self.next_rid:
                raise NotFound(f"no reservation {rid}")
            r = self.reservations.get(rid)
            if r is None:
                return
            _check_owner(r, rid, owner)
            if r.committing:
                r.aborted = True
                return
            self._drop(r)
            self.done[rid] = (0, 0)


def _check_owner(r: Reservation, rid: int, owner: str | None) -> None:
    if owner is not None and r.owner != owner:
        raise PermissionDenied(
            f"reservation {rid} was made by another member: only its maker commits or aborts it"
        )
