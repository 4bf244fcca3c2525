"""`kvpool store --disk-path DIR --disk-size SIZE` as a real process: a bad path is refused at start with one
line and exit 2, a good one is opened (and locked against a second store until the first one dies), and the
blocks an earlier run left there are recovered at start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from kvpool.store.disk_tier import DiskTier
from kvpool.store.node import DISK_FIRST_SLOT
from tests.disk_tier_util import content, hashes_of
from tests.test_store_node import LAYOUT, NB, StoreProc
from transfer import checksums

SIZE = "4MiB"  # 128 slots of 32 KiB


def _store(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--segment-size", "8MiB", "--layout", LAYOUT, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _error_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in out.stderr.splitlines() if " INFO " not in x and " WARNING " not in x]
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


def test_a_bad_disk_path_is_refused_at_start_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    line = _error_line(_store("--disk-path", str(missing), "--disk-size", SIZE))
    assert line == f"kvpool store: DiskTierError: disk tier {missing}: no such directory"
    line = _error_line(_store("--disk-path", str(tmp_path), "--disk-size", "4KiB"))
    assert line.startswith(f"kvpool store: DiskTierError: disk tier {tmp_path}: 4096 bytes do not hold")
    assert "--disk-path needs --disk-size" in _error_line(_store("--disk-path", str(tmp_path)))


def test_a_store_opens_its_disk_tier_locks_it_and_recovers_its_blocks(tmp_path: Path) -> None:
    t = DiskTier.open(tmp_path, 4 << 20, NB, first_slot=DISK_FIRST_SLOT)  # an earlier run's blocks
    s = np.arange(DISK_FIRST_SLOT, DISK_FIRST_SLOT + 5)
    h = hashes_of(list(range(5)))
    blocks = content(h, NB)
    ns = [b"n" * 16] * 5
    cs = np.array(checksums(blocks), dtype=np.uint64)
    assert t.write(s, t.generation_of(s), blocks, ns, h, h, np.zeros(5, bool), cs) == [""] * 5
    t.close()
    first = StoreProc(
        "--segment-size", "8MiB", "--layout", LAYOUT, "--disk-path", str(tmp_path), "--disk-size", SIZE
    )
    try:
        disk = first.info["disk"]
        assert disk == {
            "path": str(tmp_path),
            "first_slot": DISK_FIRST_SLOT,
            "num_slots": 128,
            "direct": True,
            "recovered_blocks": 5,
        }
        line = _error_line(_store("--disk-path", str(tmp_path), "--disk-size", SIZE))
        assert line == (
            f"kvpool store: DiskTierError: disk tier {tmp_path}: held by another live store "
            f"(pid {first.proc.pid})"
        )
    finally:
        first.kill()  # SIGKILL: the lock dies with the process
    again = StoreProc(
        "--segment-size", "8MiB", "--layout", LAYOUT, "--disk-path", str(tmp_path), "--disk-size", SIZE
    )
    try:
        assert again.info["disk"]["recovered_blocks"] == 5
    finally:
        again.kill()
