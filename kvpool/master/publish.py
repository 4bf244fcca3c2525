"""Two-phase publish: `reserve` places new blocks on store slots, `commit` makes written ones visible.

Placement (`kvpool.master.placement`): each new block gets `num_replicas` distinct placeable store nodes,
the ones with the most free slots first, in runs of consecutive blocks (capacity-aware spread); fewer only
when fewer nodes exist; stores silent or failing calls only as a last resort. When the nodes are full, the
master evicts on them (and waits for the stores' free acknowledgements) before answering
`ResourceExhausted`. A block becomes visible only after `Store.CommitSlots` succeeded for a replica
(the commit phase: `kvpool.master.commit`).
"""

from __future__ import annotations

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
    NotFound,
    ResourceExhausted,
    Unavailable,
    VersionFenced,
)
from kvpool.master import dataplane
from kvpool.master.commit import CommitPhase
from kvpool.master.core import check_hash
from kvpool.master.nodes import NodeRecord
from kvpool.master.placement import (
    Placed,
    Reservation,
    ReserveOutcome,
    place_runs,
)
from kvpool.master.stores import SlotOrder
from kvpool.types import BlockHash, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)
ADOPTION_WAIT_S = 2.0
"""How long a Reserve waits for a just-registered store's inventory to be adopted (see `_await_adoption`)."""

MAX_REPLICAS = 8


class Publisher(CommitPhase):
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
        owner: str = "",
    ) -> ReserveOutcome:
        """`flush_epoch`: the master's flush epoch when the writer's KV was computed (None: unchecked); a
        namespace invalidated since refuses the reserve with `VersionFenced`. `writer`: the writer's node
        id; a writer holding `max_leases_per_client` open reservations is refused (`ResourceExhausted`).
        `owner`: the caller's join token name (only that token commits or aborts the reservation)."""
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
                        ns, parent, hashes, costs, write_lease_ms, num_replicas, attempt, writer, owner
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
        owner: str = "",
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
        # a node cut off (silent, or its last call failed) or gray (writes failing) only as a last resort
        now_ms = m.clock.now_ms()
        fresh = [n for n in nodes if m.reachable(n) and n.dataplane.gray_until_ms <= now_ms]
        if len(fresh) >= max(k, 1):
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
        m.admission.admit(num_new)  # the index's memory limit: kvpool.master.admission
        shortfall = num_new * k - sum(min(len(n.free), num_new) for n in nodes)
        if shortfall <= 0:
            r = self._place(ns, parent, hashes, present, nodes, k, costs, write_lease_ms, num_replicas)
            self._track(r, writer)
            r.owner = owner
            return Placed(r, present, k)
        if attempt == 1:
            raise ResourceExhausted(f"no room for {num_new} blocks x {k} replicas (short {shortfall})")
        return self._make_room(nodes, num_new, shortfall, ns)

    def _lock_parent(self, ns: bytes, parent: bytes) -> bool:
        if not parent:
            return False
        self.m.index.lock(NamespaceId(ns), [BlockHash(parent)])
        return True

    def _check_ns(self, ns: bytes) -> None:
        if not self.m.namespaces.is_known(ns):
            raise NotFound(f"unknown namespace {ns.hex()}: register it first")
        if not self.m.namespaces.is_active(ns):
            raise VersionFenced(f"namespace {ns.hex()} is fenced: not of its model's active version")

    def _make_room(self, nodes: list[NodeRecord], num_new: int, shortfall: int, ns: bytes) -> list[str]:
        """Evict on the fullest nodes for `num_new` new blocks of `ns`, by tenants' shares
        (`TenantQuotas.evict_on_node`): the nodes whose frees to flush before the next attempt."""
        touched = []
        for n in sorted(nodes, key=lambda n: len(n.free)):
            if shortfall <= 0:
                break
            want = min(num_new - len(n.free), shortfall)
            if want <= 0:
                continue
            res = self.m.quotas.evict_on_node(self.m, n.node_id, want, ns)
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
        per_node: dict[str, int] = {}
        now_ms = self.m.clock.now_ms()
        locations = place_runs(
            present, nodes, k, self.m.settings.placement_run_blocks, now_ms=now_ms, per_node=per_node
        )
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
            now_ms + write_lease_ms,
            per_node=per_node,
        )
        self.reservations[rid] = r
        return r

    def _track(self, r: Reservation, writer: str) -> None:
        """Under the lock: count a new reservation for its writer and its tenant's quota (O(1))."""
        r.writer = writer
        self._by_writer[writer] = self._by_writer.get(writer, 0) + 1
        r.quota_tenant = self.m.quotas.group(self.m.namespaces.tenant_of(r.ns))
        self._requota(r)

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
