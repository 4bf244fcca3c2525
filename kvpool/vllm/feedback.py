"""What the workers report back to the scheduler half each step, and the pull tickets it settles.

A load's pull stays in the connector's ledger (`kvpool.cost.inflight.PullLedger`) from the decision until
the worker reports the load ended (B39). The worker's `KVPoolWorkerMetadata` then teaches the scheduler
half's connector: the forward time (recompute calibration), each pull that ran alone (the link's overhead;
a convoy's time is the ledger's to learn), the links the workers measured, the loads that ended (their
tickets are released with their time) and the loads that failed (their blocks are published again).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from kvpool.connector.connector import KVConnector
from kvpool.cost import LinkEstimate
from kvpool.vllm.meta import KVPoolWorkerMetadata
from kvpool.vllm.request_state import ReportedLinks, RequestState

MAX_TICKETS = 65_536
"""Pull tickets awaiting their worker's report at once (a lost report's ticket expires in the ledger)."""


class PullTickets:
    """Request id → the ledger ticket of its pull, until the worker reports its load ended. Thread-safe;
    at most `MAX_TICKETS` (the oldest go first: their reports were lost, the ledger expires them anyway)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def add(self, request_id: str, ticket: str) -> None:
        with self._lock:
            self._tickets[request_id] = ticket
            while len(self._tickets) > MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]

    def get(self, request_id: str) -> str | None:
        with self._lock:
            return self._tickets.get(request_id)

    def pop(self, request_id: str) -> str | None:
        with self._lock:
            return self._tickets.pop(request_id, None)


def observe_worker(
    meta: KVPoolWorkerMetadata,
    *,
    connector: KVConnector,
    tickets: PullTickets,
    requests: Mapping[str, RequestState],
) -> None:
    """Fold one step's worker report into the scheduler half's `connector` (see the module docstring)."""
    cal = connector.calibration
    if meta.forward is not None:
        cal.observe_compute(*meta.forward)
    for p in meta.pulls:
        if connector.pulls.overlapped(tickets.get(p.request_id)):  # a convoy's time: the ledger learns it
            continue
        cal.observe_pull(
            p.nbytes, p.seconds, LinkEstimate(alpha_s=p.alpha_s, beta_bytes_per_s=p.beta_bytes_per_s)
        )
    links = connector.transport
    if isinstance(links, ReportedLinks):
        for peer, (alpha_s, beta) in meta.links.items():
            links.update(peer, LinkEstimate(alpha_s=alpha_s, beta_bytes_per_s=beta))
    for rid, load_s in meta.loads_done.items():  # the pull ended: off the link's queue, timed
        connector.pulls.release(tickets.pop(rid), elapsed_s=load_s)
    for rid, num_ok in meta.load_failures.items():
        st = requests.get(rid)
        if st is not None:  # the pool's copy is bad or gone: the recomputed blocks are published again
            st.num_saved_blocks = min(st.num_saved_blocks, num_ok)
            st.load_failed, st.num_intact_blocks = True, num_ok
