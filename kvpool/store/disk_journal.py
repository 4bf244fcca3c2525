"""The disk tier's record of its slots (`slots.meta`): a header, then one 128-byte record per slot.

A record says which block a slot holds: the generation it was written at (uint64, for inspection), the
block's xxh3_64 checksum, flags (committed, has parent), the namespace (up to 32 bytes, with its length), the
block and parent hashes (16 bytes each), and an xxh3_64 of the record's first 120 bytes. Records are 128
bytes so that 4 fit a 512-byte sector and a record never straddles one; a record whose own checksum is wrong
(a torn write at a crash) is read as "no block".

The header (the file's first 4096 bytes) holds the geometry the file was made for (block and slot sizes,
slot count) and a boot count, raised and synced at every open before anything else: every slot starts a boot
at generation `boot_generation(boot)`, above every generation of every earlier boot, so generations never go
back across a restart and a location from before one is refused, whatever records were lost with it.

Records are written with buffered `pwrite` (they survive the process being killed) and synced by the caller
(`sync`, `kvpool.store.disk_tier`'s group commit) after the data file.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from transfer import checksums
from transfer.xxh3 import checksum_many

RECORD_NBYTES = 128
HEADER_NBYTES = 4096
NS_MAX_NBYTES = 32
COMMITTED = 1
HAS_PARENT = 2
_MAGIC = b"KVPDISK1"
_HEADER = struct.Struct("<8sIQQQQQ")  # magic, version, block_nbytes, slot_nbytes, num_slots, boot, checksum
_VERSION = 1
_SUMMED = 120  # bytes of a record covered by its checksum
_CHUNK = 1 << 16  # records hashed per call

RECORD = np.dtype(
    [
        ("generation", "<u8"),
        ("checksum", "<u8"),
        ("flags", "u1"),
        ("ns_len", "u1"),
        ("_pad", "u1", (6,)),
        ("ns", "u1", (NS_MAX_NBYTES,)),
        ("hash", "u1", (16,)),
        ("parent", "u1", (16,)),
        ("_pad2", "u1", (32,)),
        ("rec_sum", "<u8"),
    ]
)
assert RECORD.itemsize == RECORD_NBYTES


class JournalMismatch(ValueError):
    """The file was made for another geometry (block size, slot count) or is not a disk tier's record."""


def boot_generation(boot: int) -> int:
    """Every slot's generation when boot number `boot` (≥ 1) begins: above every generation of an earlier
    boot (a slot's generation rises by one per free or dropped block, far fewer than 2**32 times in one
    boot; below 2**63, the index's bound, for 2**31 boots)."""
    return boot << 32


def seal(records: np.ndarray) -> None:
    """Set `rec_sum` of each record (`RECORD` array, in place)."""
    raw = records.view(np.uint8).reshape(-1, RECORD_NBYTES)
    for a in range(0, len(records), _CHUNK):
        body = np.ascontiguousarray(raw[a : a + _CHUNK, :_SUMMED])
        sums = checksum_many(body) if len(body) < 1024 else checksums(body)  # small: no hand-off
        records["rec_sum"][a : a + _CHUNK] = np.asarray(sums, dtype=np.uint64)


def intact(records: np.ndarray) -> np.ndarray:
    """(n,) bool: each record's checksum matches its bytes."""
    raw = records.view(np.uint8).reshape(-1, RECORD_NBYTES)
    ok = np.zeros(len(records), dtype=np.bool_)
    for a in range(0, len(records), _CHUNK):
        body = np.ascontiguousarray(raw[a : a + _CHUNK, :_SUMMED])
        got = np.asarray(checksums(body), dtype=np.uint64) if len(body) else np.zeros(0, np.uint64)
        ok[a : a + _CHUNK] = got == records["rec_sum"][a : a + _CHUNK]
    return ok


class Journal:
    """The open `slots.meta` of `num_slots` slots. Raises `OSError` from the file system, `JournalMismatch`
    when an existing file was made for another geometry."""

    def __init__(self, fd: int, *, block_nbytes: int, slot_nbytes: int, num_slots: int) -> None:
        self.fd = fd
        self.num_slots = num_slots
        size = os.fstat(fd).st_size
        if size == 0:
            self.boot = 0
        else:
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) < _HEADER.size:
                raise JournalMismatch("slots.meta is truncated")
            magic, version, bn, sn, n, boot, hsum = _HEADER.unpack(raw)
            if magic != _MAGIC or version != _VERSION or hsum != _header_sum(bn, sn, n, boot):
                raise JournalMismatch(
                    "slots.meta is not a kvpool disk tier record (or its header is damaged)"
                )
            if (bn, n) != (block_nbytes, num_slots):
                raise JournalMismatch(
                    f"it holds {n} slots of {bn}-byte blocks; this store asks for {num_slots} of "
                    f"{block_nbytes} (use the same --disk-size and layout, or an empty directory)"
                )
            self.boot = boot
        self.boot += 1
        self._write_header(block_nbytes, slot_nbytes)
        if size < HEADER_NBYTES + num_slots * RECORD_NBYTES:  # reserved: a full disk still takes records
            os.posix_fallocate(fd, 0, HEADER_NBYTES + num_slots * RECORD_NBYTES)
        os.fdatasync(fd)

    def _write_header(self, block_nbytes: int, slot_nbytes: int) -> None:
        args = (block_nbytes, slot_nbytes, self.num_slots, self.boot)
        os.pwrite(self.fd, _HEADER.pack(_MAGIC, _VERSION, *args, _header_sum(*args)), 0)

    def load(self, start: int, count: int) -> np.ndarray:
        """Records `start` .. `start + count` as a `RECORD` array (zeros where the file is short)."""
        nbytes = count * RECORD_NBYTES
        raw = os.pread(self.fd, nbytes, HEADER_NBYTES + start * RECORD_NBYTES)
        buf = np.zeros(nbytes, dtype=np.uint8)
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return buf.view(RECORD)

    def store(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Write sealed `records` for slot indices `slots` (sorted or not), unsynced (`sync`). Consecutive
        slots go in one `pwrite`. Raises `OSError`."""
        order = np.argsort(slots, kind="stable")
        s, r = slots[order], records[order]
        cuts = [0, *(np.flatnonzero(np.diff(s) != 1) + 1).tolist(), len(s)]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            data = r[a:b].tobytes()
            off = HEADER_NBYTES + int(s[a]) * RECORD_NBYTES
            while data:
                n = os.pwrite(self.fd, data, off)
                data, off = data[n:], off + n

    def sync(self) -> None:
        """Make every stored record durable. Raises `OSError`."""
        os.fdatasync(self.fd)


def _header_sum(block_nbytes: int, slot_nbytes: int, num_slots: int, boot: int) -> int:
    body = _HEADER.pack(_MAGIC, _VERSION, block_nbytes, slot_nbytes, num_slots, boot, 0)
    return checksums([body])[0]
