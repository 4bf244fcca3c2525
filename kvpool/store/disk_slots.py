"""The disk tier's per-batch checks and record building, as column operations
(`kvpool.store.disk_tier`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.store import disk_journal as dj


def ints(a: np.ndarray, k: int) -> np.ndarray:
    """`a` as (k,) integers (int64, or uint64 as given). Raises `InvalidArgument` for another shape or type."""
    arr = np.asarray(a)
    if arr.shape != (k,) or (k and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"expected ({k},) integers, got {arr.shape} {arr.dtype}")
    return arr if arr.dtype == np.uint64 else arr.astype(np.int64)


def check_slots(
    s: np.ndarray,
    g: np.ndarray,
    first_slot: int,
    gen: np.ndarray,
    committed: np.ndarray,
    want_committed: bool | None,
) -> tuple[np.ndarray, list[str]]:
    """(slot indices (k,) int64, clamped into range, and k error lines: "" for a slot that is this tier's,
    at generation `g[i]`, not named earlier in the batch, and committed as `want_committed` says (None:
    either)). `gen` and `committed` are the tier's columns."""
    idx = s.astype(np.int64) - first_slot
    inside = (idx >= 0) & (idx < len(gen))
    safe = np.where(inside, idx, 0)
    cur = gen[safe]
    held = committed[safe] != 0
    seen: set[int] = set()
    errors = []
    for i in range(len(s)):
        if not inside[i]:
            errors.append(f"NotFound: slot {int(s[i])} is not a slot of this disk tier")
        elif int(cur[i]) != int(g[i]):
            errors.append(
                f"StaleGeneration: disk slot {int(s[i])} is at generation {int(cur[i])}, not {int(g[i])}"
            )
        elif int(idx[i]) in seen:
            errors.append(f"InvalidArgument: disk slot {int(s[i])} twice in one batch")
        elif want_committed is not None and held[i] != want_committed:
            errors.append(
                f"FailedPrecondition: disk slot {int(s[i])} "
                + ("holds no block" if want_committed else "already holds a block")
            )
        else:
            errors.append("")
        seen.add(int(idx[i]))
    return safe, errors


def namespace_table(names: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """((n, 32) uint8 zero-padded namespaces, (n,) uint8 lengths) of the tier's namespace table."""
    table = np.zeros((len(names), dj.NS_MAX_NBYTES), dtype=np.uint8)
    for j, x in enumerate(names):
        table[j, : len(x)] = np.frombuffer(x, dtype=np.uint8)
    return table, np.array([len(x) for x in names], dtype=np.uint8)


def records_of(
    generation: np.ndarray,
    checksum: np.ndarray,
    committed: np.ndarray,
    has_parent: np.ndarray,
    ns_ids: np.ndarray,
    ns_table: tuple[np.ndarray, np.ndarray],
    block_hash: np.ndarray,
    parent_hash: np.ndarray,
) -> np.ndarray:
    """Sealed `disk_journal.RECORD`s (k,) from k slots' columns (`ns_ids` index `ns_table`)."""
    rec = np.zeros(len(generation), dtype=dj.RECORD)
    rec["generation"] = generation
    rec["checksum"] = checksum
    rec["flags"] = np.where(committed, dj.COMMITTED, 0) | np.where(has_parent, dj.HAS_PARENT, 0)
    table, lens = ns_table
    rec["ns"], rec["ns_len"] = table[ns_ids], lens[ns_ids]
    rec["hash"], rec["parent"] = block_hash, parent_hash
    dj.seal(rec)
    return rec


@dataclasses.dataclass
class DiskCounters:
    """What the tier did since it opened (bytes and blocks moved, faults)."""

    resident_blocks: int = 0
    resident_bytes: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    freed_blocks: int = 0
    dropped_blocks: int = 0  # checksum mismatches (at start-up or on a read)
    io_errors: int = 0  # failed system calls
    degradations: int = 0
