"""Admission of new blocks against the master's memory (`MasterSettings.max_index_bytes`): the index is
kept below its limit by evicting leaves (by the eviction policy) or, when nothing can be evicted (leased
or reserved blocks), by refusing new blocks with `ResourceExhausted`, never by growing until the process
runs out of memory.

The index's size is its own accounting, `RadixIndex.memory_bytes()` (within ~10 % of the measured RSS:
`tests/test_index_memory.py`). Rows of evicted blocks are reused by new ones (the accounting does not
shrink), so eviction makes room when it drops at least as many blocks as arrive.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import psutil

from kvpool.errors import ResourceExhausted

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)

FIRST_BLOCK_BYTES = 160
"""The cost assumed for a block while the index is empty (the compact index's bytes per block)."""


def default_max_index_bytes() -> int:
    """Half of the host's memory (MemTotal)."""
    return int(psutil.virtual_memory().total // 2)


class Admission:
    """Counts and enforces; every method runs under the master's lock."""

    def __init__(self, master: Master) -> None:
        self.m = master
        self.num_refusals = 0
        self.num_evictions = 0

    @property
    def limit_bytes(self) -> int:
        return self.m.settings.max_index_bytes

    def index_bytes(self) -> int:
        """The index's memory by its own accounting (bytes)."""
        return int(self.m.index.memory_bytes())

    def _bytes_per_block(self) -> float:
        n = self.m.index.num_blocks
        return max(self.index_bytes() / n, 1.0) if n else float(FIRST_BLOCK_BYTES)

    def admit(self, num_new: int) -> None:
        """Make room for `num_new` new blocks within the limit: evict leaves when the index would pass it
        (their rows are reused by the new blocks), else raise `ResourceExhausted` (counted)."""
        limit = self.limit_bytes
        per_block = self._bytes_per_block()
        over = self.index_bytes() + num_new * per_block - limit
        if num_new <= 0 or over <= 0:
            return
        m = self.m
        want = max(num_new, math.ceil(over / per_block))
        res = m.index.evict(want)
        dropped = [d for d in res.dropped if d.reason != "replica"]
        self.num_evictions += len(dropped)
        m.counters.num_evictions += len(dropped)
        m.on_dropped(res.dropped)
        if len(dropped) >= num_new or self.index_bytes() + num_new * per_block <= limit:
            return
        self.num_refusals += 1
        raise ResourceExhausted(
            f"the master's index holds {self.index_bytes()} B of its {limit} B limit (--max-index-bytes) and "
            f"no evictable block is left: {num_new} new blocks refused"
        )
