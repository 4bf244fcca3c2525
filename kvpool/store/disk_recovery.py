"""The disk tier's start-up: rebuild its columns from `slots.meta` and keep only whole, verified blocks.

A record that is intact and committed names a candidate block; the candidate is read back (in steps of
`STEP_NBYTES`, through the tier's batched I/O) and kept only when its bytes match the recorded xxh3_64. Every
slot starts at this boot's generation (`disk_journal.boot_generation`): kept blocks are listed under new
generations. A torn record (its own checksum wrong: a crash while it was written) and a candidate that fails
are rewritten as "no block" and synced before the tier is used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvpool.store import disk_journal as dj
from kvpool.store.slot_types import _HAS_PARENT
from transfer import checksums

if TYPE_CHECKING:
    from kvpool.store.disk_tier import DiskTier

log = logging.getLogger(__name__)

STEP_NBYTES = 64 << 20
"""Bytes of blocks read back and verified per step."""
_RECORDS_PER_LOAD = 1 << 16
_COMMITTED = 1  # the tier's committed bit (`disk_tier._COMMITTED`)


def recover(t: DiskTier) -> np.ndarray:
    """Fill `t`'s columns from its record and verify its blocks; the recovered slot indices (int64, ascending).
    Raises `OSError` when the record cannot be read or written back."""
    t.gen[:] = dj.boot_generation(t._journal.boot)
    candidates, changed = [], []
    for a in range(0, t.num_slots, _RECORDS_PER_LOAD):
        rec = t._journal.load(a, min(_RECORDS_PER_LOAD, t.num_slots - a))
        rows = np.arange(a, a + len(rec), dtype=np.int64)
        zero = ~rec.view(np.uint8).reshape(-1, dj.RECORD_NBYTES).any(axis=1)
        ok = dj.intact(rec) & ~zero
        torn = ~ok & ~zero
        changed.append(rows[torn])
        com = ok & ((rec["flags"] & dj.COMMITTED) != 0)
        if not com.any():
            continue
        r, c = rows[com], rec[com]
        t.checksum[r] = c["checksum"]
        key = np.concatenate([c["ns_len"][:, None], c["ns"]], axis=1)
        uniq, inverse = np.unique(key, axis=0, return_inverse=True)
        ids = np.array([t.cols.ns_id(u[1 : 1 + int(u[0])].tobytes()) for u in uniq], dtype=np.int64)
        t.cols.ns[r] = ids[inverse.reshape(-1)]
        t.cols.block_hash[r] = c["hash"]
        t.cols.parent_hash[r] = c["parent"]
        parent = (c["flags"] & dj.HAS_PARENT) != 0
        t.flags[r] = _COMMITTED | np.where(parent, _HAS_PARENT, 0).astype(np.uint8)
        candidates.append(r)
    cand = np.concatenate(candidates) if candidates else np.zeros(0, dtype=np.int64)
    bad = _verify(t, cand)
    keep, dropped = cand[~bad], cand[bad]
    t.flags[dropped] = 0
    rewrite = np.concatenate([dropped, *changed])
    if len(rewrite):
        t._journal.store(rewrite, t._records(rewrite))
        t._journal.sync()
    c = t.counters
    c.dropped_blocks += len(dropped)
    c.resident_blocks = len(keep)
    c.resident_bytes = len(keep) * t.block_nbytes
    if len(cand):
        log.info(
            "disk tier %s: %d blocks recovered, %d dropped (damaged or unreadable), %d torn records",
            t.path,
            len(keep),
            len(dropped),
            sum(len(x) for x in changed),
        )
    return keep


def _verify(t: DiskTier, rows: np.ndarray) -> np.ndarray:
    """(len(rows),) bool: the block in each slot could not be read or does not match its checksum."""
    bad = np.zeros(len(rows), dtype=np.bool_)
    step = max(1, STEP_NBYTES // t.slot_nbytes)
    for a in range(0, len(rows), step):
        part = rows[a : a + step]
        stage = t._staging(len(part))
        failed = t._io(part, [x.data for x in stage], write=False)
        got = np.asarray(checksums([x[: t.block_nbytes] for x in stage]), dtype=np.uint64)
        bad[a : a + step] = failed | (got != t.checksum[part])
    return bad
