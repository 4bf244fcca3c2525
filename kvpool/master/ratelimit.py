"""Per-peer rate limits on the master's open calls (`JoinChallenge`, `RegisterNode`).

Those calls are answered before the caller has proven anything, so each peer *address* (the host of
`grpc.ServicerContext.peer()`, without its port: a new connection gets no new bucket) gets a token
bucket of `burst` tokens refilled at `rate_per_s`; a call finding it empty is answered
RESOURCE_EXHAUSTED naming the setting, and other peers' buckets are untouched. State is bounded: at
most `max_peers` buckets (least recently seen forgotten first; a forgotten peer starts again with a
full bucket). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import unquote

from kvpool.errors import ResourceExhausted


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: "ipv4:1.2.3.4:5678" -> "1.2.3.4", "ipv6:%5B::1%5D:5678" -> "::1";
    any other form (unix sockets, "") whole."""
    scheme, sep, rest = peer.partition(":")
    if not sep or scheme not in ("ipv4", "ipv6"):
        return peer
    rest = unquote(rest)
    if rest.startswith("["):
        return rest[1 : rest.find("]")] if "]" in rest else rest
    host, _, _ = rest.rpartition(":")
    return host or rest


class PeerRateLimiter:
    """A token bucket per peer host. `rate_per_s` 0 turns the limit off."""

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: int,
        max_peers: int,
        setting: str = "join_rate_per_s",
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or max_peers < 1 or rate_per_s < 0:
            raise ValueError("burst and max_peers must be at least 1, rate_per_s at least 0")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._max = max_peers
        self._setting = setting
        self._clock_s = clock_s
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # host -> (tokens, at s)
        self.num_refused = 0

    def take(self, peer: str, what: str) -> None:
        """Spend one token of `peer`'s bucket (`peer`: a `context.peer()` string). Raises
        `ResourceExhausted` when it is empty."""
        if self._rate <= 0:
            return
        host = peer_host(peer)
        now = self._clock_s()
        with self._lock:
            tokens, at = self._buckets.pop(host, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) * self._rate)
            if tokens < 1.0:
                self._buckets[host] = (tokens, now)
                self.num_refused += 1
                raise ResourceExhausted(
                    f"{what}: too many calls from {host} (more than {self._rate:g}/s, the master's "
                    f"{self._setting}); retry later"
                )
            self._buckets[host] = (tokens - 1.0, now)
            while len(self._buckets) > self._max:
                self._buckets.popitem(last=False)

    def num_peers(self) -> int:
        with self._lock:
            return len(self._buckets)
