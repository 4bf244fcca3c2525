"""Fencing of deposed masters (kvpool.master.ha): the newest leader epoch a store has taken an order from.

Control orders (reserve, commit, free, copy) and data-plane capabilities carry the epoch of the master that
issued them (0 for a single master); the store refuses an older one, so a deposed or partitioned leader can
neither allocate a slot nor mint a capability this store accepts once a newer leader has ordered it.

An order at epoch 0 comes from a single master (masters in HA never send 0) and is never refused: a stray
or fuzzed order with a huge epoch must not lock a single master out of its stores. Without a cluster
secret anyone may send a store orders, so fencing protects HA pools against deposed leaders, not against
hostile clients; with one, only the master's credential opens the store's control calls
(`kvpool.membership`).
"""

from __future__ import annotations

import threading

from kvpool.errors import FailedPrecondition


class EpochFence:
    """The newest master leader epoch this store has taken an order from; an order carrying an older one
    (a deposed or partitioned leader's) is refused. Epoch 0 (a single master, no HA) is never refused.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0
        self.epochs: list[int] = []
        """The epochs this store took orders from, in the order first taken (each newer than the last)."""
        self.num_refused = 0
        """Orders refused as fenced (an older epoch's)."""

    def check(self, epoch: int) -> None:
        """Record `epoch`, or raise FailedPrecondition "fenced: epoch N < M" when it is older."""
        if epoch == self.highest or epoch == 0:  # the steady state (or a single master): no lock
            return
        with self._lock:
            if epoch < self.highest:
                self.num_refused += 1
                raise FailedPrecondition(f"fenced: epoch {epoch} < {self.highest}")
            if epoch > self.highest:  # another thread may have taken the same new epoch first
                self.epochs.append(epoch)
                self.highest = epoch
