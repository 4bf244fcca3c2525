"""Values and seams of the transport: block requests, per-block results, link estimates, protocols.

Depends on nothing in the project (stdlib, numpy only); checksums live in `transfer.xxh3`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np


class TransferError(Exception):
    """Moving a block's bytes failed (peer died, deadline passed, refused, checksum mismatch)."""


class PeerLost(TransferError):
    """The connection to the peer failed: an endpoint error, the peer closed it, no connection within the
    connect timeout, or nothing heard from the peer for the transport's stall bound while a transfer
    waited. The transport backs off from the peer (`transfer.backoff`)."""


class TransferTimedOut(TransferError):
    """A transfer missed its own deadline while the peer was answering (a slow transfer, e.g. one of a
    convoy sharing the link): its unfinished blocks fail, the peer is not backed off and the connection
    the other transfers share stays open."""


@dataclass(frozen=True, slots=True)
class BlockRead:
    """Read `nbytes` from `slot`, valid only while the slot is at `generation`.

    `capability` (opaque bytes from the master, empty when none) and its `expiry_ms` travel to the
    store, which refuses the block without a valid one when capabilities are on.
    """

    slot: int
    generation: int
    nbytes: int
    capability: bytes = b""
    expiry_ms: int = 0


@dataclass(frozen=True, slots=True)
class BlockWrite:
    """Write `data` into a reserved `slot` at `generation`; `checksum` is xxh3_64 of `data`;
    `capability`/`expiry_ms` as for `BlockRead` (a write capability)."""

    slot: int
    generation: int
    data: memoryview | bytes | np.ndarray
    checksum: int
    capability: bytes = b""
    expiry_ms: int = 0


class BlockResult(NamedTuple):
    """The outcome of one block: `checksum` is the verified checksum when `ok`, `error` says why not.
    (A named tuple: a batch of 256 is built in ~40 instead of ~170 us, a tenth of a same-host 64 KiB read.)"""

    ok: bool
    checksum: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """Calibrated cost of moving `n` bytes to/from a peer: `alpha_s + n / beta_bytes_per_s`."""

    alpha_s: float
    beta_bytes_per_s: float
    samples: int = 0

    def predict_s(self, nbytes: int) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s if self.beta_bytes_per_s > 0 else math.inf


