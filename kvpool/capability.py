"""Data-plane capabilities: the master's proof that a reader or writer may touch one slot of one store.

A capability is an HMAC-SHA256 (RFC 2104; SHA-256 per FIPS 180-4), truncated to `CAPABILITY_NBYTES`
(RFC 2104 §5 allows truncation to at least half the hash and at least 80 bits), keyed by the cluster
secret, over a tagged, length-prefixed message binding the operation (`read` or `write`: a read
capability never lets anyone write), namespace, block hash, store node id, slot, slot generation and
expiry (wall-clock ms since the Unix epoch). The master signs one per replica it returns from
`MatchPrefix` (a read lease) and per slot of a `Reserve` answer (a write lease); store nodes verify it
against the block their slot records, so reaching a store's UCX port is not enough to read or write KV.

The secret comes from `KVPOOL_CLUSTER_SECRET` or the file named by `KVPOOL_CLUSTER_SECRET_FILE` (the one
config loader: defaults < env). Master and store nodes need it; serving nodes and clients never do (they
only pass capabilities on). With no secret, capabilities are off: every store serves any well-formed
request (local development). `kvpool up` and `LocalCluster` generate one per cluster.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from kvpool.config import KVPoolSettings, load_config
from kvpool.errors import InvalidArgument, PermissionDenied
from kvpool.types import Clock

log = logging.getLogger(__name__)

READ = "read"
WRITE = "write"
CAPABILITY_NBYTES = 16
"""Bytes of a capability: the leading 128 bits of the HMAC-SHA256."""
MIN_SECRET_NBYTES = 16
"""A cluster secret shorter than this (128 bits) is refused."""
DEFAULT_SKEW_MS = 2000
"""How far a store's wall clock may run ahead of the master's before a fresh capability looks expired."""

_TAG = b"\x0fkvpool-cap-v1\x00"
EPOCH_NBYTES = 8
"""A capability minted by a master leading at epoch E > 0 (`kvpool.master.ha`) is the MAC over the message
followed by E (big-endian u64), then E itself: `CAPABILITY_NBYTES + EPOCH_NBYTES` bytes. A store refuses one
older than the newest leader epoch it has taken an order from (a deposed leader's). Epoch 0 (a single
master) keeps the 16-byte form."""
_U64 = struct.Struct(">Q")
_SLOT_GEN = struct.Struct(">QQ")
_BLOCK = 64  # SHA-256 block size in bytes (RFC 2104's B)


class WallClock:
    """Wall-clock time in integer ms since the Unix epoch (comparable across hosts, unlike monotonic)."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


def _lp(value: bytes) -> bytes:
    return len(value).to_bytes(2, "big") + value


def _prefix(op: str, namespace: bytes, expiry_ms: int) -> bytes:
    if op not in (READ, WRITE):
        raise InvalidArgument(f"capability operation must be {READ!r} or {WRITE!r}, got {op!r}")
    try:
        return b"".join((_TAG, _lp(op.encode()), _lp(namespace), _U64.pack(expiry_ms)))
    except (OverflowError, struct.error) as exc:
        raise InvalidArgument(f"malformed capability fields: {exc}") from None


def _suffix(node: bytes, block_hash: bytes, slot: int, generation: int) -> bytes:
    try:
        return b"".join((node, _lp(block_hash), _SLOT_GEN.pack(slot, generation)))
    except (OverflowError, struct.error) as exc:
        raise InvalidArgument(f"malformed capability fields: {exc}") from None


def message(
    op: str, namespace: bytes, block_hash: bytes, node_id: str, slot: int, generation: int, expiry_ms: int
) -> bytes:
    """The signed bytes: a tag, then op, namespace, expiry, node id, block hash, slot, generation (byte
    strings behind a 2-byte big-endian length, integers as big-endian u64). The fields shared by every
    block of one answer come first, so a batch signs from one precomputed state (`Capabilities.signer`)."""
    return _prefix(op, namespace, expiry_ms) + _suffix(_lp(node_id.encode()), block_hash, slot, generation)


