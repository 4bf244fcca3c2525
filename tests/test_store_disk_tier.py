"""The store's disk tier engine on real files: read-back, restarts (new generations, never going back),
damaged bytes and records, a writer killed with SIGKILL, and the directory lock against a live second
opener."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvpool.errors import InvalidArgument
from kvpool.store import disk_journal as dj
from kvpool.store.disk_tier import DiskTier, DiskTierError
from tests.disk_tier_util import BN, FIRST, NS, content, hashes_of, put

ROOT = Path(__file__).resolve().parents[1]


def _open(path: Path, nslots: int = 64, **kw: object) -> DiskTier:
    return DiskTier.open(path, nslots * BN, BN, first_slot=FIRST, **kw)  # type: ignore[arg-type]


def _read(t: DiskTier, slots: list[int], gens: np.ndarray | None = None) -> tuple[list[str], np.ndarray]:
    s = np.array(slots, dtype=np.int64)
    out = np.zeros((len(slots), t.block_nbytes), dtype=np.uint8)
    return t.read(s, t.generation_of(s) if gens is None else gens, out), out


def test_blocks_read_back_bit_exact_and_list_in_slot_order(tmp_path: Path) -> None:
    t = _open(tmp_path)
    slots = [FIRST + i for i in (5, 6, 7, 9, 30, 2)]  # runs and gaps, not in order
    assert put(t, slots, parent=True) == [""] * 6
    errors, out = _read(t, slots[::-1])
    assert errors == [""] * 6
    assert np.array_equal(out, content(hashes_of(slots[::-1])))
    raw = np.fromfile(tmp_path / "blocks.data", dtype=np.uint8).reshape(-1, t.slot_nbytes)
    assert np.array_equal(raw[[s - FIRST for s in slots]], content(hashes_of(slots)))  # slot i at i * size
    first = t.inventory_batch(0, 4)
    assert first.slots.tolist() == [FIRST + i for i in (2, 5, 6, 7)] and first.next_slot == FIRST + 8
    rest = t.inventory_batch(first.next_slot, 4)
    assert rest.slots.tolist() == [FIRST + 9, FIRST + 30] and rest.next_slot == -1
    assert first.namespaces == [NS] and first.has_parent.all()
    assert np.array_equal(first.block_hashes, hashes_of([FIRST + i for i in (2, 5, 6, 7)]))
    c = t.counters
    assert (c.resident_blocks, c.written_blocks, c.read_blocks) == (6, 6, 6)
    assert t.direct  # /tmp is ext4 here: the page cache is bypassed
    alpha_s, beta = t.measure()
    assert 0 < alpha_s < 1 and 0 < beta < 1e-7  # a disk reads a page in under 1 s and above 10 MB/s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocks.data", "lock", "slots.meta"]
    t.close()


def test_an_occupied_stale_or_foreign_slot_and_a_wrong_checksum_are_refused_per_slot(tmp_path: Path) -> None:
    t = _open(tmp_path)
    assert put(t, [FIRST]) == [""]
    assert put(t, [FIRST])[0].startswith("FailedPrecondition")  # holds a block
    s = np.array([FIRST + 1, FIRST + 2, 5])
    h = hashes_of([1, 2, 3])
    blocks = content(h)
    g = t.generation_of(np.array([FIRST + 1, FIRST + 2]))
    gens = np.array([int(g[0]), int(g[1]) - 1, 1], dtype=np.int64)  # right; one behind; (a slot out of range)
    errors = t.write(s, gens, blocks, [NS] * 3, h, h, np.zeros(3, bool), np.array([1, 2, 3]))
    assert errors[0].startswith("ChecksumMismatch") and errors[1].startswith("StaleGeneration")
    assert errors[2].startswith("NotFound")
    assert _read(t, [FIRST + 1])[0][0].startswith("FailedPrecondition")  # nothing was written
    with pytest.raises(InvalidArgument):
        t.write(s, gens, blocks[:2], [NS] * 3, h, h, np.zeros(3, bool), np.ones(3, int))
    t.close()


def test_a_restart_gives_recovered_blocks_new_generations_and_refuses_old_locations(tmp_path: Path) -> None:
    t = _open(tmp_path)
    put(t, [FIRST, FIRST + 1, FIRST + 2])
    freed = np.array([FIRST + 1])
    assert t.free(freed, t.generation_of(freed)) == [""]
    before = t.generation_of(np.arange(FIRST, FIRST + 4))
    t.close()
    t = _open(tmp_path)
    after = t.generation_of(np.arange(FIRST, FIRST + 4))
    got = t.recovered()
    assert got.slots.tolist() == [FIRST, FIRST + 2]
    assert got.generations.tolist() == after[[0, 2]].tolist()
    assert (after[[0, 2]] > before[[0, 2]]).all() and (after >= before).all()
    old_errors, _ = _read(t, [FIRST, FIRST + 2], before[[0, 2]])
    assert all(e.startswith("StaleGeneration") for e in old_errors)
    errors, out = _read(t, [FIRST, FIRST + 2], after[[0, 2]])
    assert errors == ["", ""] and np.array_equal(out, content(hashes_of([FIRST, FIRST + 2])))
    t.close()
    t = _open(tmp_path)  # and again: every restart moves them on
    assert (t.generation_of(np.arange(FIRST, FIRST + 4))[[0, 2]] > after[[0, 2]]).all()
    t.close()


def test_damaged_bytes_are_dropped_on_read_and_at_start_up(tmp_path: Path) -> None:
    t = _open(tmp_path)
    put(t, [FIRST + i for i in range(4)])
    gen = t.generation_of(np.array([FIRST + 1]))
    with open(tmp_path / "blocks.data", "r+b") as f:  # one byte of slot 1, one of slot 3
        for slot in (1, 3):
            f.seek(slot * t.slot_nbytes + 100)
            b = f.read(1)
            f.seek(slot * t.slot_nbytes + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    errors, _ = _read(t, [FIRST, FIRST + 1])
    assert errors[0] == "" and errors[1].startswith("ChecksumMismatch")
    assert t.counters.dropped_blocks == 1 and t.counters.resident_blocks == 3
    assert t.generation_of(np.array([FIRST + 1]))[0] > gen[0]  # its slot is free at a new generation
    assert t.degraded is None  # one bad block does not condemn the disk
    t.close()
    t = _open(tmp_path)
    assert t.recovered().slots.tolist() == [FIRST, FIRST + 2]  # slot 3 failed its check at start-up
    assert t.counters.dropped_blocks == 1
    t.close()


def test_a_torn_record_is_discarded_and_its_generation_still_moves_on(tmp_path: Path) -> None:
    t = _open(tmp_path)
    put(t, [FIRST, FIRST + 1])
    for _ in range(3):
        s = np.array([FIRST + 1])
        t.free(s, t.generation_of(s))
        put(t, [FIRST + 1])
    gen = int(t.generation_of(np.array([FIRST + 1]))[0])
    t.close()
    with open(tmp_path / "slots.meta", "r+b") as f:  # a crash tore slot 1's record
        f.seek(dj.HEADER_NBYTES + 1 * dj.RECORD_NBYTES + 40)
        f.write(b"\x00\x01\x02")
    t = _open(tmp_path)
    assert t.recovered().slots.tolist() == [FIRST]
    assert int(t.generation_of(np.array([FIRST + 1]))[0]) > gen
    assert put(t, [FIRST + 1]) == [""]  # the slot is usable again
    t.close()


def test_a_writer_killed_mid_stream_leaves_only_whole_verified_blocks(tmp_path: Path) -> None:
    """SIGKILL a process writing batches (and freeing old ones) at several moments; every block the child
    had acknowledged comes back, and every block that comes back has exactly the bytes of its hash."""
    for round_ in range(3):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.disk_tier_util", str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        assert child.stdout is not None
        acks = [child.stdout.readline() for _ in range(20 + 7 * round_)]
        time.sleep(0.05 * round_)  # land in different places of a batch
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        acks += child.stdout.read().splitlines()  # what it acknowledged before it died
        assert all(a.startswith("ack ") for a in acks), acks
        t = _open(tmp_path, 256)
        got = t.recovered()
        errors, out = _read(t, got.slots.tolist())
        assert errors == [""] * len(got)
        assert np.array_equal(out, content(got.block_hashes))  # whole blocks, the bytes of their hash
        held = {
            int(s): int.from_bytes(h.tobytes(), "little")
            for s, h in zip(got.slots, got.block_hashes, strict=True)
        }
        a, key = (int(x) for x in acks[-1].split()[1:])
        for i in range(16):  # the last acknowledged batch survived the kill
            assert held.get(FIRST + a + i) == key + i, (a, key, i)
        t.close()


def test_a_second_live_opener_is_refused_and_the_lock_ends_with_its_process(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from kvpool.store.disk_tier import DiskTier;"
        f"t = DiskTier.open(Path({str(tmp_path)!r}), {64 * BN}, {BN}, first_slot={FIRST});"
        "print('open', flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"open\n"
        with pytest.raises(
            DiskTierError, match=f"{tmp_path}.*held by another live store \\(pid {child.pid}\\)"
        ):
            _open(tmp_path)
    finally:
        child.kill()
        child.wait(30)
    _open(tmp_path).close()  # the lock died with its holder
    assert {p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {0o600}


def test_a_path_that_cannot_hold_a_tier_is_refused_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="no such directory"):
        _open(tmp_path / "missing")
    with pytest.raises(DiskTierError, match="do not hold one 65536-byte block slot"):
        DiskTier.open(tmp_path, BN - 1, BN, first_slot=FIRST)
    _open(tmp_path, 64).close()
    with pytest.raises(DiskTierError, match="holds 64 slots of 65536-byte blocks; this store asks for 32"):
        _open(tmp_path, 32)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(DiskTierError, match="no such directory"):
        _open(tmp_path / "file")
