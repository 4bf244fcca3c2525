"""A store's disk tier served over its real gRPC service and UCX data plane: disk slots reserved, written,
committed and read bit-exact with their generations; damaged bytes refused at read; blocks demoted to disk and
promoted back; a move whose source was freed meanwhile discarded; kill -9 during demotions, then a restart
that lists only whole, verified blocks under new generations; ENOSPC and EIO degrading the tier without
failing a memory read (those with an in-process store: tests/test_store_disk_inproc.py). Store processes."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.client import convert as cv
from kvpool.store.node import DISK_FIRST_SLOT
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.capabilities import require_ucx
from tests.test_store_node import (
    LAYOUT,
    NB,
    FakeMaster,
    StoreProc,
    _fake_master,
    _wait,
    code_of,
    commit,
    put_blocks,
    rand_blocks,
    read,
    reserve,
)
from transfer import BlockWrite, UcxTransport, checksum

F = DISK_FIRST_SLOT
OK, FAILED, STALE = pb.TIER_MOVE_OK, pb.TIER_MOVE_FAILED, pb.TIER_MOVE_STALE


@pytest.fixture(scope="module")
def transport() -> Iterator[UcxTransport]:
    require_ucx()
    t = UcxTransport()
    yield t
    t.close()


def disk_store(path: Path, *extra: str) -> StoreProc:
    """A store process with 8 MiB of memory (256 slots) and a 4 MiB disk tier (128 slots) at `path`."""
    return StoreProc(
        "--segment-size", "8MiB", "--layout", LAYOUT, "--node-id", "d",
        "--disk-path", str(path), "--disk-size", "4MiB", *extra,
    )  # fmt: skip


def disk_info(stub: pb_grpc.StoreStub) -> pb.DiskTierInfo:
    return stub.GetInfo(pb.GetInfoRequest(), timeout=10).disk


def moves(
    stub: pb_grpc.StoreStub, demote: bool, orders: list[tuple[int, int, int, int]]
) -> list[pb.TierMoveResult]:
    req = pb.TierMoveRequest(
        moves=[
            pb.TierMove(src=pb.SlotRef(slot=s, generation=g), dst=pb.SlotRef(slot=d, generation=dg))
            for s, g, d, dg in orders
        ]
    )
    call = stub.DemoteBlocks if demote else stub.PromoteBlocks
    return list(call(req, timeout=30).results)


def inventory(stub: pb_grpc.StoreStub) -> list:  # type: ignore[type-arg]
    return [cv.inventory_batch(r) for r in stub.Inventory(pb.InventoryRequest(max_entries=1000), timeout=30)]


def rows_on(batches: list, medium: int) -> tuple[list[int], list[int]]:  # type: ignore[type-arg]
    """(slots, generations) of the inventory rows on `medium` (each batch holds one medium)."""
    slots, gens = [], []
    for b in batches:
        if not len(b):
            continue
        assert b.medium is not None and len(set(b.medium.tolist())) <= 1
        keep = b.medium == medium
        slots += b.slots[keep].tolist()
        gens += b.generations[keep].tolist()
    return slots, gens


def write_disk(s: Any, t: UcxTransport, slots: list[int], gen: int, data: np.ndarray) -> None:
    reserve(s, slots, gen)  # type: ignore[arg-type]
    res = t.write_blocks(
        s.data_address,
        [BlockWrite(x, gen, data[i], checksum(data[i])) for i, x in enumerate(slots)],
        timeout_s=30,
    )
    assert all(r.ok for r in res), [r.error for r in res]
    assert all(r.ok for r in commit(s, slots, gen)), commit(s, slots, gen)  # type: ignore[arg-type]


# ---------------------------------------------------------------- store processes


def test_a_disk_slot_is_reserved_written_committed_and_read_bit_exact(
    tmp_path: Path,
    transport: UcxTransport,
) -> None:
    s = disk_store(tmp_path)
    try:
        info = disk_info(s.stub)
        assert (info.first_slot, info.num_slots, info.block_nbytes) == (F, 128, NB)
        assert info.alpha_s > 0 and info.beta_s_per_byte > 0 and not info.degraded
        g = info.first_generation
        slots = [F, F + 1, F + 2, F + 40]
        data = rand_blocks(4, seed=3)
        write_disk(s, transport, slots, g, data)
        res, out = read(transport, s, slots, g)  # same host: the segment is mapped, disk slots still sent
        assert all(r.ok for r in res), [r.error for r in res]
        assert np.array_equal(out, data) and [r.checksum for r in res] == [checksum(d) for d in data]
        res, _ = read(transport, s, [F, F + 1], g + 1)  # a generation the slot is not at
        assert not any(r.ok for r in res) and all("generation" in r.error for r in res), res
        assert disk_info(s.stub).num_used_slots == 4
        assert rows_on(inventory(s.stub), 1) == (slots, [g] * 4)
        freed = s.stub.FreeSlots(pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=F, generation=g)]), timeout=10)
        assert [(x.slot, x.new_generation, x.deferred) for x in freed.slots] == [(F, g + 1, False)]
        res, _ = read(transport, s, [F], g)  # freed: the old location is refused
        assert not res[0].ok
        assert code_of(lambda: reserve(s, [F], g)) == grpc.StatusCode.FAILED_PRECONDITION  # below current
        assert rows_on(inventory(s.stub), 1)[0] == slots[1:]
    finally:
        s.kill()


def test_bytes_corrupted_on_disk_are_refused_at_read_and_counted(
    tmp_path: Path,
    transport: UcxTransport,
) -> None:
    s = disk_store(tmp_path)
    try:
        g = disk_info(s.stub).first_generation
        data = rand_blocks(2, seed=4)
        write_disk(s, transport, [F, F + 1], g, data)
        fd = os.open(tmp_path / "blocks.data", os.O_RDWR)
        try:  # a bit flip in slot 0's block, as a failing disk returns
            byte = os.pread(fd, 1, 1000)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), 1000)
            os.fsync(fd)
        finally:
            os.close(fd)
        res, out = read(transport, s, [F, F + 1], g)
        assert not res[0].ok and "ChecksumMismatch" in res[0].error, res[0]
        assert res[1].ok and np.array_equal(out[1], data[1])
        assert not out[0].any()  # never served: no byte of it reached the reader
        res, _ = read(transport, s, [F], g)  # dropped: its generation moved
        assert not res[0].ok and "generation" in res[0].error
        assert disk_info(s.stub).num_used_slots == 1
        assert rows_on(inventory(s.stub), 1)[0] == [F + 1]
        assert metric(s, "kvpool_store_disk_refused_reads_total") == 1
        assert metric(s, "kvpool_store_disk_dropped_blocks_total") == 1
    finally:
        s.kill()


def test_demote_and_promote_keep_bytes_and_records(tmp_path: Path, transport: UcxTransport) -> None:
    s = disk_store(tmp_path)
    try:
        g = disk_info(s.stub).first_generation
        data = rand_blocks(8, seed=5)
        put_blocks(s, transport, list(range(8)), data)
        got = moves(s.stub, True, [(i, 1, F + 10 + i, g) for i in range(8)])
        assert [r.status for r in got] == [OK] * 8 and [r.dst.generation for r in got] == [g] * 8
        res, out = read(transport, s, [F + 10 + i for i in range(8)], g)
        assert all(r.ok for r in res) and np.array_equal(out, data)
        batches = inventory(s.stub)
        assert rows_on(batches, 0)[0] == list(range(8)) and rows_on(batches, 1)[0] == [
            F + 10 + i for i in range(8)
        ]
        disk_rows = [b for b in batches if len(b) and b.medium[0] == 1][0]
        mem_rows = [b for b in batches if len(b) and b.medium[0] == 0][0]
        assert np.array_equal(
            disk_rows.block_hashes, mem_rows.block_hashes
        )  # the record moved with the bytes
        assert np.array_equal(disk_rows.checksums, mem_rows.checksums)
        # a source at another generation, a destination that holds a block: nothing moves
        bad = moves(s.stub, True, [(0, 2, F + 30, g), (1, 1, F + 10, g)])
        assert [r.status for r in bad] == [STALE, FAILED], bad
        assert rows_on(inventory(s.stub), 1)[0] == [F + 10 + i for i in range(8)]
        back = moves(s.stub, False, [(F + 10 + i, g, 100 + i, 1) for i in range(4)])
        assert [r.status for r in back] == [OK] * 4, back
        res, out = read(transport, s, [100 + i for i in range(4)], 1)
        assert all(r.ok for r in res) and np.array_equal(out, data[:4])
        assert (
            metric(s, "kvpool_store_demotions_total") == 8 and metric(s, "kvpool_store_promotions_total") == 4
        )
        assert metric(s, 'kvpool_store_medium_blocks{medium="disk"}') == 8
        assert metric(s, 'kvpool_store_medium_blocks{medium="memory"}') == 12
        assert (
            metric(s, "kvpool_store_stale_moves_total") == 1
            and metric(s, "kvpool_store_failed_moves_total") == 1
        )
    finally:
        s.kill()


def metric(s: StoreProc, name: str) -> float:
    """The value of one sample line of the store's /metrics (`name` with its labels)."""
    with urllib.request.urlopen(f"http://{s.info['metrics_address']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")))


