"""Read leases released off the request path: a queue drained by one thread, many ids per RPC.

A load's read lease (B13) must end once its pull is over, but the request should not wait for the master
to hear it: on a busy host a `ReleaseLease` round trip per request costs the CPU and the latency that the
pool was meant to save. `LeaseReleaser.release` only queues the id (never blocks, never raises); one daemon
thread sends what is queued in `ReleaseLeases` batches (at most `max_batch` ids per call), so a burst of
requests costs a few RPCs, not one each.

Nothing is lost silently: a batch the master did not take is logged once (one warning per failed batch,
naming how many leases) and not retried; those leases end at their TTL on the master, as an unreleased
lease always does. `close` sends what is queued before it returns (bounded by its timeout).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

MAX_BATCH = 1024
"""Most ids per `ReleaseLeases` call (the master's limit, `kvpool.master.core.MAX_RELEASE_BATCH`)."""


class LeaseReleaser:
    """Releases read leases in the background (see the module docstring). Thread-safe.

    Args:
        send: sends one batch of 1..`max_batch` lease ids to the master (e.g. a bound
            `MasterClient.release_leases`); raises on failure.
        max_batch: most ids per `send` call.
    """

    def __init__(self, send: Callable[[Sequence[int]], object], *, max_batch: int = MAX_BATCH) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch must be > 0, got {max_batch}")
        self._send = send
        self._max_batch = max_batch
        self._cond = threading.Condition()
        self._queue: list[int] = []
        self._sending = 0  # ids taken by the thread and not yet answered
        self._closed = False
        self._close_by_s = float("inf")  # monotonic: past it a closed releaser starts no more calls
        self._thread: threading.Thread | None = None  # started by the first release
        self.num_sent = 0
        """Lease ids the master answered for (released, expired or unknown to it)."""
        self.num_failed = 0
        """Lease ids whose batch failed (logged; they expire at their TTL)."""
        self.num_batches = 0
        """`send` calls made."""

    @property
    def num_pending(self) -> int:
        """Ids queued or being sent."""
        with self._cond:
            return len(self._queue) + self._sending

    def release(self, lease_id: int) -> None:
        """Queue `lease_id` for release; returns at once. After `close`, sends it in this thread (one
        call, failure logged), so a late request's lease is still released."""
        with self._cond:
            if not self._closed:
                self._queue.append(lease_id)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="lease-releaser", daemon=True)
                    self._thread.start()
                self._cond.notify()
                return
        self._send_batch([lease_id])

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every id queued so far was sent (or its batch failed). True when done in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._sending:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (waiting at most `timeout_s`) and stop the thread. Idempotent. Ids still
        queued at the timeout are logged and left to expire; no call starts after it, so the master link
        may be closed once this returns."""
        with self._cond:
            self._closed = True
            self._close_by_s = min(self._close_by_s, time.monotonic() + timeout_s)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        with self._cond:
            left = len(self._queue) + self._sending
            if thread is not None and thread.is_alive():  # stuck in a call: what is queued stays unsent
                self.num_failed += len(self._queue)
                self._queue.clear()
        if left:
            log.warning("lease releaser closed with %d leases unsent: they expire at their TTL", left)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                if self._closed and time.monotonic() >= self._close_by_s:  # close gave up waiting
                    self.num_failed += len(self._queue)
                    self._queue.clear()
                    self._cond.notify_all()
                    return
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                self._sending = len(batch)
            self._send_batch(batch)
            with self._cond:
                self._sending = 0
                self._cond.notify_all()

    def _send_batch(self, batch: list[int]) -> None:
        try:
            self._send(batch)
        except Exception as exc:  # noqa: BLE001 - an unreleased lease expires on its own
            with self._cond:
                self.num_failed += len(batch)
                self.num_batches += 1
            log.warning("releasing %d read leases failed (they expire at their TTL): %s", len(batch), exc)
            return
        with self._cond:
            self.num_sent += len(batch)
            self.num_batches += 1
