"""Fencing of deposed masters (kvpool.master.ha): the newest leader epoch a store has taken an order from.

Control orders (reserve, commit, free, copy) and data-plane capabilities carry the epoch of the master that
issued them (0 for a single master); the store refuses an older one, so a deposed or partitioned leader can
neither allocate a slot nor mint a capability this store accepts once a newer leader has ordered it.
"""

from __future__ import annotations

import threading

from kvpool.errors import FailedPrecondition


class EpochFence:
    """The newest master leader epoch this store has taken an order from; an order carrying an older one
    (a deposed or partitioned leader's) is refused. Epoch 0 (a single master, no HA) is never refused while
    no epoch above 0 was seen. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0

    def check(self, epoch: int) -> None:
        """Record `epoch`, or raise FailedPrecondition "fenced: epoch N < M" when it is older."""
        if epoch == self.highest:  # the steady state: one comparison, no lock
            return
        with self._lock:
            if epoch < self.highest:
                raise FailedPrecondition(f"fenced: epoch {epoch} < {self.highest}")
            self.highest = epoch
