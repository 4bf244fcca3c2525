"""A store's disk tier: fixed-size, page-aligned block slots in a file under `--disk-path`, with a record of
the committed ones that survives a restart.

Layout of the directory (locked with `flock` against a second live store; files created 0600):
- `lock`: the `flock` (holds the owner's pid, for the refusal's message);
- `blocks.data`: slot i at byte i * `slot_nbytes` (the block size rounded up to a page), sparse;
- `slots.meta`: the header and one record per slot (`kvpool.store.disk_journal`).

Crash rule: a block is written (`O_DIRECT`: on the device when the call returns), then its record is
written (buffered: it survives the process being killed); the data file, then the record file, are synced
by a group commit every `SYNC_INTERVAL_S` (and by `sync()`, `close()`), not once per call: a sync per batch
cost 2/3 of the write path's time here. At start-up only slots whose record is intact and committed are
read back, and each block is kept only when its bytes match the recorded xxh3_64: a crash in the middle of
a write (even a power loss that kept a record and lost its block) exposes no partial block. A power loss
may lose the blocks and frees of the last interval (a freed block can then come back: a cache may, the
master checks its namespace on adoption). Generations never go back: each open starts every slot at a
generation above all of the previous boots' (`disk_journal.boot_generation`, from the synced header), so
blocks recovered at start-up get new generations and a location from before the restart is refused.

Per-slot state is numpy columns (no Python object per slot): generation and checksum (uint64), flags
(uint8) and the namespace/hash columns of `kvpool.store.slot_columns.SlotColumns`, about 60 bytes a slot.

Faults never raise out of `write`/`read`/`free`: a failed system call (ENOSPC, EROFS, EIO...) is reported per
slot and switches the tier to `degraded` (one log line, `counters.degradations`): writes are then refused,
reads and frees still tried. A block whose bytes no longer match its checksum is dropped (its slot freed,
`counters.dropped_blocks`) without degrading the tier: one bad block says nothing about the others.
Calls are serialised by one lock; the I/O itself runs on the data file's thread pool (`kvpool.store.disk_io`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.store import disk_journal as dj
from kvpool.store.disk_io import (
    CHUNK_NBYTES,
    WRITE_CHUNK_NBYTES,
    DataFile,
    Job,
    aligned_empty,
    chunk_runs,
    describe,
    is_aligned,
    lock_directory,
    probe_alpha_beta,
    round_up,
)
from kvpool.store.disk_slots import DiskCounters, check_slots, ints, namespace_table, records_of
from kvpool.store.slot_columns import SlotColumns
from kvpool.store.slot_types import _HAS_PARENT, FIRST_GENERATION
from kvpool.types import HASH_NBYTES, InventoryBatch
from transfer import checksums as hash_rows
from transfer.xxh3 import checksum_many

log = logging.getLogger(__name__)

_COMMITTED = 1  # bit of the tier's flags column (`_HAS_PARENT` is the slot table's bit)
INLINE_HASH_NBYTES = 4 << 20
"""Batches up to this size are hashed in one call on the caller's thread, larger ones on the hash pool."""
SYNC_INTERVAL_S = 0.1
"""How often written blocks and records are made durable (group commit)."""


class DiskTierError(InvalidArgument):
    """The disk tier cannot be opened at this path (missing, not writable, held by another store, too small,
    made for another geometry). The message names the path."""


