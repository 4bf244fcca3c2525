"""Batched two-phase publish (`ReserveBatch` / `CommitBatch`, as Mooncake's BatchPutStart/BatchPutEnd).

Each chain of a batch is checked, placed and answered as its own `Reserve` (`Publisher.check_reserve`,
`Publisher.reserve_step`; the same namespace, flush-epoch, parent, quota, admission and per-writer lease
checks), each commit as its own `Commit` (`CommitPhase.begin_commit` / `end_commit`); one chain's or
commit's error is its own answer, the others go on. What a batch saves is per call: the master's lock is
taken once per phase of the batch (not once per chain), and each store gets ONE `ReserveSlots` and ONE
`CommitSlots` order per batch (the orders of all its chains; a reserve the store refuses, all or none,
is sent again per chain so that one chain's bad slot fails only that chain).

Caps (`MasterSettings`): `max_batch_chains` chains and `max_batch_total_blocks` blocks per call; past
them the whole call is refused with `InvalidArgument`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.errors import DeadlineExceeded, InvalidArgument, KVPoolError, ResourceExhausted, Unavailable
from kvpool.master.commit import CommitBegun
from kvpool.master.placement import CommitBlock, Placed, Reservation, ReserveOutcome
from kvpool.master.stores import SlotOrder
from kvpool.types import Location

if TYPE_CHECKING:
    from kvpool.master.core import Master
    from kvpool.master.publish import Publisher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChainSpec:
    """One chain of a `ReserveBatch`: the arguments of one `Publisher.reserve`."""

    ns: bytes
    parent: bytes
    hashes: Sequence[bytes]
    num_replicas: int = 0
    block_nbytes: int = 0
    costs: Sequence[float] = ()
    write_lease_ms: int = 0
    flush_epoch: int | None = None
    writer: str = ""


def check_caps(m: Master, num_items: int, num_blocks: int) -> None:
    """`InvalidArgument` when a batch of `num_items` chains (or commits) of `num_blocks` blocks in all
    exceeds `max_batch_chains` / `max_batch_total_blocks`."""
    s = m.settings
    if num_items > s.max_batch_chains:
        raise InvalidArgument(
            f"{num_items} chains exceed the batch limit max_batch_chains={s.max_batch_chains}"
        )
    if num_blocks > s.max_batch_total_blocks:
        raise InvalidArgument(
            f"{num_blocks} blocks exceed the batch limit max_batch_total_blocks={s.max_batch_total_blocks}"
        )


def reserve_batch(
    pub: Publisher, chains: Sequence[ChainSpec], owner: str = ""
) -> list[ReserveOutcome | KVPoolError]:
    """Reserve every chain; per chain (in order) its `ReserveOutcome` or the `KVPoolError` a lone
    `Reserve` of it would have raised. Raises only for the whole call (`InvalidArgument` past the caps)."""
    m = pub.m
    check_caps(m, len(chains), sum(len(c.hashes) for c in chains))
    out: list[ReserveOutcome | KVPoolError | None] = [None] * len(chains)
    todo: dict[int, tuple[ChainSpec, int, int]] = {}  # chain index -> (spec, num_replicas, write_lease_ms)
    for i, c in enumerate(chains):
        try:
            k, lease_ms = pub.check_reserve(
                c.ns,
                c.parent,
                c.hashes,
                num_replicas=c.num_replicas,
                block_nbytes=c.block_nbytes,
                costs=c.costs,
                write_lease_ms=c.write_lease_ms,
            )
        except KVPoolError as exc:
            out[i] = exc
            continue
        todo[i] = (c, k, lease_ms)
    if todo:
        pub._await_adoption()
    placed: dict[int, Placed] = {}
    leases = {i: lease_ms for i, (_, _, lease_ms) in todo.items()}
    for attempt in range(2):
        evict_on: set[str] = set()
        with m.lock:
            for i, (c, k, lease_ms) in list(todo.items()):
                try:
                    step = pub.reserve_step(
                        c.ns,
                        c.parent,
                        c.hashes,
                        c.costs,
                        lease_ms,
                        k,
                        attempt,
                        c.flush_epoch,
                        c.writer,
                        owner,
                    )
                except KVPoolError as exc:
                    out[i] = exc
                    del todo[i]
                    continue
                if isinstance(step, list):  # no room: retried after the frees of these nodes
                    evict_on.update(step)
                    continue
                del todo[i]
                if isinstance(step, Placed):
                    placed[i] = step
                else:
                    out[i] = step
        if not todo:
            break
        for node_id in sorted(evict_on):
            m.flush_frees(only=node_id)
    for i in todo:  # unreachable: the last attempt places or raises
        out[i] = ResourceExhausted("no room after making room")
    failed = send_reservations(pub, [(p.r, leases[i]) for i, p in placed.items()])
    with m.lock:
        for i, p in placed.items():
            r = p.r
            if r.rid in failed:
                out[i] = failed[r.rid]
                continue
            nodes_used = {loc.node_id for locs in r.locations for loc in locs}
            records = [m.st.nodes[n] for n in nodes_used if n in m.st.nodes]
            out[i] = ReserveOutcome(r.rid, r.hashes, p.present, r.locations, leases[i], records, p.k)
    return [x if x is not None else KVPoolError("chain not answered") for x in out]


def send_reservations(pub: Publisher, rs: Sequence[tuple[Reservation, int]]) -> dict[int, KVPoolError]:
    """Order the slots of placed reservations `rs` ((reservation, write_lease_ms)) reserved on their stores:
    one order per store and lease length. Outside the lock. A store that does not answer takes its slots
    out of every reservation it holds (and is marked unreachable); one that refuses a combined order is
    asked again per reservation. Returns {rid: error} for the reservations left without a replica of a
    new block (dropped, their slots freed); the others keep their surviving replicas."""
    m = pub.m
    per_node: dict[tuple[str, int], dict[int, list[SlotOrder]]] = {}  # (node, lease) -> rid -> orders
    for r, lease_ms in rs:
        prev = r.parent or b""
        for h, locs in zip(r.hashes, r.locations, strict=True):
            for loc in locs:
                orders = per_node.setdefault((loc.node_id, lease_ms), {}).setdefault(r.rid, [])
                orders.append(SlotOrder(loc.slot, loc.generation, r.ns, h, prev))
            prev = h
    failed: set[tuple[int, str]] = set()  # (rid, node) whose slots the store did not take
    for (node_id, lease_ms), by_rid in per_node.items():
        with m.lock:
            rec = m.st.nodes.get(node_id)
        if rec is None:  # it left the pool since its slots were placed
            failed.update((rid, node_id) for rid in by_rid)
            continue
        address = rec.grpc_address
        try:
            m.stores.reserve(address, [o for orders in by_rid.values() for o in orders], lease_ms)
        except (Unavailable, DeadlineExceeded) as exc:  # it did not answer: no placements there a while
            m.mark_unreachable(node_id, exc)
            failed.update((rid, node_id) for rid in by_rid)
        except KVPoolError as exc:  # it refused (all or none): per reservation, so one bad slot fails one
            log.warning("store %s refused a reservation: %s", node_id, exc)
            if len(by_rid) == 1:
                failed.update((rid, node_id) for rid in by_rid)
                continue
            for rid, orders in by_rid.items():
                try:
                    m.stores.reserve(address, orders, lease_ms)
                except (Unavailable, DeadlineExceeded) as exc2:
                    m.mark_unreachable(node_id, exc2)
                    failed.add((rid, node_id))
                except KVPoolError as exc2:
                    log.warning("store %s refused reservation %d: %s", node_id, rid, exc2)
                    failed.add((rid, node_id))
    if not failed:
        return {}
    errors: dict[int, KVPoolError] = {}
    with m.lock:
        for r, _ in rs:
            bad = {n for rid, n in failed if rid == r.rid}
            if not bad:
                continue
            for locs in r.locations:
                for loc in [x for x in locs if x.node_id in bad]:
                    locs.remove(loc)
                    m.queue_free(loc)
            pub._requota(r)
            if any(not locs for locs, h in zip(r.locations, r.hashes, strict=True) if not pub._present(r, h)):
                pub._drop(r)
                errors[r.rid] = Unavailable(f"store nodes {sorted(bad)} refused the reservation")
    return errors


def commit_batch(
    pub: Publisher, commits: Sequence[tuple[int, Sequence[CommitBlock]]], owner: str | None = None
) -> list[tuple[int, int] | KVPoolError]:
    """Commit each (reservation_id, blocks); per commit (in order) (num_committed, num_existing) or the
    `KVPoolError` a lone `Commit` would have raised. One `CommitSlots` per store for the whole batch."""
    m = pub.m
    check_caps(m, len(commits), sum(len(b) for _, b in commits))
    out: list[tuple[int, int] | KVPoolError | None] = [None] * len(commits)
    begun: dict[int, CommitBegun] = {}
    with m.lock:
        for i, (rid, blocks) in enumerate(commits):
            try:
                b = pub.begin_commit(rid, blocks, owner)
            except KVPoolError as exc:
                out[i] = exc
                continue
            if isinstance(b, tuple):
                out[i] = b
            else:
                begun[i] = b
        by_node: dict[str, list[Location]] = {}
        for b in begun.values():
            for node_id, locs in b.by_node.items():
                by_node.setdefault(node_id, []).extend(locs)
        addresses = {n: m.st.nodes[n].grpc_address for n in by_node if n in m.st.nodes}
    failed: set[Location] = set()  # written but not committed (usually none)
    silent: set[str] = set()  # stores whose commit call failed
    for node_id, node_locs in by_node.items():
        try:
            errs = m.stores.commit(addresses[node_id], node_locs)
        except (KVPoolError, KeyError) as exc:
            m.mark_unreachable(node_id, exc)
            failed.update(node_locs)
            silent.add(node_id)
            continue
        if any(errs.values()):
            failed.update(loc for loc in node_locs if errs.get((loc.slot, loc.generation)))
    with m.lock:
        for i, b in begun.items():
            ok_per_node = {
                n: len(locs) - (sum(1 for loc in locs if loc in failed) if failed else 0)
                for n, locs in b.by_node.items()
                if n not in silent
            }
            try:
                out[i] = pub.end_commit(b, failed, ok_per_node)
            except KVPoolError as exc:
                out[i] = exc
    return [x if x is not None else KVPoolError("commit not answered") for x in out]
