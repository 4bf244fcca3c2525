"""The connector's side of pull convoys (field case B39): which store links a plan would load over, and
the bytes already queued on them (`kvpool.cost.inflight.PullLedger`).

A pull reads each block from its first usable replica (`kvpool.connector.pull`), one batch per store,
the batches in parallel; so a load waits behind the busiest of its stores' queues. Registration and
release live in `KVConnector` (`_decide` registers the chosen pull; `release` ends it, once).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence

from kvpool.connector.plan import LoadPlan
from kvpool.connector.ports import TransportPort
from kvpool.cost.inflight import InFlight, PullLedger
from kvpool.cost.link import LinkEstimate, LinkLike

log = logging.getLogger(__name__)

TTL_FACTOR = 2.0
"""A registration outlives its pull's deadline by this factor: a pull may start later than decided (a vLLM
worker loads after the scheduler's step), and one never released stops counting then."""


def peer_bytes(plan: LoadPlan, block_nbytes: int, start: int, end: int) -> dict[str, int]:
    """Bytes the pull of pool blocks `[start, end)` reads from each store (data address)."""
    out: dict[str, int] = defaultdict(int)
    for reps in plan.replicas[start:end]:
        loc = next((r for r in reps if not r.local and r.node_id in plan.addresses), None)
        if loc is not None:
            out[plan.addresses[loc.node_id]] += block_nbytes
    return dict(out)


def pool_addresses(plan: LoadPlan) -> list[str]:
    """The data addresses of the stores holding the plan's pool replicas (with repeats)."""
    return [
        plan.addresses[loc.node_id]
        for reps in plan.replicas
        for loc in reps
        if not loc.local and loc.node_id in plan.addresses
    ]


def busiest(ledger: PullLedger, peers: dict[str, int]) -> InFlight:
    """The most loaded of `peers`' queues (by bytes in flight): what a load over them waits behind."""
    queues = [ledger.in_flight(peer) for peer in peers]
    return max(queues, key=lambda q: (q.nbytes, q.num_pulls), default=InFlight())


def contended(link: LinkLike, queue: InFlight) -> LinkLike:
    """`link` as a load waiting behind `queue` sees it: while pulls are in flight, the throughput the
    ledger saw the link drain under contention when that is below the single-stream calibration."""
    if queue.nbytes > 0 and 0.0 < queue.bytes_per_s < link.beta_bytes_per_s:
        return LinkEstimate(alpha_s=link.alpha_s, beta_bytes_per_s=queue.bytes_per_s)
    return link


def slowest_link(transport: TransportPort, addresses: Sequence[str]) -> LinkLike | None:
    """The slowest calibrated link among the stores at `addresses` (conservative); None when no store
    has an estimate (unreachable, or its probe measured no bandwidth)."""
    links = []
    for address in set(addresses):
        try:
            link = transport.link(address)
        except Exception as exc:  # noqa: BLE001 - an unreachable store: no link estimate
            log.debug("no link estimate for %s: %s", address, exc)
            continue
        if link.beta_bytes_per_s > 0:  # 0: the probe measured no bandwidth (e.g. probe_bytes=0)
            links.append(link)
    return min(links, key=lambda lk: lk.beta_bytes_per_s) if links else None