class DiskTier:
    """Open with `DiskTier.open`. Slot numbers are `first_slot` .. `first_slot + num_slots - 1`."""

    @classmethod
    def open(
        cls, path: Path, size_bytes: int, block_nbytes: int, *, first_slot: int, direct: bool = True
    ) -> DiskTier:
        """The tier in directory `path` with room for `size_bytes` // (`block_nbytes` rounded up to a page)
        slots; recovers the verified blocks of an earlier run (`recovered()`). `direct`: bypass the page
        cache where the file system allows it. Raises `DiskTierError` (one line, the path in it)."""
        return cls(path, size_bytes, block_nbytes, first_slot=first_slot, direct=direct)

    def __init__(
        self, path: Path, size_bytes: int, block_nbytes: int, *, first_slot: int, direct: bool = True
    ) -> None:
        """See `open`."""
        self.path = path = Path(path)
        if block_nbytes <= 0 or first_slot < 0:
            raise DiskTierError(f"disk tier {path}: block_nbytes and first_slot must be positive")
        self.block_nbytes, self.slot_nbytes = block_nbytes, round_up(block_nbytes)
        self.num_slots, self.first_slot = size_bytes // self.slot_nbytes, first_slot
        if self.num_slots < 1:
            raise DiskTierError(
                f"disk tier {path}: {size_bytes} bytes do not hold one {self.slot_nbytes}-byte block slot"
            )
        if not path.is_dir():
            raise DiskTierError(f"disk tier {path}: no such directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise DiskTierError(f"disk tier {path}: not writable by this process")
        self._lock_fd = lock_directory(path, DiskTierError)
        meta_fd = -1
        try:
            meta_fd = os.open(path / "slots.meta", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._journal = dj.Journal(
                meta_fd, block_nbytes=block_nbytes, slot_nbytes=self.slot_nbytes, num_slots=self.num_slots
            )
            self._data = DataFile(path / "blocks.data", self.num_slots * self.slot_nbytes, direct=direct)
        except (OSError, dj.JournalMismatch) as exc:
            if meta_fd >= 0:
                os.close(meta_fd)
            os.close(self._lock_fd)
            raise DiskTierError(f"disk tier {path}: {describe(exc)}") from None
        self.direct = self._data.direct
        n = self.num_slots
        self.gen = np.full(n, FIRST_GENERATION, dtype=np.uint64)
        self.checksum = np.zeros(n, dtype=np.uint64)
        self.flags = np.zeros(n, dtype=np.uint8)
        self.cols = SlotColumns(n, 0)
        self.counters = DiskCounters()
        self.degraded: str | None = None
        self.alpha_beta: tuple[float, float] | None = None
        self._mutex = threading.Lock()
        self._stage = np.zeros((0, self.slot_nbytes), dtype=np.uint8)
        self._ns_table = (np.zeros((0, dj.NS_MAX_NBYTES), dtype=np.uint8), np.zeros(0, dtype=np.uint8))
        self._dirty = False
        self._sync_lock = threading.Lock()
        self._closing = threading.Event()
        from kvpool.store.disk_recovery import recover  # noqa: PLC0415 - split for size

        try:
            self._recovered = recover(self)
        except OSError as exc:
            self._data.close()
            os.close(self._journal.fd)
            os.close(self._lock_fd)
            raise DiskTierError(
                f"disk tier {path}: reading back its blocks failed: {describe(exc)}"
            ) from None
        self.first_generation = dj.boot_generation(self._journal.boot)
        """Every slot's generation when this boot began (above every generation of an earlier boot)."""
        self.num_recovered = len(self._recovered)
        self._flusher = threading.Thread(target=self._flush_loop, name="kvpool-disk-sync", daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------ the API

    def write(
        self,
        slots: np.ndarray,
        generations: np.ndarray,
        blocks: np.ndarray,
        namespaces: list[bytes],
        block_hashes: np.ndarray,
        parent_hashes: np.ndarray,
        has_parent: np.ndarray,
        checksums: np.ndarray,
    ) -> list[str]:
        """Write k blocks and record them. `slots`, `generations`, `checksums` (k,) integers (xxh3_64 of
        each block, checked before anything is written); `blocks` (k, block_nbytes) uint8; `namespaces` k
        digests of at most 32 bytes; `block_hashes`, `parent_hashes` (k, 16) uint8; `has_parent` (k,) bool.
        Each slot must be free at that generation. Returns k error lines ("" for a block now committed).
        Raises `InvalidArgument` only for a malformed batch (shapes, types)."""
        k = len(slots)
        s, g, cs = ints(slots, k), ints(generations, k), ints(checksums, k).astype(np.uint64)
        if blocks.shape != (k, self.block_nbytes) or blocks.dtype != np.uint8 or len(namespaces) != k:
            raise InvalidArgument(f"blocks must be ({k}, {self.block_nbytes}) uint8 with {k} namespaces")
        for h in (block_hashes, parent_hashes):
            if h.shape != (k, HASH_NBYTES) or h.dtype != np.uint8:
                raise InvalidArgument(f"hashes must be ({k}, {HASH_NBYTES}) uint8")
        with self._mutex:
            idx, errors = self._check(s, g, want_committed=False)
            for i, ns in enumerate(namespaces):
                if not errors[i] and not 0 < len(ns) <= dj.NS_MAX_NBYTES:
                    errors[i] = f"InvalidArgument: a namespace is 1 to {dj.NS_MAX_NBYTES} bytes"
            if self.degraded:
                errors = [e or f"Unavailable: disk tier degraded ({self.degraded})" for e in errors]
            sel = np.array([i for i in range(k) if not errors[i]], dtype=np.int64)
            if len(sel):
                src = np.ascontiguousarray(blocks if len(sel) == k else blocks[sel])
                small = src.nbytes <= INLINE_HASH_NBYTES  # one GIL-free call beats a hand-off
                got = np.asarray(checksum_many(src) if small else hash_rows(src), dtype=np.uint64)
                for i in sel[got != cs[sel]].tolist():
                    errors[i] = "ChecksumMismatch: the block's bytes do not match its checksum"
                sel = sel[got == cs[sel]]
            if not len(sel):
                return errors
            sel = sel[np.argsort(idx[sel], kind="stable")]
            rows = idx[sel]
            if is_aligned(blocks) and self.slot_nbytes == self.block_nbytes:
                bufs = [blocks[i].data for i in sel.tolist()]
            else:
                stage = self._staging(len(sel))
                stage[:, : self.block_nbytes] = blocks[sel]
                bufs = [r.data for r in stage]
            ok = ~self._io(rows, bufs, write=True)
            okrows = rows[ok]
            self.checksum[okrows] = cs[sel][ok]
            ids = np.array([self.cols.ns_id(namespaces[i]) for i in sel[ok].tolist()], dtype=np.int64)
            self.cols.ns[okrows] = ids
            self.cols.block_hash[okrows] = block_hashes[sel[ok]]
            self.cols.parent_hash[okrows] = parent_hashes[sel[ok]] * has_parent[sel[ok], None]
            self.flags[okrows] = _COMMITTED | np.where(has_parent[sel[ok]], _HAS_PARENT, 0).astype(np.uint8)
            if len(okrows) and not self._record(okrows, "recording written blocks"):
                self.flags[okrows] = 0
                ok[:] = False
            for j, i in enumerate(sel.tolist()):
                if not ok[j]:
                    errors[i] = f"Unavailable: disk write failed ({self.degraded})"
            done = int(ok.sum())
            c = self.counters
            c.written_blocks += done
            c.written_bytes += done * self.block_nbytes
            c.resident_blocks += done
            c.resident_bytes += done * self.block_nbytes
            return errors

    def read(self, slots: np.ndarray, generations: np.ndarray, out: np.ndarray) -> list[str]:
        """Read k committed blocks into `out` (k, block_nbytes) uint8 (writable), each checked against its
        recorded xxh3_64. Returns k error lines ("" for a verified block); a block whose bytes do not match is
        dropped (its slot freed) and counted. Raises `InvalidArgument` only for a malformed batch."""
        k = len(slots)
        s, g = ints(slots, k), ints(generations, k)
        if out.shape != (k, self.block_nbytes) or out.dtype != np.uint8 or not out.flags.writeable:
            raise InvalidArgument(f"out must be a writable ({k}, {self.block_nbytes}) uint8 array")
        with self._mutex:
            idx, errors = self._check(s, g, want_committed=True)
            sel = np.array([i for i in range(k) if not errors[i]], dtype=np.int64)
            if not len(sel):
                return errors
            sel = sel[np.argsort(idx[sel], kind="stable")]
            rows = idx[sel]
            direct_out = is_aligned(out) and self.slot_nbytes == self.block_nbytes
            if direct_out:
                bufs = [out[i].data for i in sel.tolist()]
            else:
                stage = self._staging(len(sel))
                bufs = [r.data for r in stage]
            got = np.zeros(len(sel), dtype=np.uint64)
            views = bufs if self.slot_nbytes == self.block_nbytes else [b[: self.block_nbytes] for b in bufs]

            def verify(a: int, b: int) -> None:  # on the I/O thread, beside the other reads
                got[a:b] = checksum_many(views[a:b])

            failed = self._io(rows, bufs, write=False, then=verify)
            if not direct_out:
                out[sel] = stage[:, : self.block_nbytes]
            bad = ~failed & (got != self.checksum[rows])
            for j, i in enumerate(sel.tolist()):
                if failed[j]:
                    errors[i] = f"Unavailable: disk read failed ({self.degraded})"
                elif bad[j]:
                    errors[i] = "ChecksumMismatch: the block's bytes on disk are damaged; block dropped"
            if bad.any():
                self._drop(rows[bad])
            good = int((~failed & ~bad).sum())
            self.counters.read_blocks += good
            self.counters.read_bytes += good * self.block_nbytes
            return errors

    def free(self, slots: np.ndarray, generations: np.ndarray) -> list[str]:
        """Free k slots at their current generation (a reserved slot never written too): each generation is
        raised by one and recorded. Returns k error lines ("" for freed)."""
        k = len(slots)
        s, g = ints(slots, k), ints(generations, k)
        with self._mutex:
            idx, errors = self._check(s, g, want_committed=None)
            rows = idx[[i for i in range(k) if not errors[i]]]
            held = int(np.count_nonzero(self.flags[rows] & _COMMITTED))
            self.flags[rows] = 0
            self.gen[rows] += np.uint64(1)
            self._record(rows, "recording frees")  # a failure degrades; the slot is free here either way
            c = self.counters
            c.freed_blocks += held
            c.resident_blocks -= held
            c.resident_bytes -= held * self.block_nbytes
            return errors

    def generation_of(self, slots: np.ndarray) -> np.ndarray:
        """(k,) uint64: the current generation of each disk slot (`InvalidArgument` for one out of range)."""
        idx = ints(slots, len(slots)) - self.first_slot
        if len(idx) and (idx.min() < 0 or idx.max() >= self.num_slots):
            raise InvalidArgument("not a slot of this disk tier")
        return self.gen[idx].copy()

    def advance(self, slots: np.ndarray, generations: np.ndarray) -> None:
        """Raise each free slot's generation to `generations[i]` where that is higher (a master that names a
        generation above the current one, as for memory slots). Not recorded: the next boot's generations are
        above every generation of this one. Committed slots and lower generations are left alone."""
        idx = ints(slots, len(slots)) - self.first_slot
        g = ints(generations, len(slots)).astype(np.uint64)
        with self._mutex:
            free = (self.flags[idx] & _COMMITTED) == 0
            self.gen[idx[free]] = np.maximum(self.gen[idx[free]], g[free])

    def block_of(self, slot: int) -> tuple[bytes, bytes, bytes]:
        """(namespace, block hash, parent hash or b"") the disk slot records; b"" parts when it never held a
        block. The caller checked the range."""
        i = slot - self.first_slot
        ns, h = self.cols.block_of(i)
        parent = self.cols.parent_hash[i].tobytes() if self.flags[i] & _HAS_PARENT else b""
        return ns, h, parent

    def is_committed(self, slot: int) -> bool:
        """Whether the disk slot holds a committed block (the caller checked the range)."""
        return bool(self.flags[slot - self.first_slot] & _COMMITTED)

    def recovered(self) -> InventoryBatch:
        """The verified blocks found at start-up, with their new generations (`next_slot` -1)."""
        with self._mutex:
            return self._batch(self._recovered, -1)

    def inventory_batch(self, after_slot: int, limit: int) -> InventoryBatch:
        """Up to `limit` committed blocks in slots ≥ `after_slot` (a disk slot number), in slot order, and
        the cursor to ask again from (`next_slot`, -1 when none follow)."""
        with self._mutex:
            mask = (self.flags & _COMMITTED) != 0
            idx, nxt = SlotColumns.find(mask, max(after_slot - self.first_slot, 0), limit)
            return self._batch(idx, nxt + self.first_slot if nxt >= 0 else -1)

    def measure(self) -> tuple[float, float]:
        """(α seconds, β seconds per byte) of this tier's reads, from a short probe (~16 MiB written and read
        back in a scratch file beside the data). On failure (a full or broken disk): the last figures, or
        (nan, nan), and the tier degrades."""
        try:
            self.alpha_beta = probe_alpha_beta(self.path, direct=self.direct)
        except OSError as exc:
            with self._mutex:
                self._fault("measuring the disk", exc)
        return self.alpha_beta or (float("nan"), float("nan"))

    def sync(self) -> bool:
        """Make every block and record written so far durable (data file first); False (and degraded) when
        the disk refused. Runs by itself every `SYNC_INTERVAL_S`."""
        with self._sync_lock:
            if not self._dirty:
                return True
            self._dirty = False
            err = self._data.sync()
            if err is None:
                try:
                    self._journal.sync()
                except OSError as exc:
                    err = exc
        if err is not None:
            with self._mutex:
                self._fault("syncing", err)
        return err is None

    def _flush_loop(self) -> None:
        while not self._closing.wait(SYNC_INTERVAL_S):
            self.sync()

    def close(self) -> None:
        """Sync, then release the files and the lock (the tier is unusable after)."""
        self._closing.set()
        self._flusher.join()
        self.sync()
        self._data.close()
        os.close(self._journal.fd)
        os.close(self._lock_fd)

    # ------------------------------------------------------------------ internals

    def _check(
        self, s: np.ndarray, g: np.ndarray, *, want_committed: bool | None
    ) -> tuple[np.ndarray, list[str]]:
        return check_slots(s, g, self.first_slot, self.gen, self.flags & _COMMITTED, want_committed)

    def _staging(self, k: int) -> np.ndarray:
        if len(self._stage) < k:
            self._stage = aligned_empty(max(k, 2 * len(self._stage)) * self.slot_nbytes).reshape(
                -1, self.slot_nbytes
            )
        return self._stage[:k]

    def _io(
        self,
        rows: np.ndarray,
        bufs: list[memoryview],
        *,
        write: bool,
        then: Callable[[int, int], None] | None = None,
    ) -> np.ndarray:
        """Move `bufs[j]` to/from slot `rows[j]` (rows ascending); (len(rows),) bool: failed. `then(a, b)`
        runs on the I/O thread once `bufs[a:b]` are done."""
        runs = chunk_runs(rows, max(1, (WRITE_CHUNK_NBYTES if write else CHUNK_NBYTES) // self.slot_nbytes))
        jobs: list[Job] = [(int(rows[a]) * self.slot_nbytes, bufs[a:b]) for a, b in runs]
        failed = np.zeros(len(rows), dtype=np.bool_)
        after = None if then is None else (lambda j: then(*runs[j]))
        for (a, b), err in zip(runs, self._data.run(jobs, write=write, then=after), strict=True):
            if err is not None:
                failed[a:b] = True
                self._fault("writing blocks" if write else "reading blocks", err)
        return failed

    def _record(self, rows: np.ndarray, what: str) -> bool:
        try:
            self._journal.store(rows, self._records(rows))
        except OSError as exc:
            self._fault(what, exc)
            return False
        self._dirty = True
        return True

    def _records(self, rows: np.ndarray) -> np.ndarray:
        """Sealed journal records of slots `rows`, from the columns."""
        names = self.cols.namespaces
        if len(self._ns_table[0]) != len(names):  # namespaces only ever arrive: rebuild when one did
            self._ns_table = namespace_table(names)
        f = self.flags[rows]
        return records_of(
            self.gen[rows],
            self.checksum[rows],
            (f & _COMMITTED) != 0,
            (f & _HAS_PARENT) != 0,
            self.cols.ns[rows],
            self._ns_table,
            self.cols.block_hash[rows],
            self.cols.parent_hash[rows],
        )

    def _drop(self, rows: np.ndarray) -> None:
        n = len(rows)
        log.warning("disk tier %s: %d blocks failed their checksum; dropped", self.path, n)
        self.flags[rows] = 0
        self.gen[rows] += np.uint64(1)
        self._record(rows, "recording dropped blocks")
        c = self.counters
        c.dropped_blocks += n
        c.resident_blocks -= n
        c.resident_bytes -= n * self.block_nbytes

    def _fault(self, what: str, exc: OSError) -> None:
        self.counters.io_errors += 1
        if self.degraded is None:
            self.degraded = f"{what}: {describe(exc)}"
            self.counters.degradations += 1
            log.error("disk tier %s degraded: %s; writes refused from now on", self.path, self.degraded)

    def _batch(self, idx: np.ndarray, next_slot: int) -> InventoryBatch:
        b = self.cols.batch(idx, next_slot, self.gen, self.checksum, self.flags, self.block_nbytes)
        return dataclasses.replace(b, slots=b.slots + np.uint64(self.first_slot))
