"""Recent match answers shared between a node's requests: one `MatchPrefix` in flight per prompt prefix,
and a fresh answer that already says "recompute" spares the master the call.

In a burst, many requests on one prefix decide at once; each asking the master costs CPU on the request
path (the client's and, on a shared host, the master's) for an answer that is the same for all of them.
`RecentMatches.claim` makes the first request the leader (it asks the master and publishes the answer);
the others wait for that answer (at most `wait_s`) and the connector runs its decision on it without a
lease (`KVConnector.plan_load`): when the decision is not to pull (the pulls already in flight make
recomputing cheaper, or the pool holds nothing), the request is done without a call. When it would pull,
the request asks the master itself, for a lease and current replicas. So a shared answer can only turn a
pull into a recompute, never make a pull: the worst a stale one costs is hit rate, for `ttl_s`. A request
decided on a shared answer is not counted in the master's hit statistics (it sent no `MatchPrefix`).

Keys are (namespace, last block hash, number of blocks): block hashes are chained, so the last one names
the whole prefix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.types import Match

Key = tuple[bytes, bytes, int]

DEFAULT_TTL_S = 0.25
"""How long a master's answer decides for other requests (seconds): long enough for a burst that arrives
at once, short enough that blocks another node published meanwhile are seen soon (this node's own
publishes drop the answers they change at once: `forget`)."""
DEFAULT_WAIT_S = 2.0
"""How long a request waits for the leader's answer before asking the master itself (seconds)."""


def prefix_key(ns: bytes, hashes: list[bytes]) -> Key:
    """The key of a prompt's reusable prefix (`hashes` non-empty, chained)."""
    return (ns, hashes[-1], len(hashes))


@dataclass
class Claim:
    """One key's answer: pending until the leader publishes it (`done` set)."""

    done: threading.Event = field(default_factory=threading.Event)
    match: Match | None = None
    answered_s: float = 0.0


class RecentMatches:
    """Single-flight matches with a short memory (see the module docstring). Thread-safe.

    Args:
        ttl_s: how long an answer is shared after it arrived (0: never shared; every request asks).
        wait_s: how long a follower waits for the leader's answer.
        max_entries: answers kept at most (the oldest go first).
        clock: monotonic seconds (tests inject one).
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        wait_s: float = DEFAULT_WAIT_S,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s, self.wait_s, self.max_entries = ttl_s, wait_s, max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._claims: dict[Key, Claim] = {}
        self.num_shared = 0
        """Answers handed to a request that did not ask the master for them."""

    def claim(self, key: Key) -> tuple[Match | None, Claim | None]:
        """`(answer, None)`: a fresh answer (or the in-flight leader's, waited for; its lease is not yours); None
        when the leader's call failed or took longer than `wait_s` (then ask the master, not leading).
        `(None, claim)`: this caller leads: it asks the master and must `publish(claim, answer)`, also on
        failure (`answer` None)."""
        if self.ttl_s <= 0:
            return None, None
        with self._lock:
            c = self._claims.get(key)
            stale = (
                c is not None
                and c.done.is_set()
                and (c.match is None or self._clock() - c.answered_s > self.ttl_s)
            )
            if c is None or stale:
                self._claims.pop(key, None)  # re-inserted last: the dict's order is the eviction order
                c = self._claims[key] = Claim()
                while len(self._claims) > self.max_entries:
                    self._claims.pop(next(iter(self._claims)))
                return None, c
        if not c.done.wait(self.wait_s) or c.match is None:
            return None, None
        with self._lock:
            self.num_shared += 1
        return c.match, None

    def forget(self, ns: bytes, hashes: Sequence[bytes]) -> None:
        """Drop the answers for every prefix of the chain `hashes` (this node just published into it)."""
        with self._lock:
            for n in range(1, len(hashes) + 1):
                self._claims.pop((ns, hashes[n - 1], n), None)

    def publish(self, claim: Claim, match: Match | None) -> None:
        """The leader's answer; None: the call failed, and the followers ask for themselves. Its lease stays
        the leader's: followers never use or release it."""
        claim.match = match
        claim.answered_s = self._clock()
        claim.done.set()
