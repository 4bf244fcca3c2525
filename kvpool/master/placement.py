"""Placement and the records of two-phase publish (`kvpool.master.publish` runs them under the lock)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.master.nodes import NodeRecord
from kvpool.types import Location


@dataclass
class Reservation:
    rid: int
    ns: bytes
    parent: bytes | None
    hashes: list[bytes]
    locations: list[list[Location]]  # empty for blocks already present
    costs: list[float]
    target: int
    expiry_ms: int
    committing: bool = False
    aborted: bool = False
    parent_locked: bool = False  # the parent chain is pinned (lock_ref) until the reservation ends
    flushed: bool = False  # its namespace was invalidated after it was made: the commit is refused
    writer: str = ""  # the Reserve's writer_node_id (live reservations per writer: max_leases_per_client)
    owner: str = ""  # secured master: the join token name that made it (only it commits or aborts it)
    quota_tenant: str | None = None  # the tenant whose pool quota counts its new blocks (None: none)
    quota_blocks: int = 0  # its new blocks counted in that tenant's reserved blocks
    per_node: dict[str, int] = field(default_factory=dict)  # new slots reserved per node id (`place_runs`)


@dataclass(frozen=True, slots=True)
class Placed:
    r: Reservation
    present: list[bool]
    k: int


@dataclass(frozen=True, slots=True)
class ReserveOutcome:
    rid: int
    hashes: list[bytes]
    present: list[bool]
    locations: list[list[Location]]
    write_lease_ms: int
    nodes: list[NodeRecord]
    num_replicas_placed: int


@dataclass(frozen=True, slots=True)
class CommitBlock:
    block_hash: bytes
    checksum: int
    written: list[Location] = field(default_factory=list)


def place_runs(
    present: Sequence[bool],
    nodes: Sequence[NodeRecord],
    k: int,
    run: int,
    *,
    now_ms: int = 0,
    per_node: dict[str, int] | None = None,
) -> list[list[Location]]:
    """One list of `k` slots on distinct nodes per new block ([] for a block already present). Runs of
    `run` consecutive new blocks share their nodes, which hand out slots from their free lists in order, so a
    pull reads a run as one message (`transfer.coalesce`); each run goes to the nodes with the most free
    slots, a gray node (its writes keep failing at `now_ms`: `kvpool.master.dataplane.note_commit`) only
    when the others have no room. Adds the slots taken per node id to `per_node`. The caller checked
    there is room (`Publisher._reserve_locked`)."""
    locations: list[list[Location]] = []
    chosen: list[NodeRecord] = []
    left = taken = 0
    counts = per_node if per_node is not None else {}
    for is_present in present:
        if is_present:
            locations.append([])
            continue
        if left == 0 or any(not n.free for n in chosen):
            _count(counts, chosen, taken)
            ranked = sorted(
                nodes, key=lambda n: (n.dataplane.gray_until_ms > now_ms or not n.free, -len(n.free))
            )
            chosen, left, taken = ranked[:k], run, 0
        locations.append([n.take(1)[0] for n in chosen])
        left -= 1
        taken += 1
    _count(counts, chosen, taken)
    return locations


def _count(counts: dict[str, int], chosen: Sequence[NodeRecord], taken: int) -> None:
    for n in chosen:
        counts[n.node_id] = counts.get(n.node_id, 0) + taken


def new_replicas(have: Sequence[Location], got: list[Location], target: int) -> list[Location]:
    """Of a second writer's replicas of a block already in the index, the ones to add: on nodes holding
    none of its replicas yet, up to `target` in all (the rest are freed): replicas stay on distinct nodes."""
    nodes = {loc.node_id for loc in have if not loc.local}
    room = target - len(nodes)
    out = []
    for loc in got:
        if room > 0 and loc.node_id not in nodes:
            out.append(loc)
            nodes.add(loc.node_id)
            room -= 1
    return out
