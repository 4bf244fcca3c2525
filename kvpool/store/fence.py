"""Fencing of deposed masters (kvpool.master.ha): the newest leader epoch a store has taken an order from.

Control orders (reserve, commit, free, copy) and data-plane capabilities carry the epoch of the master that
issued them (0 for a single master); the store refuses an older one, so a deposed or partitioned leader can
neither allocate a slot nor mint a capability this store accepts once a newer leader has ordered it.

An order at epoch 0 comes from a single master (masters in HA never send 0) and is never refused: a stray
or fuzzed order with a huge epoch must not lock a single master out of its stores. Without a cluster
secret anyone may send a store orders, so fencing protects HA pools against deposed leaders, not against
hostile clients; with one, only the master's credential opens the store's control calls
(`kvpool.membership`), and a store takes a higher epoch only with the leader's proof of it (a MAC under
the secret over its address and that epoch, `kvpool.membership.leader_proof`): an epoch read from a forged
etcd key, or set in a forged order, fences no one.

The fence rises not only on orders: every answer the store gets from a master (registration, heartbeat)
carries that master's leader epoch and proof (`observe`), and a valid capability minted at a newer epoch
proves that epoch too (`kvpool.store.slots`). So once a new leader has answered one heartbeat of a store,
that store refuses the deposed leader's orders, even before the new leader orders it anything. `accepted`
counts the orders taken per epoch: orders taken at an epoch after a newer leader won are a deposed
leader's accepted orders (`deposed_orders_accepted` in docs/bench_faults.md).
"""

from __future__ import annotations

import threading
from collections import Counter

from kvpool.capability import Capabilities
from kvpool.errors import FailedPrecondition, Unauthenticated
from kvpool.membership import check_leader_proof


class EpochFence:
    """The newest master leader epoch this store has taken an order from; an order carrying an older one
    (a deposed or partitioned leader's) is refused. Epoch 0 (a single master, no HA) is never refused.
    With `key` (a secured store), a higher epoch is taken only with its leader proof. Thread-safe."""

    def __init__(self, key: Capabilities | None = None) -> None:
        self._key = key
        self._lock = threading.Lock()
        self.highest = 0
        self.epochs: list[int] = []
        """The epochs this store took orders from, in the order first taken (each newer than the last)."""
        self.num_refused = 0
        """Orders refused as fenced (an older epoch's)."""
        self.num_unproven = 0
        """Orders refused for a higher epoch without a valid leader proof."""
        self.accepted: Counter[int] = Counter()
        """Orders taken per leader epoch (0: a single master's)."""
        self.num_raised_by_answers = 0
        """Times a master's answer or a capability (not an order) raised the fence."""

    def check(self, epoch: int, proof: str = "") -> None:
        """Record `epoch`, or raise FailedPrecondition "fenced: epoch N < M" when it is older, and (a secured
        store) `Unauthenticated` when it is newer and `proof` is not its `leader_proof`."""
        if epoch == self.highest or epoch == 0:  # the steady state (or a single master)
            with self._lock:
                if epoch == self.highest or epoch == 0:
                    self.accepted[epoch] += 1
                    return
        with self._lock:
            if epoch < self.highest:
                self.num_refused += 1
                raise FailedPrecondition(f"fenced: epoch {epoch} < {self.highest}")
            if epoch > self.highest and self._key is not None:
                try:
                    check_leader_proof(self._key, epoch, proof)
                except Unauthenticated:
                    self.num_unproven += 1
                    raise
            if epoch > self.highest:  # another thread may have taken the same new epoch first
                self.epochs.append(epoch)
                self.highest = epoch
            self.accepted[epoch] += 1

    def accepted_by_epoch(self) -> dict[int, int]:
        """A copy of `accepted`: orders taken per leader epoch."""
        with self._lock:
            return dict(self.accepted)

    def observe(self, epoch: int, proof: str = "", *, proven: bool = False) -> bool:
        """A master's answer (or a valid capability: `proven`) names leader `epoch`: raise the fence to it
        when it is newer (with its leader proof on a secured store, unless `proven`). Never raises: an older
        or unproven epoch is ignored (False); True when the fence rose."""
        if epoch <= self.highest:
            return False
        if self._key is not None and not proven:
            try:
                check_leader_proof(self._key, epoch, proof)
            except Unauthenticated:
                return False
        with self._lock:
            if epoch <= self.highest:
                return False
            self.epochs.append(epoch)
            self.highest = epoch
            self.num_raised_by_answers += 1
        return True
