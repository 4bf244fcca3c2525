"""Data-plane failures reported to the master off the request path (`kvpool.master.dataplane`).

A reader or writer that saw a store's data plane fail calls `DataPlaneReporter.report`; it never blocks
and never raises: reports go through a bounded queue to one daemon thread (dropped when the queue is
full), and one (store, kind) is reported at most once per `min_interval_s`, so a batch of failed blocks
is one failure, not one per block.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
IDLE_EXIT_S = 2.0

Send = Callable[[str, int, str, str], None]
"""(node_id, epoch, kind, detail): `MasterClient.report_dataplane_failure`."""


class DataPlaneReporter:
    def __init__(self, send: Send, *, min_interval_s: float = 1.0, max_queued: int = 64) -> None:
        self._send = send
        self._min_interval_s = min_interval_s
        self._queue: queue.Queue[tuple[str, int, str, str]] = queue.Queue(max_queued)
        self._last: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def report(self, node_id: str, epoch: int, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get((node_id, kind))
            if last is not None and now - last < self._min_interval_s:
                return
            if len(self._last) > 1024:
                self._last.clear()
            self._last[(node_id, kind)] = now
        try:
            self._queue.put_nowait((node_id, epoch, kind, detail[:256]))
        except queue.Full:
            log.debug("data-plane report of %s dropped: queue full", node_id)
            return
        with self._lock:  # after the put: a thread about to exit sees the item, or we start one
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvpool-dataplane-reports", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        """Sends until the queue stays empty for `IDLE_EXIT_S` (a later report starts a new thread)."""
        while True:
            try:
                node_id, epoch, kind, detail = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                self._send(node_id, epoch, kind, detail)
            except Exception as exc:  # noqa: BLE001 - best effort: the master may be down
                log.debug("could not report a %s failure of store %s: %s", kind, node_id, exc)
