"""The scheduler half's lease renewal (B13): a decided plan's read lease is renewed while its request waits.

A lease is released when its load ends, when nothing is loaded, on abort and in `request_finished`; until
then this loop renews it every third of its TTL, so a request that waits for vLLM's scheduler never loses
the blocks it was promised. A renewal that fails costs at most that request's pull (it recomputes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from kvpool.connector.connector import KVConnector
from kvpool.vllm.request_state import RequestState

log = logging.getLogger(__name__)


def renew_leases(connector: KVConnector, requests: Mapping[str, RequestState], stop: threading.Event) -> None:
    """Renew the lease of every plan in `requests` each `lease_ttl_ms / 3` (at least 50 ms) until `stop`."""
    period_s = max(0.05, connector.lease_ttl_ms / 3000.0)
    while not stop.wait(period_s):
        states = list(requests.values())  # a snapshot: the engine thread adds and removes requests
        plans = [st.plan for st in states if st.plan is not None and st.plan.lease_id]
        for plan in plans:
            lease_id = plan.lease_id
            if not lease_id:
                continue
            try:
                connector.master.renew_lease(lease_id, connector.lease_ttl_ms)
            except Exception as exc:  # noqa: BLE001 - an expired lease: the pull may fail and recompute
                log.debug("renew of lease %d failed: %s", lease_id, exc)
