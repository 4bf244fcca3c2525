"""The node-local host-memory tier (L2): an LRU of recently used blocks, bounded in bytes.

Keys are (namespace, block hash), so a block is only ever found under the namespace it was computed in
(no cross-tenant or cross-version reuse). Stored/removed events are queued for the master, which records
them as `local` locations (visible to the router's peek, never readable by other nodes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_Key = tuple[bytes, bytes]


class LocalTier:
    """An LRU of block bytes. Thread-safe. `capacity_bytes` 0 disables it.

    Values are read-only uint8 arrays of `block_nbytes`; callers never get a view they could mutate.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[_Key, np.ndarray] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()
        self._events: dict[bytes, dict[bytes, bool]] = {}  # ns -> hash -> held (the last event wins)
        self.num_hits = 0
        self.num_lookups = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_run(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are resident (does not touch recency)."""
        with self._lock:
            n = 0
            for h in hashes:
                if (ns, h) not in self._blocks:
                    break
                n += 1
            return n

    def get(self, ns: bytes, block_hash: bytes) -> np.ndarray | None:
        with self._lock:
            self.num_lookups += 1
            value = self._blocks.get((ns, block_hash))
            if value is not None:
                self._blocks.move_to_end((ns, block_hash))
                self.num_hits += 1
            return value

    def put(self, ns: bytes, block_hash: bytes, data: np.ndarray, *, report: bool = True) -> None:
        """Store a copy of `data` (uint8, block_nbytes); evicts least recently used blocks to fit.

        `report=False`: queue no stored event now; the caller calls `report_stored` once the master can
        attach it (the master records a node's local copy only of a block its index holds, so a report
        that reached it before the block's commit was dropped for good)."""
        if self.capacity_bytes == 0 or data.nbytes > self.capacity_bytes:
            return
        key = (bytes(ns), bytes(block_hash))
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            copy = np.array(data, dtype=np.uint8, copy=True).reshape(-1)
            copy.setflags(write=False)
            while self._used_bytes + copy.nbytes > self.capacity_bytes and self._blocks:
                (old_ns, old_hash), old = self._blocks.popitem(last=False)
                self._used_bytes -= old.nbytes
                self._events.setdefault(old_ns, {})[old_hash] = False
            self._blocks[key] = copy
            self._used_bytes += copy.nbytes
            if report:
                self._events.setdefault(key[0], {})[key[1]] = True

    def report_stored(self, ns: bytes, block_hashes: Sequence[bytes]) -> None:
        """Queue stored events for those of `block_hashes` still resident (see `put(report=False)`)."""
        with self._lock:
            for h in block_hashes:
                if (ns, h) in self._blocks:
                    self._events.setdefault(bytes(ns), {})[bytes(h)] = True

    def clear(self) -> None:
        with self._lock:
            for ns, h in self._blocks:
                self._events.setdefault(ns, {})[h] = False
            self._blocks.clear()
            self._used_bytes = 0

    def drain_events(self) -> list[tuple[bytes, list[bytes], list[bytes]]]:
        """Take the queued (namespace, stored, removed) events to report to the master: each block's last
        event only (a block stored then evicted before a report is only removed, never both)."""
        with self._lock:
            events, self._events = self._events, {}
        return [
            (ns, [h for h, held in d.items() if held], [h for h, held in d.items() if not held])
            for ns, d in events.items()
        ]
