"""The disk tier under faults: a file system that fills up and one that turns read-only (real ones: a small
loop-mounted ext4, needs root and `mount`), EIO (injected: it cannot be caused here), a read-only directory
at start-up. Each is reported per slot and degrades the tier (writes refused, reads of good blocks still
served), with no exception."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.store import disk_io
from kvpool.store import disk_journal as dj
from kvpool.store.disk_tier import DiskTier, DiskTierError
from tests.capabilities import skip
from tests.disk_tier_util import BN, FIRST, content, hashes_of, put


def _loop_fs(tmp_path: Path, size_mib: int) -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        skip("loopmount", "a loop-mounted file system needs root and mkfs.ext4")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-m", "0", str(img)], check=True)
    mount = ["mount", "-o", "loop,errors=remount-ro", str(img), str(mnt)]  # as a failing disk turns ext4
    if subprocess.run(mount, capture_output=True).returncode:
        skip("loopmount", "mount -o loop is not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    yield from _loop_fs(tmp_path, 8)


def _read(t: DiskTier, slots: list[int]) -> tuple[list[str], np.ndarray]:
    s = np.array(slots, dtype=np.int64)
    out = np.zeros((len(slots), t.block_nbytes), dtype=np.uint8)
    return t.read(s, t.generation_of(s), out), out


def test_a_full_disk_degrades_the_tier_and_good_blocks_still_read(small_fs: Path) -> None:
    t = DiskTier.open(small_fs, 256 * BN, BN, first_slot=FIRST)  # 16 MiB of slots on an 8 MiB disk
    assert put(t, list(range(FIRST, FIRST + 8))) == [""] * 8
    errors = put(t, list(range(FIRST + 8, FIRST + 200)))  # 12 MiB more: the disk fills up
    assert any(e.startswith("Unavailable: disk write failed") and "ENOSPC" in e for e in errors), errors
    assert t.degraded is not None and "ENOSPC" in t.degraded
    assert t.counters.degradations == 1 and t.counters.io_errors >= 1
    refused = put(t, [FIRST + 250])
    assert refused[0].startswith("Unavailable: disk tier degraded")  # no more writes
    ok, out = _read(t, list(range(FIRST, FIRST + 8)))
    assert ok == [""] * 8 and np.array_equal(out, content(hashes_of(list(range(FIRST, FIRST + 8)))))
    listed = set(t.inventory_batch(0, 1000).slots.tolist())
    assert set(range(FIRST, FIRST + 8)) <= listed and all(  # a failed block is never listed
        s in listed for s, e in zip(range(FIRST + 8, FIRST + 200), errors, strict=True) if not e
    )
    assert not listed & {s for s, e in zip(range(FIRST + 8, FIRST + 200), errors, strict=True) if e}
    t.close()


def test_a_disk_that_turns_read_only_degrades_the_tier(small_fs: Path) -> None:
    t = DiskTier.open(small_fs, 64 * BN, BN, first_slot=FIRST)
    assert put(t, [FIRST, FIRST + 1]) == ["", ""]
    source = subprocess.run(["findmnt", "-no", "SOURCE", str(small_fs)], capture_output=True, text=True)
    trigger = Path("/sys/fs/ext4") / Path(source.stdout.strip()).name / "trigger_fs_error"
    if not trigger.exists():
        skip("loopmount", "this kernel has no ext4 trigger_fs_error")
    trigger.write_text("disk tier test\n")  # ext4 meets an error and remounts itself read-only
    errors = put(t, [FIRST + 2, FIRST + 3])
    assert all(e.startswith("Unavailable: disk write failed") for e in errors), errors
    assert t.degraded is not None and "EROFS" in t.degraded
    assert _read(t, [FIRST, FIRST + 1])[0] == ["", ""]
    s = np.array([FIRST])
    assert t.free(s, t.generation_of(s)) == [""]  # freed here though it cannot be recorded
    assert t.counters.degradations == 1
    t.close()
    with pytest.raises(DiskTierError, match=f"disk tier {small_fs}: not writable"):
        DiskTier.open(small_fs, 64 * BN, BN, first_slot=FIRST)  # refused at start-up, one line


def test_an_unwritable_directory_is_refused_at_start(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes through modes: a read-only file system stands in (above)
        skip("nonroot", "root writes through directory modes")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(DiskTierError, match=f"disk tier {tmp_path}: not writable"):
            DiskTier.open(tmp_path, 64 * BN, BN, first_slot=FIRST)
    finally:
        tmp_path.chmod(0o700)


def test_eio_is_reported_per_slot_and_degrades_without_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = DiskTier.open(tmp_path, 64 * BN, BN, first_slot=FIRST)
    put(t, [FIRST, FIRST + 1, FIRST + 5])
    real = os.preadv

    def failing(fd: int, bufs: list[memoryview], offset: int) -> int:  # slot 5 sits on a bad sector
        if fd == t._data.fd and offset == 5 * t.slot_nbytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    monkeypatch.setattr(disk_io.os, "preadv", failing)
    errors, out = _read(t, [FIRST + 5, FIRST, FIRST + 1])
    assert errors[0].startswith("Unavailable: disk read failed") and "EIO" in errors[0]
    assert errors[1:] == ["", ""]
    assert np.array_equal(out[1:], content(hashes_of([FIRST, FIRST + 1])))
    assert t.degraded is not None and "EIO" in t.degraded and t.counters.io_errors == 1
    assert put(t, [FIRST + 9])[0].startswith("Unavailable: disk tier degraded")
    t.close()


def test_a_block_whose_record_fails_is_refused_and_not_recovered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written but never recorded (the record file returned EIO): the write is refused and the block is
    not listed, now or after a restart."""
    t = DiskTier.open(tmp_path, 64 * BN, BN, first_slot=FIRST)
    assert put(t, [FIRST]) == [""]
    real = os.pwrite

    def failing(fd: int, data: bytes, offset: int) -> int:
        if fd == t._journal.fd:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, data, offset)

    monkeypatch.setattr(dj.os, "pwrite", failing)
    errors = put(t, [FIRST + 1, FIRST + 2])
    assert all(e.startswith("Unavailable: disk write failed") and "EIO" in e for e in errors), errors
    assert t.inventory_batch(0, 10).slots.tolist() == [FIRST]
    monkeypatch.undo()
    t.close()
    t = DiskTier.open(tmp_path, 64 * BN, BN, first_slot=FIRST)
    assert t.recovered().slots.tolist() == [FIRST]
    t.close()
