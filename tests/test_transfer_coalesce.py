"""Runs of adjacent blocks move as one UCX message (`transfer.coalesce`); every block is still checked alone.

The cases with an in-process UCX server run in a fresh interpreter (tests/fresh_process.py says why: one
flaked in a full CI run, every block of a write failing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.fresh_process import in_fresh_process
from tests.test_store_node import NS, h, rand_blocks, require_ucx
from transfer import BlockRead, BlockWrite, UcxBlockServer, UcxTransport, checksum
from transfer.coalesce import adjacent_groups, check_merged, merge

NB = 64 * 1024


def test_adjacent_groups_follow_memory_not_indices() -> None:
    rows = np.zeros((6, 8), dtype=np.uint8)
    assert adjacent_groups([memoryview(r) for r in rows]) == [6]
    apart = [memoryview(np.zeros(8, dtype=np.uint8)) for _ in range(3)]
    assert adjacent_groups(apart) == [1, 1, 1]
    swapped = [memoryview(rows[1]), memoryview(rows[0]), memoryview(rows[2]), memoryview(rows[3])]
    assert adjacent_groups(swapped) == [1, 1, 2]


def test_merge_only_joins_consecutive_adjacent_blocks_of_one_group() -> None:
    seg = np.zeros((10, 8), dtype=np.uint8)
    v = [memoryview(r) for r in seg]
    # indices 0..5 served from slots 0,1,2 | 4,5,6 (a gap in memory after slot 2); index 6 not served
    served = [(0, v[0]), (1, v[1]), (2, v[2]), (3, v[4]), (4, v[5]), (5, v[6])]
    plan = merge(served, [7])
    assert [(i, n) for i, n, _ in plan] == [(0, 3), (3, 3)]
    assert plan[0][2].nbytes == 24 and bytes(plan[0][2]) == seg[:3].tobytes()
    # the client's destinations split after index 1: no run crosses a group
    assert [(i, n) for i, n, _ in merge(served, [2, 5])] == [(0, 2), (2, 1), (3, 3)]
    # a refused block in the middle (index 1 not served) breaks the run
    assert [(i, n) for i, n, _ in merge([served[0], served[2]], [3])] == [(0, 1), (2, 1)]


def test_check_merged_refuses_runs_the_client_cannot_receive() -> None:
    ok = [True, True, False, True, True]
    assert check_merged([[0, 2], [3, 2]], ok, [5]) == [(0, 2), (3, 2)]
    assert check_merged(None, ok, [5]) == []
    for bad in ([[1, 2]], [[3, 2]], [[0, 1]], [[4, 2]], [[-1, 2]], [[0, 2], [1, 2]], [["x", 2]], "m"):
        with pytest.raises(ValueError):
            check_merged(bad, ok, [5] if bad != [[3, 2]] else [4, 1])


@contextlib.contextmanager
def _served_table(num_slots: int, nb: int) -> Iterator[tuple[Any, UcxBlockServer, str, UcxTransport]]:
    """(slot table, its UCX block server, the server's address, a client transport), stopped after."""
    require_ucx()
    from kvpool.store import Segment, SlotTable

    table = SlotTable(Segment(num_slots * nb, nb, pin_memory="off"))
    server = UcxBlockServer(table)
    peer = f"127.0.0.1:{server.start()}"
    t = UcxTransport(endpoints_per_peer=1, blocks_per_message=64, probe_bytes=0, probe_pings=1)
    try:
        yield table, server, peer, t
    finally:
        t.close()
        server.stop()


def test_runs_move_as_one_message_and_each_block_is_still_checked() -> None:
    in_fresh_process(
        "tests.test_transfer_coalesce", "_case_runs_move_as_one_message_and_each_block_is_still_checked"
    )


def _case_runs_move_as_one_message_and_each_block_is_still_checked(_unused: UcxTransport) -> None:
    from kvpool.store.slots import Reservation

    with _served_table(64, NB) as (table, server, peer, t):
        data = rand_blocks(32, nb=NB, seed=21)
        slots = [*range(0, 16), *range(20, 36)]  # two runs of adjacent slots
        table.reserve([Reservation(s, 1, NS, h(s)) for s in slots if s != 7], 10_000)
        writes = [BlockWrite(s, 1, data[i], checksum(data[i])) for i, s in enumerate(slots)]
        res = t.write_blocks(peer, writes, timeout_s=10)
        assert [i for i, r in enumerate(res) if not r.ok] == [7]  # slot 7 was never reserved
        merged_writes = server.num_merged_runs
        assert merged_writes >= 3  # 0-6, 8-15, 20-35 (sources are rows of one array)
        ok_slots = [s for s in slots if s != 7]
        assert all(e == "" for _, _, e in table.commit([(s, 1) for s in ok_slots]))

        out = np.zeros_like(data)
        reads = [BlockRead(s, 1, NB) for s in slots]
        table.segment.array[25 * NB + 3] ^= 0x10  # corrupt slot 25 (index 21) after its commit
        res = t.read_blocks(peer, reads, [memoryview(o) for o in out], timeout_s=10)
        bad = [i for i, r in enumerate(res) if not r.ok]
        assert bad == [7, 21], [(i, res[i].error) for i in bad]
        assert "checksum mismatch" in res[21].error
        good = [i for i in range(32) if i not in bad]
        assert np.array_equal(out[good], data[good])
        assert server.num_merged_runs >= merged_writes + 3

        # destinations that are not adjacent: every block alone, same bytes
        apart = [np.zeros(NB, dtype=np.uint8) for _ in range(4)]
        before = server.num_merged_runs
        res = t.read_blocks(peer, reads[:4], [memoryview(a) for a in apart], timeout_s=10)
        assert all(r.ok for r in res) and server.num_merged_runs == before
        assert all(np.array_equal(a, data[i]) for i, a in enumerate(apart))


def test_large_runs_are_verified_as_they_land() -> None:
    in_fresh_process("tests.test_transfer_coalesce", "_case_large_runs_are_verified_as_they_land")


def _case_large_runs_are_verified_as_they_land(_unused: UcxTransport) -> None:
    """Messages of >= 1 MiB are hashed as soon as they land (reads on the client, writes on the store):
    one corrupted block inside such a run is still caught, and only that block fails."""
    from kvpool.store.slots import Reservation
    from transfer.ucx_messages import _VERIFY_EARLY_BYTES
    from transfer.ucx_server import _HASH_EARLY_BYTES

    nb = 256 << 10
    assert 8 * nb >= max(_VERIFY_EARLY_BYTES, _HASH_EARLY_BYTES)
    with _served_table(16, nb) as (table, server, peer, t):
        data = rand_blocks(16, nb=nb, seed=31)
        table.reserve([Reservation(s, 1, NS, h(s)) for s in range(16)], 10_000)
        sums = [checksum(d) for d in data]
        sums[5] ^= 1  # the writer names a wrong checksum for one block of the first run
        before = server.num_merged_runs
        res = t.write_blocks(peer, [BlockWrite(s, 1, data[s], sums[s]) for s in range(16)], timeout_s=10)
        assert server.num_merged_runs > before  # the blocks really moved as merged runs
        assert [i for i, r in enumerate(res) if not r.ok] == [5]
        assert "ChecksumMismatch" in res[5].error
        assert all(e == "" for _, _, e in table.commit([(s, 1) for s in range(16) if s != 5]))

        table.segment.array[12 * nb + 7] ^= 0x01  # corrupt a committed block inside the second run
        reads = [BlockRead(s, 1, nb) for s in range(16) if s != 5]
        out = np.zeros((15, nb), dtype=np.uint8)
        res = t.read_blocks(peer, reads, [memoryview(o) for o in out], timeout_s=10)
        bad = [reads[i].slot for i, r in enumerate(res) if not r.ok]
        assert bad == [12] and "checksum mismatch" in res[11].error
        good = [i for i, r in enumerate(reads) if r.slot != 12]
        assert np.array_equal(out[good], data[[reads[i].slot for i in good]])
