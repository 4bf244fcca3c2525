"""Forwards queued on a node's model: the wait a load overlaps (field case B39, pull convoys).

A serving node runs one forward at a time (kvpool's runner: `NodeRuntime.model_lock`). A request that
arrives while others are decided and not yet computed waits for their forwards whatever it decides; a
pull runs during that wait (loads run outside the model lock, as vLLM's asynchronous loads run while the
scheduler computes other requests), so only the part of the load that outlasts the wait delays it. Mooncake's
conductor counts the prefill queue in its TTFT estimate for the same reason (FAST'25, arXiv 2407.00079,
§6). Without it, a burst on one prefix makes the cost model compare a queued pull with an unqueued
recompute, and it recomputes most of the burst: every recompute then lengthens the queue for the rest.

`ComputeQueue` keeps, per request decided and not yet computed, its predicted forward time (seconds):
`register` at the decision, `start` when its forward takes the model, `release` when it ends. `ahead_s()` is
what a request deciding now waits: the predicted forwards registered, the running one less its elapsed
time. A registration nobody releases expires after `ttl_s`. Thread-safe; `clock` is monotonic seconds.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.errors import InvalidArgument

DEFAULT_TTL_S = 30.0
"""A forward registered and never started or released stops counting after this long (a request that
failed between its decision and its forward)."""


@dataclass(slots=True)
class _Forward:
    predicted_s: float
    expires_at: float
    started_at: float | None = None


class ComputeQueue:
    """Forwards decided and not yet finished on one model (see the module docstring)."""

    def __init__(self, *, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0.0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s!r}")
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._forwards: dict[int, _Forward] = {}
        self._ids = itertools.count(1)
        self.num_registered = 0
        self.num_expired = 0

    def __len__(self) -> int:
        """Forwards registered and not yet released (expired ones dropped)."""
        with self._lock:
            self._expire(self._clock())
            return len(self._forwards)

    def ahead_s(self) -> float:
        """Seconds of forwards a request deciding now waits behind (>= 0): every registered forward's
        predicted time, a started one's less what it has run."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            total = 0.0
            for f in self._forwards.values():
                ran = 0.0 if f.started_at is None else now - f.started_at
                total += max(0.0, f.predicted_s - ran)
            return total

    def register(self, predicted_s: float) -> int:
        """Enter a decided request's forward of `predicted_s` seconds (>= 0, finite); returns its id, which
        the caller `release`s once (a `finally`). Raises `InvalidArgument` on a negative or nan time."""
        if not 0.0 <= predicted_s < float("inf"):
            raise InvalidArgument(f"predicted_s must be finite and >= 0, got {predicted_s!r}")
        forward_id = next(self._ids)
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._forwards[forward_id] = _Forward(predicted_s, now + self._ttl_s)
            self.num_registered += 1
        return forward_id

    def start(self, forward_id: int | None) -> None:
        """The forward took the model now (its remaining time shrinks from here). None or unknown: nothing."""
        if forward_id is None:
            return
        with self._lock:
            f = self._forwards.get(forward_id)
            if f is not None and f.started_at is None:
                f.started_at = self._clock()
                f.expires_at = f.started_at + self._ttl_s

    def release(self, forward_id: int | None) -> bool:
        """The forward ended (or will not run): True the first time, False after or for None/unknown."""
        if forward_id is None:
            return False
        with self._lock:
            return self._forwards.pop(forward_id, None) is not None

    def _expire(self, now: float) -> None:
        for forward_id in [i for i, f in self._forwards.items() if f.expires_at <= now]:
            del self._forwards[forward_id]
            self.num_expired += 1