def test_heartbeats_carry_the_disk_tier_and_its_measured_cost(tmp_path: Path) -> None:
    m = FakeMaster()
    server = _fake_master(m)
    s = disk_store(tmp_path, "--master", f"127.0.0.1:{server.port}")
    try:
        _wait(lambda: len(m.heartbeats) >= 2)
        d = m.heartbeats[-1].disk
        assert (d.first_slot, d.num_slots, d.block_nbytes) == (F, 128, NB)
        assert d.alpha_s > 0 and 0 < d.beta_s_per_byte < 1e-6 and d.first_generation >= 1 << 32
        reserve(s, [F + 2], d.first_generation, lease_ms=100)  # reclaimed on expiry, reported as freed
        _wait(
            lambda: any(
                (f.slot, f.generation) == (F + 2, d.first_generation + 1)
                for hb in m.heartbeats
                for f in hb.freed_slots
            )
        )
    finally:
        s.kill()
        server.stop(0)


def _demote_until_killed(s: StoreProc, g: int, acked: list[int], stop: threading.Event) -> None:
    k = 0
    while not stop.is_set() and k < 120:
        try:
            got = moves(s.stub, True, [(k + j, 1, F + k + j, g) for j in range(4)])
        except grpc.RpcError:
            return
        acked += [r.dst.slot for r in got if r.status == OK]
        k += 4


