"""Adoption of store inventories (master restart, a new HA leader, a store restart), batch by batch.

A store's `Inventory` streams its committed blocks as columns (`kvpool.types.InventoryBatch`), in slot order,
one message at a time with a deadline per message. The master holds its lock only per batch: between
batches matches are answered with what is indexed so far. A broken stream is read again from the last
batch's `next_slot` on the next maintenance tick (same store epoch; a restarted store is a new epoch and
starts over). Blocks stay columns throughout (no Python object per block): each batch's blocks of an active
namespace go to the index parent-first in bulk; a block whose parent has not arrived yet, or whose
namespace is not registered yet, waits (as columns, per namespace and store) until it can be indexed, or
is freed once its namespace is known inactive or `rebuild_grace_ms` passed. When the stream is complete,
every slot it did not list is free and the store is placeable.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import KVPoolError, ResourceExhausted
from kvpool.types import InventoryBatch, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.master.core import Master

log = logging.getLogger(__name__)

LOCK_SLICE_BLOCKS = 4096
"""Inventory blocks indexed in the first hold of the master's lock; later slices are sized so that a hold
takes about `LOCK_HOLD_TARGET_S` (matches wait at most one slice's bulk insert)."""
LOCK_HOLD_TARGET_S = 0.012
MIN_SLICE_BLOCKS, MAX_SLICE_BLOCKS = 2048, 65536
_READ_AHEAD = 2
"""Inventory messages the reader thread decodes ahead of the one being indexed."""


def _next_slice(size: int, held_s: float) -> int:
    """The next slice's size after one of `size` blocks held the lock `held_s` seconds: towards the target
    hold, at most doubled or halved per step, within [MIN_SLICE_BLOCKS, MAX_SLICE_BLOCKS]."""
    want = size * LOCK_HOLD_TARGET_S / max(held_s, 1e-6)
    return int(min(max(want, size / 2, MIN_SLICE_BLOCKS), 2 * size, MAX_SLICE_BLOCKS))


class _ReadAhead:
    """Iterates `batches` (an inventory stream) in a thread of its own, `_READ_AHEAD` messages ahead, so
    the next message is received and decoded while the current one is indexed. Errors are raised to the
    consumer where they happened in the stream; `close` stops the thread (and so the stream)."""

    _END = object()

    def __init__(self, batches: Iterator[InventoryBatch], name: str) -> None:
        self._q: queue.Queue[object] = queue.Queue(maxsize=_READ_AHEAD)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(batches,), name=name, daemon=True)
        self._t.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, batches: Iterator[InventoryBatch]) -> None:
        try:
            for b in batches:
                if not self._put(b):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # a stream stopped early is cancelled (its generator's finally)

    def __iter__(self) -> Iterator[InventoryBatch]:
        while True:
            item = self._q.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=0.5)  # (a thread waiting on the store ends with its next message)


def _rows(b: InventoryBatch, lo: int, hi: int) -> InventoryBatch:
    """Rows [lo, hi) of batch `b` (views; the cursor is the batch's)."""
    return InventoryBatch(
        b.namespaces,
        b.ns_index[lo:hi],
        b.block_hashes[lo:hi],
        b.parent_hashes[lo:hi],
        b.has_parent[lo:hi],
        b.slots[lo:hi],
        b.generations[lo:hi],
        b.checksums[lo:hi],
        b.size_bytes[lo:hi],
        b.next_slot,
        None if b.medium is None else b.medium[lo:hi],
    )


