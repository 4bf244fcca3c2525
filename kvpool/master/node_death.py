"""A dead node's replicas leave the master's index in bounded steps, with the master's lock released between them.

`Master._forget_node` only marks the node dying in the index (O(1): from then on no match or placement names
it, see `kvpool.index.node_removal`). `run_node_removals` (the maintenance thread, before anything else in a
tick) then takes the lock once per step: each step drops at most `STEP_ROWS` rows (or scans one window of
the replica columns), queues the free orders of what it dropped as numpy columns per store
(`FreeOrders`), and queues the blocks that lost a replica but keep another for re-replication as columns
(`Survivors`, turned into keys a batch at a time by the re-replication). `LockHolds` keeps the longest
single hold of the master's lock during the last node death and the last maintenance tick (the
`kvpool_master_node_death_lock_ms` and `kvpool_master_watermark_tick_ms` metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.index.results import DroppedRows

if TYPE_CHECKING:
    from kvpool.master.core import Master


@dataclass
class LockHolds:
    """Longest single holds of the master's lock, in seconds."""

    node_death_s: float = 0.0
    """Of the last node death that finished (its begin and every step)."""
    node_death_running_s: float = 0.0
    """Of the node death(s) running now."""
    num_node_deaths: int = 0
    node_death_steps: int = 0
    """Steps (lock holds) of the last node death that finished."""
    running_steps: int = 0
    tick_s: float = 0.0
    """Of the last maintenance tick (watermarks, reclamation, expiries; node-death steps not included)."""

    def death_hold(self, held_s: float) -> None:
        self.node_death_running_s = max(self.node_death_running_s, held_s)
        self.running_steps += 1

    def death_done(self) -> None:
        """The running node death(s) ended: their figures become the last death's."""
        self.node_death_s, self.node_death_running_s = self.node_death_running_s, 0.0
        self.node_death_steps, self.running_steps = self.running_steps, 0
        self.num_node_deaths += 1


def on_dropped_rows(m: Master, rows: DroppedRows | None) -> None:
    """Under the lock: queue a free order for every replica of `rows` on a live store (numpy columns)."""
    if rows is None or not len(rows):
        return
    for node_id, slots, gens in rows.store_frees():
        rec = m.st.nodes.get(node_id)
        if rec is not None and rec.alive and rec.is_store:
            m.free_orders(node_id).add(slots, gens)
    m.wake.set()


def step_node_removal(m: Master) -> bool:
    """One step of the running node removal under the lock; False when none runs."""
    with m.lock:
        if not m.index.node_removals:
            return False
        t0 = time.perf_counter()
        rows, survivors = m.index.remove_node_step()
        on_dropped_rows(m, rows)
        if survivors is not None and len(survivors):
            m.st.under_replicated_cols.append(survivors)
        holds = m.lock_holds
        holds.death_hold(time.perf_counter() - t0)
        if not m.index.node_removals:
            holds.death_done()
        return True


def run_node_removals(m: Master) -> int:
    """Run every step of the running node removals, releasing the lock between steps. Returns the steps."""
    steps = 0
    while step_node_removal(m):
        steps += 1
        time.sleep(0)  # let a waiting thread take the lock
    return steps


def finish_node_removals(m: Master) -> None:
    """Under the lock: run the removals to their end now (a node registering again while its removal runs)."""
    while m.index.node_removals:
        rows, survivors = m.index.remove_node_step()
        on_dropped_rows(m, rows)
        if survivors is not None and len(survivors):
            m.st.under_replicated_cols.append(survivors)


def take_under_replicated(m: Master, limit: int) -> list[tuple[bytes, bytes]]:
    """Under the lock: up to `limit` keys to re-replicate, from the set first, then from the columns
    queued by node removals (turned into keys only as many as are taken)."""
    st = m.st
    while len(st.under_replicated) < limit and st.under_replicated_cols:
        chunk = st.under_replicated_cols[0]
        need = limit - len(st.under_replicated)
        st.under_replicated.update(chunk[:need].keys())
        if need >= len(chunk):
            st.under_replicated_cols.pop(0)
        else:
            st.under_replicated_cols[0] = chunk[need:]
    return list(st.under_replicated)[:limit]
