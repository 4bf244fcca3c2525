"""Helpers of the disk tier tests: blocks whose bytes follow from their hash (so a test, or a crash test's
parent after the child is gone, can check any block it finds), and a writer used as a child process."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvpool.store.disk_tier import DiskTier
from transfer import checksums

BN = 64 << 10  # bytes a block
FIRST = 1 << 31
NS = b"n" * 16


def content(hashes: np.ndarray, nbytes: int = BN) -> np.ndarray:
    """(k, nbytes) uint8: the bytes of the block with each hash row (k, 16) (seeded by the hash)."""
    out = np.empty((len(hashes), nbytes), dtype=np.uint8)
    for i, h in enumerate(hashes):
        rng = np.random.default_rng(int.from_bytes(h.tobytes(), "little"))
        out[i] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return out


def hashes_of(keys: list[int]) -> np.ndarray:
    return np.frombuffer(b"".join(k.to_bytes(16, "little") for k in keys), dtype=np.uint8).reshape(-1, 16)


def put(t: DiskTier, slots: list[int], keys: list[int] | None = None, *, parent: bool = False) -> list[str]:
    """Write blocks with hash keys `keys` (default: the slot numbers) into disk slots `slots`."""
    h = hashes_of(keys if keys is not None else slots)
    blocks = content(h, t.block_nbytes)
    s = np.array(slots, dtype=np.int64)
    par = np.roll(h, 1, axis=0)
    return t.write(
        s,
        t.generation_of(s),
        blocks,
        [NS] * len(slots),
        h,
        par,
        np.full(len(slots), parent),
        np.array(checksums(blocks), dtype=np.uint64),
    )


def _writer(path: str) -> None:
    """Child process: write batches of 16 blocks over and over (freeing the oldest) and print each
    acknowledged batch's first slot and key, flushed, until killed."""
    t = DiskTier.open(Path(path), 256 * BN, BN, first_slot=FIRST)
    key, batch = 1, 16
    while True:
        for a in range(0, 256, batch):
            slots = list(range(FIRST + a, FIRST + a + batch))
            if t.flags[a] & 1:
                t.free(np.array(slots), t.generation_of(np.array(slots)))
            keys = list(range(key, key + batch))
            if any(put(t, slots, keys)):
                raise SystemExit("write failed")
            print(f"ack {a} {key}", flush=True)
            key += batch


if __name__ == "__main__":
    _writer(sys.argv[1])
