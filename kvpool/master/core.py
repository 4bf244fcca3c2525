"""The master's state and logic, proto-free and thread-safe (one lock; store calls happen outside it).

`Master` owns the radix index, the node registry, namespaces and counters. Publishing lives in
`publish.py`, background work (dead nodes, watermarks, frees, re-replication, rebuild) in `maintenance.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.capability import Capabilities, process_capabilities
from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvpool.index.columns import rows_for_bytes
from kvpool.index.radix import RadixIndex
from kvpool.index.results import DroppedBlock, MatchResult, Survivors
from kvpool.master import bounds, dataplane, node_death
from kvpool.master.admission import Admission
from kvpool.master.adoption import AdoptionStats
from kvpool.master.free_slots import FreeOrders
from kvpool.master.members import Membership
from kvpool.master.namespaces import NamespaceRegistry
from kvpool.master.nodes import NodeRecord
from kvpool.master.quotas import TenantQuotas
from kvpool.master.registry import NodeRegistry
from kvpool.master.settings import MasterSettings
from kvpool.master.stores import StoreCalls
from kvpool.types import HASH_NBYTES, BlockHash, Clock, Location, MonotonicClock, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.ha.election import Election

log = logging.getLogger(__name__)
MAX_PROMPT_TOKENS = (1 << 32) - 1
MAX_RELEASE_BATCH = 1024
"""Most lease ids one `ReleaseLeases` call may end."""
"""The most prompt tokens one match may report (the hit-rate denominator; keeps counters in uint64)."""

BlockKey = tuple[bytes, bytes]  # (namespace, block hash)
FREE_BATCH_SLOTS = 4096
"""Slots per `FreeSlots` call (a store refuses more than its max_batch_slots, 8192 by default, in one)."""


@dataclass
class Counters:
    num_match_requests: int = 0
    requested_tokens: int = 0
    hit_tokens: int = 0
    requested_blocks: int = 0
    hit_blocks: int = 0
    num_rereplications: int = 0
    num_evictions: int = 0
    num_bad_replicas: int = 0


@dataclass
class MasterState:
    """Mutable bookkeeping beside the index (all under `Master.lock`)."""

    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    free_q: dict[str, FreeOrders] = field(default_factory=dict)  # node -> slots to order freed (columns)
    to_adopt: set[str] = field(default_factory=set)  # store nodes whose inventory must be read
    under_replicated: set[BlockKey] = field(default_factory=set)
    under_replicated_cols: list[Survivors] = field(default_factory=list)
    """Blocks that lost a replica to a node death, as columns (`node_death.take_under_replicated`)."""


def check_hash(value: bytes, what: str) -> bytes:
    if len(value) != HASH_NBYTES:
        raise InvalidArgument(f"{what} must be {HASH_NBYTES} bytes, got {len(value)}")
    return value


class Master(NodeRegistry):
    """See the module docstring. Every public method validates its input and raises `kvpool.errors`."""

    def __init__(
        self,
        settings: MasterSettings,
        *,
        clock: Clock | None = None,
        stores: StoreCalls | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.settings = settings
        self.capabilities = capabilities or process_capabilities()
        """Signs the data-plane capabilities of leases and reservations (None: off, no cluster secret)."""
        self.layout = settings.kv_layout
        self.clock = clock or MonotonicClock()
        self.members = Membership(
            self.capabilities,
            tokens_file=settings.join_tokens_file,
            clock=self.clock,
            challenge_ttl_ms=settings.challenge_ttl_ms,
            max_spent_challenges_per_node=settings.max_spent_challenges_per_node,
        )
        """Who may join (`kvpool.master.members`): secured exactly when capabilities are on."""
        self.lock = threading.RLock()
        # rows reserved up to the memory limit (not committed): adopting or publishing never copies them
        self.index = RadixIndex(
            clock=self.clock, policy=settings.policy, max_blocks=rows_for_bytes(settings.max_index_bytes)
        )
        self.namespaces = NamespaceRegistry(self.layout, bounds.namespace_limits(settings))
        self.quotas = TenantQuotas.from_file(settings.tenants, settings.tenant_salt_key_file)
        self.st = MasterState()
        self.admission = Admission(self)
        self.adoption_stats = AdoptionStats()
        """Figures of the inventories adopted (`kvpool.master.adoption`, run by the maintenance thread)."""
        self.counters = Counters()
        self.dataplane_policy = dataplane.DataPlanePolicy.from_settings(settings)
        self.stores = stores or StoreCalls(
            settings.store_timeout_s,
            self.capabilities,
            inventory_batch_blocks=settings.inventory_batch_blocks,
        )
        self.election: Election | None = None
        """With etcd (`MasterSettings.etcd`): this master's leader election (`kvpool.master.ha`)."""
        self.leader_epoch = 0
        """The epoch this master last won leadership at (0: a single master): on its capabilities (and, via
        `stores.leader_epoch`, on its store orders)."""
        self.master_epoch = time.time_ns()
        self.fresh_generation = self.master_epoch // 1000
        """Generation given to free slots of an adopted store: above any generation an earlier master
        used (stores accept a reservation that jumps a free slot's generation forward)."""
        self.started_ms = self.clock.now_ms()
        self.wake = threading.Event()
        from kvpool.master.publish import Publisher

        self.publisher = Publisher(self)
        self.lock_holds = node_death.LockHolds()
        """Longest holds of `lock` by a node death and by a maintenance tick (`node_death`, metrics)."""

    def _forget_node(self, rec: NodeRecord) -> None:
        """Drop everything a node had in the index (dead, or restarted under a new epoch). Under the lock,
        O(1) in the node's blocks: its replicas are hidden at once and leave in steps run with the lock
        released between them (`node_death`). A node registering again while its removal runs gets no
        replica in the index until the removal ends (the index refuses them; the maintenance tick ends
        removals before it adopts inventories)."""
        t0 = time.perf_counter()
        rec.alive = False
        self.index.begin_remove_node(rec.node_id)  # (already dying: its running removal goes on)
        self.st.free_q.pop(rec.node_id, None)
        self.st.to_adopt.discard(rec.node_id)
        if rec.is_store:
            self.publisher.forget_node(rec.node_id)
        self.lock_holds.death_hold(time.perf_counter() - t0)
        if not self.index.node_removals:  # nothing of it in the index: the death is over already
            self.lock_holds.death_done()
        self.wake.set()

    def declare_dead(self, rec: NodeRecord) -> None:
        log.warning("node %s missed heartbeats: dead, its replicas leave the index", rec.node_id)
        self._forget_node(rec)

    # ---- drops and frees --------------------------------------------------------------------------
    def on_dropped(self, dropped: Sequence[DroppedBlock]) -> None:
        """Blocks (or replicas) left the index: queue a free order for each store slot they held."""
        for d in dropped:
            for loc in d.locations:
                if not loc.local:
                    self.queue_free(loc)
        if dropped:
            self.wake.set()

    def queue_free(self, loc: Location) -> None:
        rec = self.st.nodes.get(loc.node_id)
        if rec is not None and rec.alive and rec.is_store:
            self.free_orders(loc.node_id).add_one(loc.slot, loc.generation)

    def free_orders(self, node_id: str) -> FreeOrders:
        """Under the lock: the free orders queued for `node_id` (created empty)."""
        q = self.st.free_q.get(node_id)
        if q is None:
            q = self.st.free_q[node_id] = FreeOrders()
        return q

    def flush_frees(self, only: str | None = None) -> int:
        """Send queued free orders (outside the lock); acknowledged slots return to the free lists."""
        with self.lock:
            if only is None:
                work, self.st.free_q = self.st.free_q, {}
            else:
                work = {only: self.st.free_q.pop(only, FreeOrders())}
            for n in [n for n in work if work[n] and not self.reachable(self.st.nodes[n])]:
                self.free_orders(n).extend(work.pop(n))  # kept for when it answers again
            targets = {n: (self.st.nodes[n].grpc_address, self.st.nodes[n].epoch) for n in work if work[n]}
        done = 0
        for node_id, (address, epoch) in targets.items():
            slots_col, gens_col = work[node_id].columns()
            try:
                answers = [
                    a
                    for lo in range(0, len(slots_col), FREE_BATCH_SLOTS)
                    for a in self.stores.free(
                        address,
                        list(
                            zip(
                                slots_col[lo : lo + FREE_BATCH_SLOTS].tolist(),
                                gens_col[lo : lo + FREE_BATCH_SLOTS].tolist(),
                                strict=True,
                            )
                        ),
                    )
                ]
                failed = False
            except Exception as exc:  # noqa: BLE001 - a store down: retried while it lives
                self.mark_unreachable(node_id, exc)
                answers, failed = [], True
            with self.lock:
                rec = self.st.nodes.get(node_id)
                if rec is None or rec.epoch != epoch or not rec.alive:
                    continue
                if failed:
                    self.free_orders(node_id).extend(work[node_id])
                    continue
                for slot, new_gen, deferred in answers:
                    if deferred:
                        rec.free.mark_pending(slot, new_gen)
                    else:
                        rec.give_back(slot, new_gen)
                        done += 1
        return done

    # ---- namespaces -------------------------------------------------------------------------------
    def register_namespace(
        self,
        *,
        model_id: str,
        weights_version: str,
        layout_fingerprint: str,
        cache_salt: str,
        adapter_digest: str,
        extra: dict[str, str],
    ) -> tuple[bytes, str]:
        with self.lock:
            record, _ = self.namespaces.register(
                model_id=model_id,
                weights_version=weights_version,
                layout_fingerprint=layout_fingerprint,
                cache_salt=cache_salt,
                adapter_digest=adapter_digest,
                extra=extra,
                now_ms=self.clock.now_ms(),
            )
            if self.namespaces.is_active(record.digest):
                self._index_register(record.digest)
            self.wake.set()  # blocks from store inventories may now be claimed
            return bytes(record.digest), self.namespaces.active_version(model_id)

    def set_model_version(
        self, model_id: str, weights_version: str, *, force: bool = False
    ) -> tuple[str, int, int]:
        """Activate a version: the others' namespaces become unreachable at once (B28). Returns (previous
        version, namespaces made inactive, their blocks now unreachable).

        Refused with `FailedPrecondition` (naming the model, the version and the versions in use) when
        no registered namespace and no live engine of the model uses `weights_version` and it is not
        already active, since a typo would fence the live version; `force` sets it anyway (ahead of a
        rollout, to fence the old KV before the new weights serve)."""
        if not model_id or not weights_version:
            raise InvalidArgument("model_id and weights_version must be non-empty")
        with self.lock:
            if not force and weights_version != self.namespaces.active_version(model_id):
                in_use = self._versions_in_use(model_id)
                if weights_version not in in_use:
                    raise FailedPrecondition(
                        f"no registered namespace or live node of model {model_id!r} uses version "
                        f"{weights_version!r} (in use: {', '.join(sorted(in_use)) or 'none'}); setting it would leave "
                        "nothing of the model served (a typo?): give force (kvpool admin set-version --force) "
                        "to set it anyway"
                    )
            previous, off, on = self.namespaces.set_version(model_id, weights_version)
            blocks = sum(self.index.num_blocks_in(NamespaceId(d)) for d in off)
            for digest in off:
                self.index.invalidate_namespace(NamespaceId(digest))
            for digest in on:
                self._index_register(digest)
            self.wake.set()
            log.info(
                "model %s: version %r -> %r (%d namespaces, %d blocks off%s)",
                model_id,
                previous,
                weights_version,
                len(off),
                blocks,
                ", forced" if force else "",
            )
            return previous, len(off), blocks

    def _versions_in_use(self, model_id: str) -> set[str]:
        """Under the lock: the weights versions of `model_id` that a registered namespace or a live
        engine (its registered `engine_namespace`) names. O(namespaces + nodes): an admin call."""
        versions = {r.weights_version for r in self.namespaces.records() if r.model_id == model_id}
        for rec in self.st.nodes.values():
            if rec.alive and rec.engine_namespace and rec.engine_namespace[0] == model_id:
                versions.add(rec.engine_namespace[1])
        return versions

    def invalidate_namespace(self, ns: bytes) -> None:
        """Flush a namespace: its blocks are unreachable at once (reclaimed in the background), publishes
        reserved before now are refused at commit (their KV may predate the flush, e.g. a weights reload
        under the same version), and an active namespace starts again empty. Serving nodes drop their local
        tiers when their next heartbeat sees `flush_epoch` move. `NotFound` when unknown."""
        check_hash(ns, "namespace")
        with self.lock:
            self.namespaces.invalidate(ns)
            self.index.invalidate_namespace(NamespaceId(ns))
            if self.namespaces.is_active(ns):
                self._index_register(ns)
            self.publisher.flush(ns)
            self.wake.set()

    def _index_register(self, digest: bytes) -> None:
        """Under the lock: open `digest` in the index, grouped by its tenant when it has a pool quota."""
        group = self.quotas.group(self.namespaces.tenant_of(digest))
        self.index.register_namespace(NamespaceId(digest), group)

    # ---- matching and leases ----------------------------------------------------------------------
    def match(
        self,
        ns: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool,
        lease_ttl_ms: int,
        num_prompt_tokens: int,
        owner: str | None = None,
    ) -> tuple[MatchResult, list[NodeRecord]]:
        """The matched prefix and the records of the nodes its replicas name. `owner`: the caller its read
        lease is bound to (None: unbound; `renew_lease` and `release_lease(s)` check it)."""
        check_hash(ns, "namespace")
        if len(block_hashes) > self.settings.max_batch_blocks:
            raise InvalidArgument(
                f"{len(block_hashes)} hashes exceed the limit {self.settings.max_batch_blocks}"
            )
        hashes = list(map(BlockHash, block_hashes))
        if hashes and set(map(len, hashes)) != {HASH_NBYTES}:  # one C pass; the loop names the culprit
            for i, h in enumerate(hashes):
                if len(h) != HASH_NBYTES:
                    raise InvalidArgument(f"block_hashes[{i}] must be {HASH_NBYTES} bytes, got {len(h)}")
        if not 0 <= lease_ttl_ms <= self.settings.max_lease_ttl_ms:
            raise InvalidArgument(f"lease_ttl_ms must be in [0, {self.settings.max_lease_ttl_ms}]")
        if not 0 <= num_prompt_tokens <= MAX_PROMPT_TOKENS:  # summed into uint64 counters (Stats)
            raise InvalidArgument(f"num_prompt_tokens must be in [0, {MAX_PROMPT_TOKENS}]")
        with self.lock:
            bounds.before_match(self, ns, lease_ttl_ms)  # max_leases; keeps the namespace from expiring
            res = self.index.match_prefix(
                NamespaceId(ns), hashes, count_hit=count_hit, lease_ttl_ms=lease_ttl_ms
            )
            if owner is not None and res.lease_id:
                self.index.set_lease_owner(res.lease_id, owner)
            known = self.st.nodes
            nodes = [known[n] for n in res.node_names() if n in known]
            kept = dataplane.offered(self, res, nodes)  # not from a store whose data plane failed
            if kept is not res:
                res, nodes = kept, [known[n] for n in kept.node_names() if n in known]
            if count_hit:
                c, bs = self.counters, self.layout.block_size
                prompt = num_prompt_tokens or len(hashes) * bs
                c.num_match_requests += 1
                c.requested_tokens += prompt
                c.hit_tokens += min(res.num_matched * bs, prompt)
                c.requested_blocks += len(hashes)
                c.hit_blocks += res.num_matched
        return res, nodes

    def _check_lease_owners(self, lease_ids: Sequence[int], owner: str | None) -> None:
        """Under the lock: `PermissionDenied` when a caller bound to `owner` names a live lease of
        another caller (None: unbound, every lease)."""
        if owner is None:
            return
        for lease_id in lease_ids:
            if not self.index.lease_owned_by(lease_id, owner):
                raise PermissionDenied(f"lease {lease_id} belongs to another member: only its holder ends it")

    def renew_lease(self, lease_id: int, ttl_ms: int, *, owner: str | None = None) -> int:
        if not 0 < ttl_ms <= self.settings.max_lease_ttl_ms:
            raise InvalidArgument(f"ttl_ms must be in (0, {self.settings.max_lease_ttl_ms}]")
        with self.lock:
            self._check_lease_owners([lease_id], owner)
            self.index.renew_lease(lease_id, ttl_ms)
        return ttl_ms

    def release_lease(self, lease_id: int, *, owner: str | None = None) -> None:
        if lease_id <= 0:
            raise InvalidArgument("lease_id must be > 0")
        with self.lock:
            self._check_lease_owners([lease_id], owner)
            self.index.release_lease(lease_id)

    def release_leases(self, lease_ids: Sequence[int], *, owner: str | None = None) -> tuple[int, int]:
        """End many read leases under one lock hold. Returns (ended or already expired, not found: never
        granted or already released). `InvalidArgument`: no ids, more than `MAX_RELEASE_BATCH`, or an id 0;
        `PermissionDenied` (nothing ended): an id of a live lease bound to another caller than `owner`."""
        if not 0 < len(lease_ids) <= MAX_RELEASE_BATCH:
            raise InvalidArgument(f"lease_ids must hold 1..{MAX_RELEASE_BATCH} ids, got {len(lease_ids)}")
        if min(lease_ids) <= 0:
            raise InvalidArgument("every lease id must be > 0")
        not_found = 0
        with self.lock:
            self._check_lease_owners(lease_ids, owner)
            for lease_id in lease_ids:
                try:
                    self.index.release_lease(lease_id)
                except NotFound:
                    not_found += 1
        return len(lease_ids) - not_found, not_found

    # ---- replicas reported by readers and local tiers ---------------------------------------------
