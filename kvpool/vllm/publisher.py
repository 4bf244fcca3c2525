"""Publish saved blocks two-phase (reserve, write, commit) on a background thread, in bounded host memory.

The worker copies a step's full blocks out of vLLM's cache right after the forward (`PagedLayout.gather`)
and hands them here; the engine never waits on the pool. Blocks of one request are published in the order
they were saved (one thread), so a chain's parent is always committed before its children. When more than
`max_bytes` wait, new saves are dropped (a later miss, never a stalled engine) and counted; once a request
lost a save, its later saves are dropped too (their parent would be missing).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from kvpool.connector.connector import KVConnector

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PublishJob:
    """Publish `blocks` (uint8 rows of `block_nbytes`) as chain blocks `start_block..` of `hashes`."""

    request_id: str
    ns: bytes
    hashes: list[bytes]
    start_block: int
    blocks: np.ndarray
    flush_epoch: int | None


@dataclass(slots=True)
class PublishCounters:
    num_jobs: int = 0
    num_committed_blocks: int = 0
    num_existing_blocks: int = 0
    num_failed_jobs: int = 0
    num_dropped_jobs: int = 0


class Publisher:
    """One publishing thread over `connector.publish`. Thread-safe `submit`; `close` drains (bounded)."""

    def __init__(self, connector: KVConnector, *, max_bytes: int) -> None:
        self.connector = connector
        self.max_bytes = max_bytes
        self.counters = PublishCounters()
        self._queue: queue.Queue[PublishJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_bytes = 0
        self._broken: set[str] = set()  # requests that lost a save: their later blocks have no parent
        self._thread = threading.Thread(target=self._run, name="kvpool-publish", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, job: PublishJob) -> bool:
        """Queue a job; False (and counted) when it was dropped for memory or a broken chain."""
        with self._lock:
            if job.request_id in self._broken or self._pending_bytes + job.blocks.nbytes > self.max_bytes:
                self._broken.add(job.request_id)
                self.counters.num_dropped_jobs += 1
                log.warning(
                    "[%s] publish of %d blocks dropped (%d B waiting, limit %d B)",
                    job.request_id,
                    len(job.blocks),
                    self._pending_bytes,
                    self.max_bytes,
                )
                return False
            self._pending_bytes += job.blocks.nbytes
        self._queue.put(job)
        return True

    def forget(self, request_id: str) -> None:
        """The request is gone: stop remembering that its chain broke."""
        with self._lock:
            self._broken.discard(request_id)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                broken = job.request_id in self._broken
            if broken:  # an earlier job of this request failed after this one was queued: no parent
                with self._lock:
                    self.counters.num_dropped_jobs += 1
                    self._pending_bytes -= job.blocks.nbytes
                    self._idle.notify_all()
                continue
            try:
                committed, existing = self.connector.publish(
                    job.ns,
                    job.hashes,
                    list(job.blocks),
                    start_block=job.start_block,
                    request_id=job.request_id,
                    flush_epoch=job.flush_epoch,
                )
                with self._lock:
                    self.counters.num_jobs += 1
                    self.counters.num_committed_blocks += committed
                    self.counters.num_existing_blocks += existing
            except Exception as exc:  # noqa: BLE001 - a failed publish costs later hits, nothing else
                with self._lock:
                    self.counters.num_failed_jobs += 1
                    self._broken.add(job.request_id)
                log.warning("[%s] publish failed: %s", job.request_id, exc)
            finally:
                with self._lock:
                    self._pending_bytes -= job.blocks.nbytes
                    self._idle.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued job is done (True) or `timeout_s` passed (False)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending_bytes == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Publish what is queued (at most `timeout_s`), then stop the thread."""
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=1.0)