class CapabilityKey:
    """The cluster secret with RFC 2104's keyed inner and outer SHA-256 states computed once (§4's
    implementation note), so one MAC costs two hash-state copies and two short hashes (~1 µs)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_NBYTES:
            raise InvalidArgument(f"the cluster secret must be at least {MIN_SECRET_NBYTES} bytes")
        key = hashlib.sha256(secret).digest() if len(secret) > _BLOCK else secret
        key = key.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def keyed(self, prefix: bytes) -> Callable[[bytes], bytes]:
        """`mac(suffix)` = HMAC-SHA256(secret, prefix + suffix) truncated to `CAPABILITY_NBYTES`; the
        inner state absorbs `prefix` once, for many suffixes."""
        inner = self._inner.copy()
        inner.update(prefix)
        outer_base = self._outer

        def mac(suffix: bytes) -> bytes:
            h = inner.copy()
            h.update(suffix)
            outer = outer_base.copy()
            outer.update(h.digest())
            return outer.digest()[:CAPABILITY_NBYTES]

        return mac

    def mac(self, data: bytes) -> bytes:
        """HMAC-SHA256(secret, data) truncated to `CAPABILITY_NBYTES`."""
        return self.keyed(b"")(data)

    def hmac256(self, data: bytes) -> bytes:
        """The whole HMAC-SHA256(secret, data), 32 bytes (membership proofs, `kvpool.membership`)."""
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


class Capabilities:
    """Signs (master) and checks (store node) capabilities with one cluster key. Thread-safe.

    `clock` is wall-clock ms (injected for tests); `skew_ms` is the clock difference tolerated between
    master and store.
    """

    def __init__(
        self, key: CapabilityKey, *, clock: Clock | None = None, skew_ms: int = DEFAULT_SKEW_MS
    ) -> None:
        self._key = key
        self.clock = clock or WallClock()
        self.skew_ms = skew_ms

    def expiry(self, ttl_ms: int) -> int:
        """The expiry of a capability issued now for `ttl_ms`."""
        return self.clock.now_ms() + ttl_ms

    def sign(
        self,
        op: str,
        namespace: bytes,
        block_hash: bytes,
        node_id: str,
        slot: int,
        generation: int,
        expiry_ms: int,
        epoch: int = 0,
    ) -> bytes:
        data = message(op, namespace, block_hash, node_id, slot, generation, expiry_ms)
        if not epoch:
            return self._key.mac(data)
        tail = _U64.pack(epoch)
        return self._key.mac(data + tail) + tail

    def proof(self, message: bytes) -> bytes:
        """HMAC-SHA256(cluster secret, message), 32 bytes: a membership proof (`kvpool.membership`)."""
        return self._key.hmac256(message)

    def signer(
        self, op: str, namespace: bytes, expiry_ms: int, epoch: int = 0
    ) -> Callable[[str, bytes, int, int], bytes]:
        """`sign(node_id, block_hash, slot, generation)` for many blocks sharing op, namespace, expiry and
        leader epoch (the master's batch path: the shared prefix is hashed once)."""
        mac = self._key.keyed(_prefix(op, namespace, expiry_ms))
        nodes: dict[str, bytes] = {}
        tail = _U64.pack(epoch) if epoch else b""

        def sign(node_id: str, block_hash: bytes, slot: int, generation: int) -> bytes:
            node = nodes.get(node_id)
            if node is None:
                node = nodes[node_id] = _lp(node_id.encode())
            if tail:
                return mac(_suffix(node, block_hash, slot, generation) + tail) + tail
            return mac(_suffix(node, block_hash, slot, generation))

        return sign

    def check(
        self,
        op: str,
        namespace: bytes,
        block_hash: bytes,
        node_id: str,
        slot: int,
        generation: int,
        expiry_ms: int,
        capability: bytes,
        min_epoch: int = 0,
    ) -> None:
        """Raise `PermissionDenied` ("capability missing/invalid/expired", or "fenced" for one minted at a
        leader epoch above 0 but below `min_epoch`; epoch 0, a single master's, is never fenced:
        `kvpool.store.fence`) unless `capability` is what the master signed for exactly these
        fields and has not expired (constant-time comparison)."""
        if not capability:
            raise PermissionDenied(f"capability missing for {op} of slot {slot}")
        epoch = 0
        if len(capability) == CAPABILITY_NBYTES + EPOCH_NBYTES:
            epoch = _U64.unpack(bytes(capability[CAPABILITY_NBYTES:]))[0]
        if 0 < epoch < min_epoch:
            raise PermissionDenied(f"capability fenced: epoch {epoch} < {min_epoch} ({op} of slot {slot})")
        try:
            want = self.sign(op, namespace, block_hash, node_id, slot, generation, expiry_ms, epoch)
        except InvalidArgument:
            want = b""
        if not hmac.compare_digest(want, bytes(capability)):
            raise PermissionDenied(f"capability invalid for {op} of slot {slot} generation {generation}")
        now = self.clock.now_ms()
        if now > expiry_ms + self.skew_ms:
            raise PermissionDenied(f"capability expired for {op} of slot {slot} ({now - expiry_ms} ms ago)")


def capability_epoch(capability: bytes) -> int:
    """The leader epoch `capability` was minted at (0: a single master's, or no epoch)."""
    if len(capability) == CAPABILITY_NBYTES + EPOCH_NBYTES:
        return int(_U64.unpack(bytes(capability[CAPABILITY_NBYTES:]))[0])
    return 0


def refused(error: str) -> bool:
    """True when a per-block transfer error is a store refusing the capability (not a bad replica)."""
    return PermissionDenied.__name__ in error


class CapabilitySettings(KVPoolSettings):
    """The cluster secret (env `KVPOOL_CLUSTER_SECRET` or `KVPOOL_CLUSTER_SECRET_FILE`); empty = off."""

    cluster_secret: str = Field(default="", description="shared HMAC key of master and stores; empty = off")
    cluster_secret_file: str = Field(default="", description="file holding the secret (mode 0600)")
    capability_skew_ms: int = Field(default=DEFAULT_SKEW_MS, ge=0, description="tolerated clock skew")


def from_settings(settings: CapabilitySettings, *, clock: Clock | None = None) -> Capabilities | None:
    """`Capabilities` for the configured secret; None when none is configured. Raises `InvalidArgument`
    for both settings at once, an unreadable file, a file its group or others may read, write or execute
    (mode other than 0600/0400), or a short secret."""
    if settings.cluster_secret and settings.cluster_secret_file:
        raise InvalidArgument("set cluster_secret or cluster_secret_file, not both")
    secret = settings.cluster_secret.encode()
    if settings.cluster_secret_file:
        path = Path(settings.cluster_secret_file)
        try:
            secret = path.read_bytes().strip()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise InvalidArgument(f"cannot read the cluster secret file {path}: {exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgument(
                f"the cluster secret file {path} is open to its group or others (mode "
                f"{stat.S_IMODE(mode):04o}): refusing to use it; chmod 600 {path}"
            )
    if not secret:
        return None
    return Capabilities(CapabilityKey(secret), clock=clock, skew_ms=settings.capability_skew_ms)


@functools.lru_cache(maxsize=1)
def process_capabilities() -> Capabilities | None:
    """This process's capabilities from the environment, read once (tests call `cache_clear()`)."""
    caps = from_settings(load_config(CapabilitySettings))
    log.info("data-plane capabilities: %s", "on" if caps is not None else "off (no cluster secret)")
    return caps


SECRET_ROLES = ("master", "store")
"""The roles that hold the cluster secret (serving nodes and clients only pass capabilities on)."""
_ENV_NAMES = ("KVPOOL_CLUSTER_SECRET", "KVPOOL_CLUSTER_SECRET_FILE")


def new_secret_env(directory: Path | None = None) -> dict[str, str]:
    """Environment entries giving a cluster's master and stores a fresh random 256-bit secret: in a new
    0600 file under `directory` (`KVPOOL_CLUSTER_SECRET_FILE`), else inline (`KVPOOL_CLUSTER_SECRET`;
    environments are private to their user, unlike command lines). {} when the environment already
    configures a secret."""
    if any(os.environ.get(name) for name in _ENV_NAMES):
        return {}
    secret = secrets.token_hex(32)
    if directory is None:
        return {"KVPOOL_CLUSTER_SECRET": secret}
    path = Path(directory) / "cluster_secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return {"KVPOOL_CLUSTER_SECRET_FILE": str(path)}
