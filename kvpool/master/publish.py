"""Two-phase publish: `reserve` places new blocks on store slots, `commit` makes written ones visible.

Placement (`kvpool.master.placement`): each new block gets `num_replicas` distinct placeable store nodes,
the ones with the most free slots first, in runs of consecutive blocks (capacity-aware spread); fewer only
when fewer nodes exist; stores silent or failing calls only as a last resort. When the nodes are full, the
master evicts on them (and waits for the stores' free acknowledgements) before answering
`ResourceExhausted`. A block becomes visible only after `Store.CommitSlots` succeeded for a replica.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.errors import (
    DeadlineExceeded,
    InvalidArgument,
    KVPoolError,
    LeaseExpired,
    NotFound,
    ResourceExhausted,
    Unavailable,
    VersionFenced,
)
from kvpool.master import dataplane
from kvpool.master.core import BlockMeta, check_hash
from kvpool.master.nodes import NodeRecord
from kvpool.master.placement import (
    CommitBlock,
    Placed,
    Reservation,
    ReserveOutcome,
    new_replicas,
    place_runs,
)
from kvpool.master.stores import SlotOrder
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)
ADOPTION_WAIT_S = 2.0
"""How long a Reserve waits for a just-registered store's inventory to be adopted (see `_await_adoption`)."""

MAX_REPLICAS = 8
_DONE_KEEP = 4096