@dataclass
class Blocks:
    """Inventory blocks of one store, as columns (n rows): (n, 16) uint8 hashes and parent hashes,
    (n,) bool has_parent, (n,) uint64 slots, generations and checksums."""

    block_hashes: np.ndarray
    parent_hashes: np.ndarray
    has_parent: np.ndarray
    slots: np.ndarray
    generations: np.ndarray
    checksums: np.ndarray

    def __len__(self) -> int:
        return len(self.slots)

    @classmethod
    def of(cls, b: InventoryBatch, rows: np.ndarray | slice) -> Blocks:
        return cls(
            b.block_hashes[rows],
            b.parent_hashes[rows],
            b.has_parent[rows],
            b.slots[rows],
            b.generations[rows],
            b.checksums[rows],
        )

    def select(self, rows: np.ndarray) -> Blocks:
        return Blocks(
            self.block_hashes[rows],
            self.parent_hashes[rows],
            self.has_parent[rows],
            self.slots[rows],
            self.generations[rows],
            self.checksums[rows],
        )

    def extend(self, other: Blocks) -> Blocks:
        return Blocks(*(np.concatenate([a, b]) for a, b in zip(self.columns(), other.columns(), strict=True)))

    def columns(self) -> tuple[np.ndarray, ...]:
        return (
            self.block_hashes,
            self.parent_hashes,
            self.has_parent,
            self.slots,
            self.generations,
            self.checksums,
        )


@dataclass
class _Reading:
    """A store's inventory being read: from which slot to ask next, which slots it listed."""

    epoch: int
    used: np.ndarray  # (num_slots,) bool: slots listed so far
    started_s: float
    cursor: int = 0
    num_blocks: int = 0
    num_resumes: int = 0


@dataclass
class AdoptionStats:
    """Figures of the inventories adopted (for `admin status`, metrics and benchmarks)."""

    num_adopted_blocks: int = 0  # blocks indexed (new or a replica) from inventories
    num_inventory_resumes: int = 0  # broken streams read again from their cursor
    max_lock_hold_s: float = 0.0  # the longest the master's lock was held for one batch
    last_adoption_s: float = 0.0  # wall clock of the last complete inventory (registration to indexed)
    last_adoption_blocks: int = 0
    lock_holds_s: list[float] = field(default_factory=list)  # of the last adoption, per batch
    resumed_from: list[int] = field(default_factory=list)  # the cursors broken streams resumed from


