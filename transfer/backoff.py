"""Per-peer back-off: after a peer could not be reached, calls to it fail at once for a while.

Field case B19 (LMCache PR #764) at the granularity of one peer: with one store node cut off the network,
every request that named one of its replicas waited out a connect or transfer timeout before recomputing.
With this, the first failure costs its timeout; calls in the next `first_s` (doubling on each further
failure, up to `max_s`) fail immediately with the reason, so callers recompute without waiting; the first
call after the back-off is the probe, and a success clears the peer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Down:
    until_s: float
    backoff_s: float
    why: str


class PeerBackoff:
    """Thread-safe. `clock` returns seconds (monotonic)."""

    def __init__(
        self, first_s: float = 1.0, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 <= first_s <= max_s:
            raise ValueError("need 0 <= first_s <= max_s")
        self.first_s, self.max_s, self._clock = first_s, max_s, clock
        self._lock = threading.Lock()
        self._down: dict[str, _Down] = {}

    def down(self, peer: str) -> str:
        """Why `peer` is being skipped now ("" when a call may go ahead, probes included)."""
        with self._lock:
            d = self._down.get(peer)
            if d is None or self._clock() >= d.until_s:
                return ""
            return f"peer {peer} unreachable, backing off {d.until_s - self._clock():.1f} s after: {d.why}"

    def failed(self, peer: str, why: str) -> None:
        """A call could not reach `peer` (connect, connection lost, deadline): back off, doubling."""
        with self._lock:
            d = self._down.get(peer)
            backoff_s = self.first_s if d is None else min(self.max_s, max(d.backoff_s * 2, self.first_s))
            self._down[peer] = _Down(self._clock() + backoff_s, backoff_s, why)

    def ok(self, peer: str) -> None:
        """A call reached `peer`: no back-off."""
        with self._lock:
            self._down.pop(peer, None)

    def peers_down(self) -> list[str]:
        """Peers being skipped now."""
        with self._lock:
            now = self._clock()
            return sorted(p for p, d in self._down.items() if now < d.until_s)