class Publisher:
    def __init__(self, master: Master) -> None:
        self.m = master
        self.reservations: dict[int, Reservation] = {}
        self.done: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.next_rid = 1
        self._by_writer: dict[str, int] = {}  # writer_node_id -> its live reservations (only > 0)

    # ---- reserve ----------------------------------------------------------------------------------
    def reserve(
        self,
        ns: bytes,
        parent: bytes,
        hashes: Sequence[bytes],
        *,
        num_replicas: int,
        block_nbytes: int,
        costs: Sequence[float],
        write_lease_ms: int,
        flush_epoch: int | None = None,
        writer: str = "",
    ) -> ReserveOutcome:
        """`flush_epoch`: the master's flush epoch when the writer's KV was computed (None: unchecked); a
        namespace invalidated since refuses the reserve with `VersionFenced`. `writer`: the writer's node
        id; a writer holding `max_leases_per_client` open reservations is refused (`ResourceExhausted`)."""
        m, s = self.m, self.m.settings
        check_hash(ns, "namespace")
        if parent:
            check_hash(parent, "parent_hash")
        if not hashes:
            raise InvalidArgument("block_hashes is empty")
        if len(hashes) > s.max_batch_blocks:
            raise InvalidArgument(f"{len(hashes)} blocks exceed the batch limit {s.max_batch_blocks}")
        for i, h in enumerate(hashes):
            check_hash(h, f"block_hashes[{i}]")
        if len(set(hashes)) != len(hashes) or parent in hashes:
            raise InvalidArgument("block_hashes repeats a hash")
        num_replicas = num_replicas or s.replicas
        if not 1 <= num_replicas <= MAX_REPLICAS:
            raise InvalidArgument(f"num_replicas must be in [1, {MAX_REPLICAS}]")
        if block_nbytes and block_nbytes != m.layout.block_nbytes:
            raise InvalidArgument(f"block_nbytes {block_nbytes} != the pool's {m.layout.block_nbytes}")
        if costs and len(costs) != len(hashes):
            raise InvalidArgument(f"{len(costs)} recompute costs for {len(hashes)} blocks")
        if any(not math.isfinite(c) or c < 0 for c in costs):
            raise InvalidArgument("recompute_cost_s must be finite and >= 0")
        write_lease_ms = write_lease_ms or s.default_write_lease_ms
        if not 0 < write_lease_ms <= s.max_write_lease_ms:
            raise InvalidArgument(f"write_lease_ms must be in (0, {s.max_write_lease_ms}]")
        self._await_adoption()
        placed: Placed | None = None
        for attempt in range(2):
            with m.lock:
                self._check_ns(ns)
                if flush_epoch is not None and flush_epoch != m.namespaces.flush_epoch:
                    raise VersionFenced(
                        f"a namespace was invalidated since this KV was computed (flush epoch {flush_epoch}, "
                        f"now {m.namespaces.flush_epoch}): not publishing it"
                    )
                if parent and m.index.lookup(NamespaceId(ns), BlockHash(parent)) is None:
                    raise NotFound(f"parent block {parent.hex()} is not in the pool")
                # pin the parent chain so that making room below cannot evict it before the commit
                locked = self._lock_parent(ns, parent)
                try:
                    step = self._reserve_locked(
                        ns, parent, hashes, costs, write_lease_ms, num_replicas, attempt, writer
                    )
                except BaseException:
                    self._unlock_parent(ns, parent, locked)
                    raise
                if isinstance(step, Placed):
                    step.r.parent_locked = locked
                    placed = step
                    break
                self._unlock_parent(ns, parent, locked)
                if isinstance(step, ReserveOutcome):
                    return step
                evict_on = step
            for node_id in evict_on:
                m.flush_frees(only=node_id)
        if placed is None:  # unreachable: the last attempt places or raises
            raise ResourceExhausted("no room after making room")
        r = placed.r
        self._send_reservations(r, write_lease_ms)
        with m.lock:
            nodes_used = {loc.node_id for locs in r.locations for loc in locs}
            records = [m.st.nodes[n] for n in nodes_used if n in m.st.nodes]
        return ReserveOutcome(r.rid, r.hashes, placed.present, r.locations, write_lease_ms, records, placed.k)

    def _await_adoption(self) -> None:
        """A store that just registered is placeable once its inventory is adopted (the next maintenance
        tick). When no store is placeable yet but one registered less than `ADOPTION_WAIT_S` ago is waiting
        for that (no failed inventory read), wait for it rather than refuse the first publish of a fresh
        cluster; at most `ADOPTION_WAIT_S`."""
        m = self.m
        deadline = time.monotonic() + ADOPTION_WAIT_S
        while time.monotonic() < deadline:
            with m.lock:
                now = m.clock.now_ms()
                stores = [n for n in m.st.nodes.values() if n.is_store and n.alive and not n.draining]
                pending = [
                    n
                    for n in stores
                    if not n.ready
                    and n.adopt_failures == 0
                    and now - n.registered_ms <= ADOPTION_WAIT_S * 1000
                ]
                if not pending or any(n.ready for n in stores):
                    return
            m.wake.set()  # adopt now, not at the next tick
            time.sleep(0.02)

    def _reserve_locked(
        self,
        ns: bytes,
        parent: bytes,
        hashes: Sequence[bytes],
        costs: Sequence[float],
        write_lease_ms: int,
        num_replicas: int,
        attempt: int,
        writer: str = "",
    ) -> Placed | ReserveOutcome | list[str]:
        """Under the lock: place the new blocks, or answer that all are present, or make room and return
        the nodes whose frees to flush before the next attempt (`ResourceExhausted` on the last one)."""
        m = self.m
        present = [m.index.lookup(NamespaceId(ns), BlockHash(h)) is not None for h in hashes]
        num_new = len(hashes) - sum(present)
        if num_new == 0:
            return ReserveOutcome(0, list(hashes), present, [[] for _ in hashes], write_lease_ms, [], 0)
        nodes = [n for n in m.st.nodes.values() if n.placeable and dataplane.usable(m, n)]
        k = min(num_replicas, len(nodes))
        fresh = [n for n in nodes if m.reachable(n)]
        if len(fresh) >= max(k, 1):  # a node cut off (silent, or its last call failed) only as a last resort
            nodes = fresh
        if k == 0:
            raise ResourceExhausted("no store node can take blocks")
        cap = m.settings.max_leases_per_client
        if self._by_writer.get(writer, 0) >= cap:
            raise ResourceExhausted(
                f"writer {writer!r} holds {cap} open reservations (write leases): the master's "
                "max_leases_per_client; commit or abort some first"
            )
        m.quotas.make_room(m, ns, num_new, hashes)  # per-tenant pool quota: kvpool.master.quotas
        shortfall = num_new * k - sum(min(len(n.free), num_new) for n in nodes)
        if shortfall <= 0:
            r = self._place(ns, parent, hashes, present, nodes, k, costs, write_lease_ms, num_replicas)
            self._track(r, writer)
            return Placed(r, present, k)
        if attempt == 1:
            raise ResourceExhausted(f"no room for {num_new} blocks x {k} replicas (short {shortfall})")
        return self._make_room(nodes, num_new, shortfall)

    def _lock_parent(self, ns: bytes, parent: bytes) -> bool:
        if not parent:
            return False
        self.m.index.lock(NamespaceId(ns), [BlockHash(parent)])
        return True

    def _unlock_parent(self, ns: bytes, parent: bytes | None, locked: bool) -> None:
        if not locked or not parent:
            return
        # the parent may have been dropped meanwhile (its node died): then there is nothing to unpin
        with contextlib.suppress(KVPoolError):
            self.m.index.unlock(NamespaceId(ns), [BlockHash(parent)])

    def _check_ns(self, ns: bytes) -> None:
        if not self.m.namespaces.is_known(ns):
            raise NotFound(f"unknown namespace {ns.hex()}: register it first")
        if not self.m.namespaces.is_active(ns):
            raise VersionFenced(f"namespace {ns.hex()} is fenced: not of its model's active version")

    def _make_room(self, nodes: list[NodeRecord], num_new: int, shortfall: int) -> list[str]:
        touched = []
        for n in sorted(nodes, key=lambda n: len(n.free)):
            if shortfall <= 0:
                break
            want = min(num_new - len(n.free), shortfall)
            if want <= 0:
                continue
            res = self.m.index.evict(want, node_id=n.node_id)
            self.m.counters.num_evictions += len([d for d in res.dropped if d.reason != "replica"])
            self.m.on_dropped(res.dropped)
            shortfall -= res.num_freed_on_node
            touched.append(n.node_id)
        return touched

    def _place(
        self,
        ns: bytes,
        parent: bytes,
        hashes: Sequence[bytes],
        present: list[bool],
        nodes: list[NodeRecord],
        k: int,
        costs: Sequence[float],
        write_lease_ms: int,
        target: int,
    ) -> Reservation:
        locations = place_runs(present, nodes, k, self.m.settings.placement_run_blocks)
        rid = self.next_rid
        self.next_rid += 1
        r = Reservation(
            rid,
            ns,
            parent or None,
            list(hashes),
            locations,
            list(costs) or [0.0] * len(hashes),
            target,
            self.m.clock.now_ms() + write_lease_ms,
        )
        self.reservations[rid] = r
        return r

    def _track(self, r: Reservation, writer: str) -> None:
        """Under the lock: count a new reservation for its writer and its tenant's quota (O(1))."""
        r.writer = writer
        self._by_writer[writer] = self._by_writer.get(writer, 0) + 1
        r.quota_tenant = self.m.quotas.group(self.m.namespaces.tenant_of(r.ns))
        self._requota(r)

    def _requota(self, r: Reservation) -> None:
        """Under the lock: recount the reservation's new blocks that still hold a slot (its quota usage)."""
        n = sum(1 for locs in r.locations if locs) if r.rid in self.reservations else 0
        self.m.quotas.note_reserved(r.quota_tenant, n - r.quota_blocks)
        r.quota_blocks = n

    def _send_reservations(self, r: Reservation, write_lease_ms: int) -> None:
        m = self.m
        by_node: dict[str, list[SlotOrder]] = {}
        prev = r.parent or b""
        for h, locs in zip(r.hashes, r.locations, strict=True):
            for loc in locs:
                by_node.setdefault(loc.node_id, []).append(SlotOrder(loc.slot, loc.generation, r.ns, h, prev))
            prev = h
        failed = []
        for node_id, orders in by_node.items():
            with m.lock:
                address = m.st.nodes[node_id].grpc_address
            try:
                m.stores.reserve(address, orders, write_lease_ms)
            except (Unavailable, DeadlineExceeded) as exc:  # it did not answer: no placements there a while
                m.mark_unreachable(node_id, exc)
                failed.append(node_id)
            except KVPoolError as exc:  # it answered and refused these slots (say one an earlier master
                # reserved before it died): this reservation goes elsewhere, the store keeps taking blocks
                log.warning("store %s refused a reservation: %s", node_id, exc)
                failed.append(node_id)
        if not failed:
            return
        with m.lock:
            for locs in r.locations:
                for loc in [x for x in locs if x.node_id in failed]:
                    locs.remove(loc)
                    m.queue_free(loc)
            self._requota(r)
            if any(
                not locs for locs, h in zip(r.locations, r.hashes, strict=True) if not self._present(r, h)
            ):
                self._drop(r)
                raise Unavailable(f"store nodes {failed} refused the reservation")

    def _present(self, r: Reservation, h: bytes) -> bool:
        return self.m.index.lookup(NamespaceId(r.ns), BlockHash(h)) is not None

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
    def commit(self, rid: int, blocks: Sequence[CommitBlock]) -> tuple[int, int]:
        """Make the written blocks visible; idempotent (a repeat returns the first answer)."""
        m = self.m
        if rid <= 0:
            raise InvalidArgument("reservation_id must be > 0")
        with m.lock:
            if rid in self.done:
                return self.done[rid]
            r = self.reservations.get(rid)
            if r is None:
                raise NotFound(f"no reservation {rid} (expired, aborted or never made)")
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
        for node_id, node_locs in by_node.items():
            try:
                errs = m.stores.commit(addresses[node_id], node_locs)
            except (KVPoolError, KeyError) as exc:
                m.mark_unreachable(node_id, exc)
                continue
            ok.update(loc for loc in node_locs if not errs.get((loc.slot, loc.generation)))
        with m.lock:
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
        for locs in r.locations:
            for loc in locs:
                if loc not in used:
                    m.queue_free(loc)
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
            for h, locs in zip(chain, chain_locs, strict=True):
                key = (r.ns, bytes(h))
                m.note_replicas(r.ns, bytes(h), locs)
                if key not in m.st.meta and locs:
                    m.st.meta[key] = BlockMeta(written[bytes(h)][0], r.target)
                info = m.index.lookup(ns, h)
                if info is not None and r.target > 1 and len(info.locations) < r.target:
                    m.st.under_replicated.add(key)
            result = (res.num_inserted, res.num_existing)
        self.done[r.rid] = result
        while len(self.done) > _DONE_KEEP:
            self.done.popitem(last=False)
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

    def abort(self, rid: int) -> None:
        """Free a reservation's slots; idempotent for reservations already finished."""
        if rid <= 0:
            raise InvalidArgument("reservation_id must be > 0")
        with self.m.lock:
            if rid >= self.next_rid:
                raise NotFound(f"no reservation {rid}")
            r = self.reservations.get(rid)
            if r is None:
                return
            if r.committing:
                r.aborted = True
                return
            self._drop(r)
            self.done[rid] = (0, 0)

    def expire(self, now_ms: int) -> int:
        """Under the lock: drop reservations past their write lease (their slots are freed)."""
        late = [r for r in self.reservations.values() if not r.committing and r.expiry_ms < now_ms]
        for r in late:
            self._drop(r)
        return len(late)

    def forget_node(self, node_id: str) -> None:
        """Under the lock: a node is gone; its reserved slots vanish with it."""
        for r in self.reservations.values():
            for locs in r.locations:
                locs[:] = [loc for loc in locs if loc.node_id != node_id]
            self._requota(r)

    def num_open(self, writer: str) -> int:
        """Open reservations (write leases) of `writer`."""
        return self._by_writer.get(writer, 0)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(locs) for r in self.reservations.values() for locs in r.locations)