class Adoption:
    """The master's inventory adoptions (`Maintenance` drives them). `adopt` runs outside the lock and
    takes it per batch; `claim` runs under it."""

    def __init__(self, master: Master) -> None:
        self.m = master
        self.reading: dict[str, _Reading] = {}
        self.waiting: dict[tuple[bytes, str], Blocks] = {}  # (namespace, store) -> blocks not indexed yet
        self.since_ms: dict[tuple[bytes, str], int] = {}  # when each began waiting
        self.dirty: set[tuple[bytes, str]] = set()  # waiting blocks worth another try (something changed)
        self.epoch_of: dict[str, int] = {}  # the store epoch whose inventory each store's waiting blocks are
        self.stats = master.adoption_stats

    def num_waiting_blocks(self) -> int:
        return sum(len(b) for b in self.waiting.values())

    def adopt(self, node_id: str, address: str, epoch: int) -> None:
        """Read the store's inventory from where the last try stopped, indexing each batch under the lock;
        on a failed read, count it and leave the store to the next tick (resumed from its cursor)."""
        m = self.m
        with m.lock:
            rec = m.st.nodes.get(node_id)
            if rec is None or rec.epoch != epoch or not rec.alive:
                return
            r = self.reading.get(node_id)
            if r is None or r.epoch != epoch:
                r = _Reading(epoch, np.zeros(rec.num_slots, dtype=bool), time.monotonic())
                self.reading[node_id] = r
                for key in [k for k in self.waiting if k[1] == node_id]:  # an earlier epoch's slots
                    self._forget(key)
                self.epoch_of[node_id] = epoch
                self.stats.lock_holds_s = []
                rec.free.allocate_all()  # nothing placeable until the inventory is read
            else:
                r.num_resumes += 1
                self.stats.num_inventory_resumes += 1
                self.stats.resumed_from = [*self.stats.resumed_from[-63:], r.cursor]
                log.info("inventory of %s resumed from slot %d", node_id, r.cursor)
        done = r.cursor < 0
        reader = (
            None
            if done
            else _ReadAhead(m.stores.inventory(address, after_slot=r.cursor), f"inventory-{node_id}")
        )
        size = LOCK_SLICE_BLOCKS
        try:
            for batch in [] if reader is None else reader:
                lo = 0
                while True:  # the lock per slice
                    hi = lo + size
                    t0 = time.monotonic()
                    with m.lock:
                        rec = m.st.nodes.get(node_id)
                        if rec is None or rec.epoch != epoch or not rec.alive:
                            self.reading.pop(node_id, None)
                            return
                        self._take(node_id, r, _rows(batch, lo, hi), m.clock.now_ms())
                        if hi >= len(batch):
                            r.cursor = batch.next_slot
                    held = time.monotonic() - t0
                    self.stats.lock_holds_s.append(held)
                    self.stats.max_lock_hold_s = max(self.stats.max_lock_hold_s, held)
                    if hi - lo >= MIN_SLICE_BLOCKS:  # (a short tail says little about the rate)
                        size = _next_slice(size, held)
                    lo = hi
                    if lo >= len(batch):
                        break
                if batch.next_slot < 0:
                    done = True
                    break
            if not done:
                raise KVPoolError("the inventory stream ended without its last batch")
        except KVPoolError as exc:
            log.warning("inventory of %s failed at slot %d (%s): resuming", node_id, r.cursor, exc)
            with m.lock:
                rec = m.st.nodes.get(node_id)
                if rec is not None and rec.epoch == epoch and rec.alive:
                    rec.adopt_failures += 1
                    m.st.to_adopt.add(node_id)
            return
        finally:
            if reader is not None:
                reader.close()
        with m.lock:
            rec = m.st.nodes.get(node_id)
            self.reading.pop(node_id, None)
            if rec is None or rec.epoch != epoch or not rec.alive:
                return
            rec.free.release_unused(r.used, m.fresh_generation)
            rec.ready = True
            took = time.monotonic() - r.started_s
            self.stats.last_adoption_s, self.stats.last_adoption_blocks = took, r.num_blocks
        while (
            True
        ):  # a hash table growth the adoption began: finished now (its old table freed), a step a hold
            with m.lock:
                if not m.index.grow_step(65536):
                    break
        log.info(
            "store %s adopted: %d blocks in its inventory in %.3f s (%d resumes)",
            node_id,
            r.num_blocks,
            took,
            r.num_resumes,
        )

    def _take(self, node_id: str, r: _Reading, batch: InventoryBatch, now_ms: int) -> None:
        """Under the lock: mark the batch's slots used, index what can be, keep the rest waiting."""
        ok = batch.in_memory() & (batch.slots < len(r.used))  # disk rows: adopted by the disk-aware master
        if not (ok | ~batch.in_memory()).all():
            log.warning("inventory of %s lists %d slots out of range: ignored", node_id, int((~ok).sum()))
        r.used[batch.slots[ok].astype(np.int64)] = True
        r.num_blocks += int(ok.sum())
        ns_index = batch.ns_index
        for k, ns in enumerate(batch.namespaces):
            rows = np.flatnonzero(ok & (ns_index == k))
            if not len(rows):
                continue
            key = (bytes(ns), node_id)
            self.since_ms.setdefault(key, now_ms)
            new = Blocks.of(batch, slice(None) if len(rows) == len(batch) else rows)
            if self.m.namespaces.is_active(key[0]):  # this slice's blocks only: the waiting ones at the end
                left = self._insert(key, new)
                if left is None or not len(left):
                    if key not in self.waiting:
                        self.since_ms.pop(key, None)
                    continue
                new = left
            held = self.waiting.get(key)
            self.waiting[key] = new if held is None else held.extend(new)
            self.dirty.add(key)

    def claim(self, now_ms: int) -> None:
        """Under the lock: index waiting blocks of namespaces active now; free those of namespaces known
        inactive, of dead stores, or waiting past `rebuild_grace_ms`."""
        m = self.m
        for key in list(self.waiting):
            ns, node_id = key
            rec = m.st.nodes.get(node_id)
            if rec is None or not rec.alive or rec.epoch != self.epoch_of.get(node_id):
                self._forget(key)  # its store died or restarted: those slots are gone
                continue
            if m.namespaces.is_active(ns) and key in self.dirty and node_id not in self.reading:
                self._index(key)  # once per change: new blocks, or a parent indexed meanwhile
            if key not in self.waiting:
                continue
            expired = now_ms - self.since_ms.get(key, now_ms) > m.settings.rebuild_grace_ms
            known_inactive = m.namespaces.is_known(ns) and not m.namespaces.is_active(ns)
            if (expired and node_id not in self.reading) or known_inactive:
                blocks = self.waiting[key]
                log.info(
                    "freeing %d unclaimed inventory blocks of namespace %s on %s",
                    len(blocks),
                    ns.hex(),
                    node_id,
                )
                self._free(node_id, blocks)
                self._forget(key)

    def _forget(self, key: tuple[bytes, str]) -> None:
        self.waiting.pop(key, None)
        self.since_ms.pop(key, None)
        self.dirty.discard(key)

    def _free(self, node_id: str, blocks: Blocks) -> None:
        for s, g in zip(blocks.slots.tolist(), blocks.generations.tolist(), strict=True):
            self.m.queue_free(Location(node_id, s, g))

    def _index(self, key: tuple[bytes, str]) -> None:
        """Under the lock: insert the waiting blocks of `key` (an active namespace) in bulk, parent-first
        (one call resolves every chain it can); keep those whose parent is still missing."""
        self.dirty.discard(key)
        left = self._insert(key, self.waiting[key])
        if left is None:
            return
        if len(left):
            self.waiting[key] = left
        else:
            self._forget(key)

    def _insert(self, key: tuple[bytes, str], b: Blocks) -> Blocks | None:
        """Under the lock: insert blocks `b` of `key` in bulk; frees those admission or the index refuses.
        Returns the blocks whose parent is missing, or None when the namespace went away (`b` untouched)."""
        m = self.m
        ns, node_id = key
        try:
            m.admission.admit(len(b))  # the index's memory limit: evict leaves, else these are refused
        except ResourceExhausted as exc:
            log.warning("%d inventory blocks of %s not adopted, freed: %s", len(b), node_id, exc)
            self._free(node_id, b)
            return b.select(np.zeros(0, dtype=np.int64))
        try:
            res = m.index.insert_bulk(
                NamespaceId(ns),
                b.block_hashes,
                b.parent_hashes,
                b.has_parent,
                node_id,
                b.slots,
                b.generations,
                m.layout.block_nbytes,
                b.checksums,
                m.settings.replicas,
            )
        except KVPoolError as exc:  # the namespace went away meanwhile: the next claim decides
            log.warning("inventory blocks of namespace %s not indexed: %s", ns.hex(), exc)
            return None
        self.stats.num_adopted_blocks += int(res.inserted.sum() + res.merged.sum())
        if res.inserted.any():  # a parent other stores' waiting blocks of this namespace may need
            self.dirty.update(k for k in self.waiting if k[0] == ns and k != key)
            if m.settings.replicas > 1:  # one replica so far: copies to make
                h = np.ascontiguousarray(b.block_hashes[res.inserted]).tobytes()
                m.st.under_replicated.update((ns, h[i : i + 16]) for i in range(0, len(h), 16))
        if res.refused.any():
            log.warning(
                "%d inventory blocks of %s refused by the index: freed", int(res.refused.sum()), node_id
            )
            self._free(node_id, b.select(np.flatnonzero(res.refused)))
        return b.select(np.flatnonzero(res.waiting))
