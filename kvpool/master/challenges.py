"""Stateless store join challenges: a MAC'd (node id, time, nonce), checked when the store registers.

A challenge is `issued_ms (8 bytes, big-endian) | nonce (16 random bytes) | mac (32 bytes)`, 56 bytes,
where `mac` = HMAC-SHA256 under the cluster secret (`Capabilities.proof`) over a tag, this master
process's random instance id, the node id, `issued_ms` and the nonce. `issued_ms` is the master's
monotonic clock, so only the master process that minted a challenge accepts it (the instance id in the
MAC says so even when two masters' clocks agree); a store asks again after a failover.

The master keeps nothing per challenge it hands out: `JoinChallenge` costs one MAC and no memory, so
no caller, however many, can stop a store from registering. At registration (`ChallengeMinter.check`)
the challenge must carry this master's MAC for the registering node id and be at most `ttl_ms` old.
A challenge spent by a successful registration is remembered until it expires (`SpentChallenges`), per
node id, at most `max_per_node` per node id: past that the oldest is forgotten and the node's floor
rises to its time, so every challenge of that node minted at or before it is refused too. Only a
successful proof (a holder of the cluster secret) adds an entry.
"""

from __future__ import annotations

import hmac
import secrets
import struct
import threading
from collections import OrderedDict

from kvpool.capability import Capabilities
from kvpool.errors import Unauthenticated

CHALLENGE_NBYTES = 56
"""issued_ms (8) + nonce (16) + HMAC-SHA256 (32)."""
NONCE_NBYTES = 16
FUTURE_SKEW_MS = 1_000
"""A challenge minted up to this far in the future (ms) is accepted (the clock never goes back: margin)."""

_TAG = b"\x13kvpool-challenge-v1\x00"
_U64 = struct.Struct(">Q")


def _lp(value: bytes) -> bytes:
    return len(value).to_bytes(2, "big") + value


class ChallengeMinter:
    """Mints and checks challenges under the cluster secret. Thread-safe (holds no mutable state)."""

    def __init__(self, capabilities: Capabilities, *, ttl_ms: int) -> None:
        self._caps = capabilities
        self._ttl_ms = ttl_ms
        self._instance = secrets.token_bytes(16)

    def _mac(self, node_id: str, issued_ms: int, nonce: bytes) -> bytes:
        node = node_id.encode()[:0xFFFF]
        return self._caps.proof(b"".join((_TAG, self._instance, _lp(node), _U64.pack(issued_ms), nonce)))

    def mint(self, node_id: str, now_ms: int) -> bytes:
        """A fresh challenge for `node_id` (56 bytes), minted at `now_ms` (the master's clock, ms)."""
        nonce = secrets.token_bytes(NONCE_NBYTES)
        issued = _U64.pack(now_ms)
        return issued + nonce + self._mac(node_id, now_ms, nonce)

    def check(self, challenge: bytes, node_id: str, now_ms: int) -> int:
        """The challenge's `issued_ms` when it is this master's, for `node_id`, and at most `ttl_ms` old.
        Raises `Unauthenticated` otherwise (malformed, forged, another node's, another master's,
        expired)."""
        if len(challenge) != CHALLENGE_NBYTES:
            raise Unauthenticated(
                f"store {node_id!r}: malformed join challenge ({len(challenge)} bytes, not "
                f"{CHALLENGE_NBYTES}); ask this master for one (JoinChallenge)"
            )
        (issued_ms,) = _U64.unpack_from(challenge, 0)
        nonce, mac = challenge[8 : 8 + NONCE_NBYTES], challenge[8 + NONCE_NBYTES :]
        if not hmac.compare_digest(self._mac(node_id, issued_ms, nonce), mac):
            raise Unauthenticated(
                f"store {node_id!r}: the join challenge is not this master's for this node id "
                "(forged, another node's, or from a master that has since restarted or failed over)"
            )
        if issued_ms > now_ms + FUTURE_SKEW_MS or now_ms - issued_ms > self._ttl_ms:
            raise Unauthenticated(
                f"store {node_id!r}: the join challenge expired (older than challenge_ttl_ms = "
                f"{self._ttl_ms}); ask for a new one"
            )
        return issued_ms


class SpentChallenges:
    """Challenges spent by successful registrations, per node id, until they expire. Thread-safe.

    Bounded: at most `max_per_node` per node id (then the node's floor rises, see the module
    docstring), and a node id's entry is dropped once everything it holds has expired."""

    def __init__(self, *, max_per_node: int) -> None:
        if max_per_node < 1:
            raise ValueError("max_per_node must be at least 1")
        self._max = max_per_node
        self._lock = threading.Lock()
        # node id -> (floor issued_ms, {challenge: issued_ms}); a challenge issued at or before the
        # floor counts as spent
        self._by_node: dict[str, tuple[int, OrderedDict[bytes, int]]] = {}
        self._num_spends = 0

    def spend(self, node_id: str, challenge: bytes, issued_ms: int, now_ms: int, ttl_ms: int) -> bool:
        """Record `challenge` (minted at `issued_ms`) as spent by `node_id`; False when it was already
        spent (or lies at or below the node's floor)."""
        horizon = now_ms - ttl_ms  # anything issued at or before this has expired anyway
        with self._lock:
            floor, seen = self._by_node.get(node_id, (-1, OrderedDict()))
            if issued_ms <= floor or challenge in seen:
                return False
            while seen and next(iter(seen.values())) <= horizon:
                seen.popitem(last=False)
            seen[challenge] = issued_ms
            while len(seen) > self._max:
                _, oldest = seen.popitem(last=False)
                floor = max(floor, oldest)
            self._by_node[node_id] = (floor, seen)
            self._num_spends += 1
            if self._num_spends % 256 == 0:
                self._sweep(horizon)
        return True

    def _sweep(self, horizon: int) -> None:
        for node_id in list(self._by_node):
            floor, seen = self._by_node[node_id]
            if floor <= horizon and all(t <= horizon for t in seen.values()):
                del self._by_node[node_id]

    def size(self) -> int:
        """Challenges remembered, all node ids."""
        with self._lock:
            return sum(len(seen) for _, seen in self._by_node.values())
