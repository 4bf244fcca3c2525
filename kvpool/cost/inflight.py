"""Pulls in flight per link: the queue a new pull waits behind (field case B39, pull convoys).

A link's calibrated bandwidth is a single-stream figure. When many requests decide at once to pull from
one store, each pull shares the link with the others already decided, so a new pull of `n` bytes
finishes after about `alpha + (queued + n) / beta`, not `alpha + n / beta`. `PullLedger` keeps, per peer
(a store's data address), the bytes of pulls registered and not yet released; the decision adds them to
its own bytes (`decide_reuse(queued_bytes=...)`), so the 50th request of a burst sees the 49 before it
and recomputes (or loads less) once that is cheaper.

The queue is the bytes of every registered pull not yet released, counted whole until it ends: on a
shared host the link's calibrated bandwidth overstates what 50 concurrent pulls get (they contend for
CPU too), so draining the queue at that bandwidth would undercount it (`kvpool bench burst` measured a
predicted 10 MiB behind 46 MiB really in flight). A registration expires after `ttl_s` even if never
released (a worker that died mid-load never reports): no path can leak the queue for longer.

A pull released with its measured time (`release(id, elapsed_s=...)`) that ran behind others teaches the
ledger what the link really drains under contention: `(bytes queued before it + its own) / elapsed_s`,
an exponentially weighted mean per peer (`InFlight.bytes_per_s`; 0 until a contended pull finished). The
decision uses it for the queue when it is below the single-stream calibration (`KVConnector._decide`), so
the next burst on a host where concurrent pulls contend for CPU as much as for the link predicts their
real cost. Such a pull's time must not correct the single-stream link estimate (`overlapped`). Thread-safe;
`clock` returns seconds (monotonic).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvpool.errors import InvalidArgument


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlight:
    """What a peer's link is committed to now: `num_pulls` registered pulls of `nbytes` in all, and the
    throughput it was seen to drain while contended (`bytes_per_s`, B/s; 0.0: not learned yet)."""

    num_pulls: int = 0
    nbytes: int = 0
    bytes_per_s: float = 0.0


@dataclass(slots=True)
class _Peer:
    num_pulls: int = 0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class _Entry:
    peers: tuple[tuple[str, int], ...]
    queued_before: tuple[int, ...]  # per peer, the bytes in flight when this pull registered
    expires_at: float
    crowded: bool  # another pull (any peer) was in flight when this one registered
    seq: int  # this registration's sequence number (`_last_seq` right after it registered)


RATE_WEIGHT = 0.3
"""Weight of the newest contended-throughput observation in its peer's running mean."""
MAX_RATE_PEERS = 4096
"""Peers whose contended throughput is remembered (the oldest learned is forgotten first)."""


