"""Waiting for the master at a process's start: retried with back-off while it is unreachable.

Used by the serving nodes (`kvpool.serving.preflight`) and the router (`kvpool.router.serve`), so that
roles started before their master (or while it restarts) come up once it answers, within their
`master_wait_s` (one log line per attempt, at most one every `_SAY_EVERY_S`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.errors import Unavailable

if TYPE_CHECKING:
    from kvpool.client import MasterClient
    from kvpool.client.types import PoolStats

log = logging.getLogger(__name__)

_SAY_EVERY_S = 5.0
"""At most one "master unreachable" line per this many seconds."""
_BACKOFF_S = (0.25, 2.0)
"""First and largest pause between attempts (doubling)."""


def wait_for_master(
    master: MasterClient,
    wait_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> PoolStats:
    """The master's `Stats`, retried with back-off while the master is unreachable (`Unavailable` or
    `DeadlineExceeded`), for at most `wait_s` seconds; then `Unavailable` (one line naming the address and
    the setting). Other errors (`Unauthenticated`: a refused join token) raise at once."""
    from kvpool.errors import DeadlineExceeded

    t0 = clock()
    deadline = t0 + wait_s
    pause, said_at, attempt = _BACKOFF_S[0], float("-inf"), 0
    while True:
        attempt += 1
        try:
            return master.stats()
        except (Unavailable, DeadlineExceeded) as exc:
            now = clock()
            if now >= deadline:
                raise Unavailable(
                    f"master {master.address} unreachable for {now - t0:.0f} s ({attempt} attempt{'s' * (attempt > 1)}; "
                    f"master_wait_s = {wait_s:g}): {str(exc).splitlines()[0]}"
                ) from None
            if now - said_at >= _SAY_EVERY_S:
                said_at = now
                log.warning(
                    "master %s unreachable (attempt %d); retrying for up to %.0f s more",
                    master.address,
                    attempt,
                    deadline - now,
                )
            sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, _BACKOFF_S[1])