class Overlap:
    """Transfers in flight in one transport, to tell a transfer that ran alone from one that shared the
    link and the CPU with others (only the first measures the link: a convoy's time would teach the
    tracker a contended bandwidth as if it were the link's). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._started = 0

    def begin(self) -> tuple[bool, int]:
        """A transfer starts: a token for `end`."""
        with self._lock:
            crowded = self._active > 0
            self._active += 1
            self._started += 1
            return crowded, self._started

    def end(self, token: tuple[bool, int]) -> bool:
        """The transfer of `token` ended: True when no other transfer overlapped it."""
        crowded, seq = token
        with self._lock:
            self._active -= 1
            return not crowded and self._started == seq


class LinkTracker:
    """Per-peer link estimates: set by the connect probe, EWMA-updated by real transfers. Thread-safe."""

    def __init__(self, weight: float = 0.2) -> None:
        self._weight = weight
        self._lock = threading.Lock()
        self._links: dict[str, LinkEstimate] = {}

    def get(self, peer: str) -> LinkEstimate | None:
        with self._lock:
            return self._links.get(peer)

    def set(self, peer: str, alpha_s: float, beta_bytes_per_s: float) -> LinkEstimate:
        with self._lock:
            est = LinkEstimate(alpha_s, beta_bytes_per_s, 1)
            self._links[peer] = est
            return est

    def observe(self, peer: str, nbytes: int, elapsed_s: float) -> None:
        """Fold one real transfer (`nbytes` in `elapsed_s`) into the bandwidth estimate."""
        if nbytes <= 0 or elapsed_s <= 0:
            return
        with self._lock:
            old = self._links.get(peer)
            if old is None:
                self._links[peer] = LinkEstimate(0.0, nbytes / elapsed_s, 1)
                return
            beta = nbytes / max(elapsed_s - old.alpha_s, elapsed_s * 0.1)
            w = self._weight
            self._links[peer] = LinkEstimate(
                old.alpha_s, (1 - w) * old.beta_bytes_per_s + w * beta, old.samples + 1
            )


class Transport(Protocol):
    """Moves whole blocks between this process and a `BlockServer` at `peer` ("host:port").

    Every call has a deadline: a dead or stalled peer makes every unfinished block fail within `timeout_s`
    (never a hang) and the transport stays usable for other peers (and for that peer once it is back).
    """

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        """Fill `out[i]` (caller-owned, `reads[i].nbytes` long) with block i and verify its checksum.

        One result per read; a failed block's `out[i]` holds unspecified bytes.
        """
        ...

    def write_blocks(self, peer: str, writes: Sequence[BlockWrite], *, timeout_s: float) -> list[BlockResult]:
        """Send each block; the server verifies `checksum` against the bytes that landed. One result per write."""
        ...

    def link(self, peer: str) -> LinkEstimate:
        """The link estimate to `peer` (connects and probes it when not known yet)."""
        ...

    def close(self) -> None: ...


class BlockHandler(Protocol):
    """The store side of the data plane; a `BlockServer` calls it for every block it moves.

    `begin_*` marks the slot in flight (a free order is deferred until the matching `end_*`); every
    successful `begin_*` is followed by exactly one `end_*`, whatever happens to the transfer.

    Optional: `begin_reads_array(reads)`, `begin_reads` of a batch without capabilities given as one
    integer array (n, 3) of (slot, generation, nbytes): when every read would succeed, all are begun and
    (buffer, starts, checksums) returned (the buffer the blocks lie in; each block's start in it in bytes
    and its stored checksum, uint64 (n,)); else None with nothing begun. A server uses it when present.

    Optional: `blocking_slots_from: int | None`, the first slot whose `begin_reads` blocks on I/O (a store's
    disk tier): a server begins a message naming any such slot on a worker thread, never on its loop.
    """

    def begin_read(
        self, slot: int, generation: int, nbytes: int, capability: bytes = b"", expiry_ms: int = 0
    ) -> tuple[memoryview, int]:
        """The committed block's bytes and its stored checksum; raises if stale, unknown, uncommitted or
        (when the handler checks capabilities) without a valid read capability."""
        ...

    def end_read(self, slot: int) -> None: ...

    def begin_reads(
        self, reads: Sequence[tuple[int, int, int, bytes, int]]
    ) -> Sequence[tuple[memoryview, int] | Exception]:
        """`begin_read` of each (slot, generation, nbytes, capability, expiry_ms) in one call (one lock per
        message): per read, its (bytes, stored checksum) or the exception `begin_read` would raise."""
        ...

    def end_reads(self, slots: Sequence[int]) -> None:
        """`end_read` of each slot."""
        ...

    def begin_write(
        self, slot: int, generation: int, nbytes: int, capability: bytes = b"", expiry_ms: int = 0
    ) -> memoryview:
        """The reserved slot's buffer to receive into; raises if not reserved at `generation` or (when
        the handler checks capabilities) without a valid write capability."""
        ...

    def end_write(
        self, slot: int, generation: int, checksum: int, ok: bool, landed_checksum: int | None = None
    ) -> None:
        """The transfer ended (`ok`: all bytes landed): verify `checksum`; raise on mismatch.
        `landed_checksum`: the xxh3 of the slot's bytes, when the transport already hashed them after they
        landed (the slot cannot change while it is being written); else the handler hashes them."""
        ...


class BlockServer(Protocol):
    """Serves a `BlockHandler` to remote transports."""

    def start(self) -> int:
        """Start serving; returns the bound port."""
        ...

    def stop(self) -> None: ...


def validate_batch(nreads: int, nout: int) -> None:
    if nreads != nout:
        raise ValueError(f"{nreads} reads but {nout} output buffers")