class PullTicket:
    """One registered pull. `release()` (idempotent) or `with ticket:` ends it; `id` is a picklable handle
    (`PullLedger.release(id)` from elsewhere in the process)."""

    __slots__ = ("_ledger", "id")

    def __init__(self, ledger: PullLedger, ticket_id: str) -> None:
        self._ledger, self.id = ledger, ticket_id

    def release(self) -> bool:
        """End the pull; True the first time (its bytes left the queue), False after."""
        return self._ledger.release(self.id)

    def __enter__(self) -> PullTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PullLedger:
    """Bytes committed to pulls in flight, per peer (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._entries: dict[str, _Entry] = {}
        self._rates: dict[str, float] = {}  # peer -> contended throughput (B/s), insertion-ordered
        self._prefix = uuid.uuid4().hex[:12]  # ids unique across processes: another ledger ignores them
        self._seq = itertools.count(1)
        self._last_seq = 0
        self.num_registered = 0
        self.num_released = 0
        self.num_expired = 0

    def in_flight(self, peer: str) -> InFlight:
        """The pulls in flight to `peer` (a store's data address)."""
        with self._lock:
            self._expire(self._clock())
            p = self._peers.get(peer)
            rate = self._rates.get(peer, 0.0)
            if p is None:
                return InFlight(bytes_per_s=rate)
            return InFlight(num_pulls=p.num_pulls, nbytes=p.nbytes, bytes_per_s=rate)

    def contended_rates(self) -> dict[str, float]:
        """Peer -> the contended throughput learned for it (B/s); peers with none are absent."""
        with self._lock:
            return dict(self._rates)

    def register(self, peer_bytes: Mapping[str, int], *, ttl_s: float) -> PullTicket:
        """Register a pull of `peer_bytes[peer]` bytes from each peer; it counts until released or `ttl_s`
        (its deadline: a pull is abandoned by then) has passed. The caller releases it exactly once,
        in a `finally` or a `with` (a second release is a no-op). Raises `InvalidArgument` on negative
        bytes or a non-positive ttl."""
        if not ttl_s > 0.0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s!r}")
        if any(n < 0 for n in peer_bytes.values()):
            raise InvalidArgument("pull bytes must be >= 0")
        items = tuple((peer, int(n)) for peer, n in peer_bytes.items() if n > 0)
        seq = next(self._seq)
        ticket_id = f"{self._prefix}-{seq}"
        with self._lock:
            now = self._clock()
            self._expire(now)
            before = []
            for peer, n in items:
                p = self._peers.setdefault(peer, _Peer())
                before.append(p.nbytes)
                p.num_pulls += 1
                p.nbytes += n
            crowded = bool(self._entries)
            self.num_registered += 1
            self._last_seq = seq
            self._entries[ticket_id] = _Entry(items, tuple(before), now + ttl_s, crowded, seq)
        return PullTicket(self, ticket_id)

    def overlapped(self, ticket_id: str | None) -> bool:
        """Whether another pull (to any peer) was in flight at some time in this registered pull's life so
        far: its time then says as much about the contention (the link, and the CPU on a shared host) as
        about the link, so it must not correct the single-stream link estimate. False for an unknown id."""
        if ticket_id is None:
            return False
        with self._lock:
            e = self._entries.get(ticket_id)
            return e is not None and (e.crowded or self._last_seq > e.seq)

    def release(self, ticket_id: str | None, *, elapsed_s: float | None = None) -> bool:
        """End a pull by id (None or unknown: nothing, False). Exactly once: True the first time.
        `elapsed_s`: how long the pull took (a pull cut off at its deadline: that deadline), from which a
        pull that waited behind others teaches its peer's contended throughput."""
        if ticket_id is None:
            return False
        with self._lock:
            entry = self._entries.pop(ticket_id, None)
            if entry is None:
                return False
            self._remove(entry)
            self.num_released += 1
            if elapsed_s is not None and elapsed_s > 0.0:
                for (peer, n), queued in zip(entry.peers, entry.queued_before, strict=True):
                    if queued > 0:
                        self._learn(peer, (queued + n) / elapsed_s)
        return True

    def withdraw(self, ticket_id: str | None) -> bool:
        """Undo a registration that stood for a decision about to be made again (a pull decided on a shared
        match answer, held while the request asks the master): as if never registered, it teaches nothing
        and counts neither as registered nor as released. None or unknown: nothing, False."""
        if ticket_id is None:
            return False
        with self._lock:
            entry = self._entries.pop(ticket_id, None)
            if entry is None:
                return False
            self._remove(entry)
            self.num_registered -= 1
        return True

    def _learn(self, peer: str, bytes_per_s: float) -> None:
        old = self._rates.pop(peer, None)
        self._rates[peer] = bytes_per_s if old is None else old + RATE_WEIGHT * (bytes_per_s - old)
        if len(self._rates) > MAX_RATE_PEERS:
            del self._rates[next(iter(self._rates))]

    def _expire(self, now: float) -> None:
        for ticket_id in [t for t, e in self._entries.items() if e.expires_at <= now]:
            self._remove(self._entries.pop(ticket_id))
            self.num_expired += 1

    def _remove(self, entry: _Entry) -> None:
        for peer, n in entry.peers:
            p = self._peers[peer]
            p.num_pulls -= 1
            p.nbytes -= n
            if p.num_pulls == 0:
                del self._peers[peer]
