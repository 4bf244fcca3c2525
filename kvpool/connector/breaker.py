"""Degraded mode when the pool is unreachable (field case B19).

After `max_failures` consecutive failed pool calls (match, pull batch, publish) the node stops calling
the pool: requests run on the node-local tier and recompute, paying no connection errors. Every
`probe_interval_s` one request is let through as a health probe; its success restores normal mode.
When the node's heartbeats reach the master again after an outage (or it re-registers with a restarted
master) `probe_soon` lets the next request probe at once, so hits come back within a heartbeat of the
master's return rather than a probe interval later.
Source: the monitor LMCache added for an unreachable remote backend (LMCache PR #764).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class PoolBreaker:
    """A circuit breaker over pool calls. Thread-safe. `clock` returns seconds (monotonic)."""

    def __init__(
        self,
        *,
        max_failures: int = 3,
        probe_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_failures < 1 or probe_interval_s <= 0:
            raise ValueError("max_failures must be >= 1 and probe_interval_s > 0")
        self.max_failures = max_failures
        self.probe_interval_s = probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._degraded_since: float | None = None
        self._next_probe = 0.0
        self.num_skipped = 0
        self.num_degradations = 0
        self.degraded_since_unix_s = 0.0
        """Wall-clock time (Unix s) the current degraded mode began; 0.0 when not degraded."""

    @property
    def degraded(self) -> bool:
        return self._degraded_since is not None

    def allow(self) -> bool:
        """May this request call the pool? In degraded mode only one probe per interval may."""
        with self._lock:
            if self._degraded_since is None:
                return True
            now = self._clock()
            if now >= self._next_probe:
                self._next_probe = now + self.probe_interval_s
                return True
            self.num_skipped += 1
            return False

    def record(self, ok: bool) -> None:
        """Report the outcome of a pool call made after `allow()`."""
        with self._lock:
            if ok:
                if self._degraded_since is not None:
                    log.warning("pool reachable again: leaving degraded mode")
                self._failures = 0
                self._degraded_since = None
                self.degraded_since_unix_s = 0.0
                return
            self._failures += 1
            if self._degraded_since is None and self._failures >= self.max_failures:
                self._degraded_since = self._clock()
                self.degraded_since_unix_s = time.time()
                self._next_probe = self._degraded_since + self.probe_interval_s
                self.num_degradations += 1
                log.warning(
                    "pool unreachable after %d failures: degraded mode (local tier + recompute)",
                    self._failures,
                )

    def probe_soon(self) -> None:
        """The master answers again: in degraded mode the next pool call is a probe (no wait)."""
        with self._lock:
            if self._degraded_since is not None:
                self._next_probe = min(self._next_probe, self._clock())
