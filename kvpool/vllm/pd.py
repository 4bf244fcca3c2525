"""Prefill/decode through the pool: a decode engine waits for its prefill engine's publish.

A router sends a request to a prefill engine (`max_tokens` 1); that engine's connector queues the
prompt's full blocks for publishing and answers `kv_transfer_params = {"kvpool": report}`
(`kvpool.vllm.request_state.request_report`; `num_saved_blocks` = the chain blocks in the pool or queued).
The router hands the report to the decode engine as `kv_transfer_params = {"kvpool_prefill": report}`.
The prefill's last blocks are written and committed after its response (the worker copies them out in
the next engine step), so the decode's connector first waits, at most `pd_wait_s`, until the master
matches that many blocks, then plans the load as for any request. A prefill whose publish failed (its
blocks never appear) costs the decode `pd_wait_s` and a recompute, never a wrong token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.connector.ports import MasterPort

log = logging.getLogger(__name__)

PREFILL_KEY = "kvpool_prefill"  # the decode request's kv_transfer_params key the router fills
POLL_S = 0.02


def prefill_blocks(request: Any) -> int:
    """The blocks a P/D decode request's prefill engine published (`kv_transfer_params[kvpool_prefill]`
    `num_saved_blocks`); 0 for any other request or a malformed report (a client cannot make it wait past
    `pd_wait_s` either way)."""
    params = getattr(request, "kv_transfer_params", None)
    report = params.get(PREFILL_KEY) if isinstance(params, dict) else None
    n = report.get("num_saved_blocks") if isinstance(report, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def wait_committed(
    master: MasterPort,
    digest: bytes,
    hashes: Sequence[bytes],
    wait_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Peek (no hit counted, no lease) until the master matches all of `hashes` or `wait_s` passed;
    returns the blocks matched at the last peek. A master error ends the wait (the plan asks again)."""
    deadline = clock() + wait_s
    matched = 0
    while True:
        try:
            matched = master.match(digest, list(hashes), count_hit=False, lease_ttl_ms=0).num_matched
        except Exception as exc:  # noqa: BLE001 - the plan's own match reports the master's state
            log.debug("waiting for the prefill's blocks: %s", exc)
            return matched
        if matched >= len(hashes) or clock() >= deadline:
            return matched
        sleep(POLL_S)