def test_kill_9_during_demotions_then_restart_lists_only_whole_verified_blocks(
    tmp_path: Path,
    transport: UcxTransport,
) -> None:
    s = disk_store(tmp_path)
    data = rand_blocks(124, seed=6)
    acked: list[int] = []
    try:
        g = disk_info(s.stub).first_generation
        put_blocks(s, transport, list(range(124)), data)
        stop = threading.Event()
        mover = threading.Thread(target=_demote_until_killed, args=(s, g, acked, stop))
        mover.start()
        deadline = time.monotonic() + 60
        while len(acked) < 24 and mover.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        s.proc.kill()  # SIGKILL in the middle of the demotions
        stop.set()
        mover.join(30)
    finally:
        s.kill()
    assert len(acked) >= 24
    again = disk_store(tmp_path)
    try:
        info = disk_info(again.stub)
        assert info.first_generation > g and info.recovered_blocks >= len(acked)
        batches = inventory(again.stub)
        assert rows_on(batches, 0)[0] == []  # memory died with the process
        slots, gens = rows_on(batches, 1)
        assert set(acked) <= set(slots) and all(F <= x < F + 124 for x in slots)
        assert all(x >= info.first_generation for x in gens)
        res, out = read(transport, again, slots, gens[0]) if len(set(gens)) == 1 else (None, None)
        assert res is not None and all(r.ok for r in res), res
        assert np.array_equal(out, data[[x - F for x in slots]])  # whole blocks, each the one demoted there
        res, _ = read(transport, again, slots[:4], g)  # a location from before the restart
        assert not any(r.ok for r in res)
    finally:
        again.kill()


# ---------------------------------------------------------------- an in-process store (faults, a held move)
