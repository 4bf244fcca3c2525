"""A store's disk tier in an in-process `StoreNode` (its real gRPC and UCX servers), where a fault must be
injected or a move held mid-way: a demotion whose source is freed meanwhile is discarded; the move queue
refuses on backlog; ENOSPC and EIO during a demotion degrade the tier without failing a memory read; a free
waits for a disk read in flight; tier moves are fenced by leader epoch; disk reads and writes need their
capability. Each case runs in a fresh interpreter."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvpool.rpc.server import channel
from kvpool.store import disk_io
from kvpool.store.node import StoreNode
from kvpool.store.settings import StoreSettings
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.fresh_process import in_fresh_process
from tests.test_store_disk_serving import (
    FAILED,
    OK,
    STALE,
    F,
    disk_info,
    inventory,
    moves,
    rows_on,
    write_disk,
)
from tests.test_store_node import LAYOUT, NB, _wait, code_of, put_blocks, rand_blocks, read, reserve
from transfer import BlockWrite, UcxTransport, checksum


class _Node:
    """An in-process `StoreNode` with a disk tier, reached over its real gRPC and UCX servers."""

    def __init__(self, path: Path, **settings: object) -> None:
        self.node = StoreNode(
            StoreSettings(
                segment_size="8MiB",
                layout=LAYOUT,
                node_id="n",
                disk_path=str(path),
                disk_size="4MiB",
                metrics=False,
                **settings,
            )  # fmt: skip
        )
        self.node.start()
        self.data_address = self.node.data_address
        self._channel = channel(self.node.grpc_address)
        self.stub = pb_grpc.StoreStub(self._channel)

    def close(self) -> None:
        self._channel.close()
        self.node.stop()


def _fresh(case: str, *args: object) -> None:
    """Each case runs in a fresh interpreter (tests/fresh_process.py): an in-process UCX server beside a
    client in a pytest process that hosted other modules' UCX work can miss a handshake."""
    in_fresh_process("tests.test_store_disk_inproc", case, *args)


def _with_node(
    case: Callable[[_Node, UcxTransport], None], transport: UcxTransport, path: str, **kw: object
) -> None:
    for key in ("KVPOOL_CLUSTER_SECRET", "KVPOOL_CLUSTER_SECRET_FILE"):
        os.environ.pop(key, None)
    n = _Node(Path(path), **kw)
    try:
        case(n, transport)
    finally:
        n.close()


def test_a_demotion_whose_source_is_freed_meanwhile_is_discarded(tmp_path: Path) -> None:
    _fresh("_case_source_freed", str(tmp_path))


def _case_source_freed(transport: UcxTransport, path: str) -> None:
    _with_node(_source_freed, transport, path)


def _source_freed(node: _Node, transport: UcxTransport) -> None:
    g = disk_info(node.stub).first_generation
    put_blocks(node, transport, [7], rand_blocks(1, seed=7))  # type: ignore[arg-type]
    tier = node.node.disk
    assert tier is not None
    answer: list[pb.TierMoveResult] = []
    with tier._mutex:  # the disk is busy: the move waits in its write with the source pinned
        mover = threading.Thread(target=lambda: answer.extend(moves(node.stub, True, [(7, 1, F + 3, g)])))
        mover.start()
        deadline = time.monotonic() + 10
        while not node.node.table.num_inflight and time.monotonic() < deadline:
            time.sleep(0.005)
        freed = node.stub.FreeSlots(pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=7, generation=1)]), timeout=10)
        assert freed.slots[0].deferred  # the free waits for the move's pin
    mover.join(30)
    assert [(r.status, r.dst.generation) for r in answer] == [(STALE, g + 1)], answer
    assert "source was freed" in answer[0].error
    assert rows_on(inventory(node.stub), 1)[0] == []  # the copy is gone
    assert (7, 2) in node.node.table.drain_freed() and not tier.is_committed(F + 3)
    reserve(node, [F + 3], g + 1)  # type: ignore[arg-type] - the destination is free again


def test_the_move_queue_refuses_an_order_on_backlog(tmp_path: Path) -> None:
    _fresh("_case_backlog", str(tmp_path))


def _case_backlog(transport: UcxTransport, path: str) -> None:
    _with_node(_backlog, transport, path, disk_move_queue_blocks=4)


def _backlog(n: _Node, transport: UcxTransport) -> None:
    g = disk_info(n.stub).first_generation
    put_blocks(n, transport, [0, 1, 2, 3, 4], rand_blocks(5, seed=9))  # type: ignore[arg-type]
    assert n.node.disk is not None
    with n.node.disk._mutex:
        first = threading.Thread(target=lambda: moves(n.stub, True, [(i, 1, F + i, g) for i in range(4)]))
        first.start()
        deadline = time.monotonic() + 10
        while n.node.moves is not None and not n.node.moves.queued_blocks and time.monotonic() < deadline:
            time.sleep(0.005)
        with pytest.raises(grpc.RpcError) as exc:
            moves(n.stub, True, [(4, 1, F + 4, g)])
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in (exc.value.details() or "")
    first.join(30)
    assert n.node.moves is not None and n.node.moves.counters.refused_orders == 1


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_disk_fault_during_a_demotion_degrades_the_tier_not_memory_reads(tmp_path: Path, err: int) -> None:
    """ENOSPC and EIO injected (a real one cannot be caused here; a real full disk: tests/test_store_disk_faults.py)."""
    _fresh("_case_disk_fault", str(tmp_path), err)


def _case_disk_fault(transport: UcxTransport, path: str, err: int) -> None:
    _with_node(lambda n, t: _disk_fault(n, t, err), transport, path)


def _disk_fault(node: _Node, transport: UcxTransport, err: int) -> None:
    g = disk_info(node.stub).first_generation
    data = rand_blocks(3, seed=8)
    put_blocks(node, transport, [0, 1, 2], data)  # type: ignore[arg-type]
    assert [r.status for r in moves(node.stub, True, [(0, 1, F, g)])] == [OK]
    tier = node.node.disk
    assert tier is not None
    reserve(node, [F + 9], g)  # type: ignore[arg-type] - written before the fault, committed after it
    [w] = transport.write_blocks(
        node.data_address, [BlockWrite(F + 9, g, data[1], checksum(data[1]))], timeout_s=30
    )
    assert w.ok, w
    real = disk_io.os.pwritev

    def failing(fd: int, bufs: list[memoryview], offset: int) -> int:  # the disk fails from now on
        if fd == tier._data.fd:
            raise OSError(err, os.strerror(err))
        return real(fd, bufs, offset)

    disk_io.os.pwritev = failing  # type: ignore[assignment] - a fresh interpreter: never restored
    got = moves(node.stub, True, [(1, 1, F + 1, g), (2, 1, F + 2, g)])
    assert [r.status for r in got] == [FAILED, FAILED], got
    assert errno.errorcode[err] in got[0].error and [r.dst.generation for r in got] == [g, g]
    info = disk_info(node.stub)
    assert errno.errorcode[err] in info.degraded
    res, out = read(transport, node, [0, 1, 2], 1)  # type: ignore[arg-type] - memory reads unharmed
    assert all(r.ok for r in res) and np.array_equal(out, data)
    res, out = read(transport, node, [F], g)  # type: ignore[arg-type] - good disk blocks still read
    assert res[0].ok and np.array_equal(out[0], data[0])
    assert code_of(lambda: reserve(node, [F + 5], g)) == grpc.StatusCode.UNAVAILABLE  # type: ignore[arg-type]
    [c] = node.stub.CommitSlots(
        pb.CommitSlotsRequest(slots=[pb.SlotRef(slot=F + 9, generation=g)]), timeout=10
    ).results
    assert not c.ok and c.error.startswith("Unavailable: disk tier degraded"), c
    assert rows_on(inventory(node.stub), 1)[0] == [F]  # a failed block is never listed
    freed = node.stub.FreeSlots(pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=F + 9, generation=g)]), timeout=10)
    assert [(x.new_generation, x.deferred) for x in freed.slots] == [(g, False)]  # free at its generation


def test_a_free_waits_for_a_disk_read_in_flight_and_old_leaders_are_fenced(tmp_path: Path) -> None:
    _fresh("_case_free_waits", str(tmp_path))


def _case_free_waits(transport: UcxTransport, path: str) -> None:
    _with_node(_free_waits, transport, path)


def _free_waits(node: _Node, transport: UcxTransport) -> None:
    g = disk_info(node.stub).first_generation
    data = rand_blocks(2, seed=10)
    write_disk(node, transport, [F, F + 1], g, data)
    table = node.node.table
    [(view, stored)] = table.begin_reads([(F, g, NB, b"", 0)])  # type: ignore[misc] - a read in flight
    assert bytes(view) == data[0].tobytes() and stored == checksum(data[0])
    freed = node.stub.FreeSlots(pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=F, generation=g)]), timeout=10)
    assert [(x.new_generation, x.deferred) for x in freed.slots] == [(g + 1, True)]
    res, _ = read(transport, node, [F], g)  # type: ignore[arg-type] - no new reader once the free is ordered
    assert not res[0].ok
    assert not any(s == F for s, _ in table.drain_freed())  # still pinned: not freed yet
    table.end_reads([F])
    _wait(lambda: (F, g + 1) in table.drain_freed())  # freed once the read ended, reported
    assert rows_on(inventory(node.stub), 1)[0] == [F + 1]
    # a leader epoch older than one already taken is fenced for tier moves as for every order
    node.stub.FreeSlots(pb.FreeSlotsRequest(leader_epoch=5), timeout=10)
    req = pb.TierMoveRequest(
        moves=[pb.TierMove(src=pb.SlotRef(slot=F + 1, generation=g), dst=pb.SlotRef(slot=9, generation=1))],
        leader_epoch=4,
    )
    with pytest.raises(grpc.RpcError) as exc:
        node.stub.PromoteBlocks(req, timeout=10)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fenced" in (exc.value.details() or "")


def test_disk_reads_and_writes_need_their_capability(tmp_path: Path) -> None:
    _fresh("_case_capabilities", str(tmp_path))


def _case_capabilities(ucx: UcxTransport, path: str) -> None:
    from kvpool.capability import READ, WRITE, Capabilities, CapabilityKey
    from kvpool.store import Segment, SlotTable
    from kvpool.store.disk_tier import DiskTier
    from kvpool.store.slots import Reservation
    from kvpool.types import FakeClock
    from transfer import BlockRead, BlockWrite, UcxBlockServer

    now, node_id, ns, h = 1_700_000_000_000, "store-a", b"n" * 16, (7).to_bytes(16, "big")
    caps = Capabilities(CapabilityKey(b"s" * 32), clock=FakeClock(now), skew_ms=1000)
    tier = DiskTier.open(Path(path), 64 * NB, NB, first_slot=F)
    table = SlotTable(Segment(16 * NB, NB, pin_memory="off"), capabilities=caps, node_id=node_id, disk=tier)
    server = UcxBlockServer(table, "127.0.0.1", 0, send_timeout_s=5.0)
    server.start()
    try:
        g, exp = tier.first_generation, now + 10_000
        table.reserve([Reservation(F, g, ns, h)], 60_000)
        data = rand_blocks(1, seed=11)[0]
        [res] = ucx.write_blocks(server.address, [BlockWrite(F, g, data, checksum(data))], timeout_s=5)
        assert not res.ok and "PermissionDenied: capability" in res.error
        wcap = caps.sign(WRITE, ns, h, node_id, F, g, exp)
        [res] = ucx.write_blocks(
            server.address, [BlockWrite(F, g, data, checksum(data), wcap, exp)], timeout_s=5
        )
        assert res.ok, res
        assert table.commit([(F, g)]) == [(F, g, "")]
        for cap, want in (
            (b"", "missing"),
            (bytes(16), "invalid"),
            (caps.sign(READ, ns, h, node_id, F + 1, g, exp), "invalid"),
        ):
            out = np.zeros(NB, dtype=np.uint8)
            [res] = ucx.read_blocks(
                server.address, [BlockRead(F, g, NB, cap, exp)], [memoryview(out)], timeout_s=5
            )
            assert not res.ok and f"PermissionDenied: capability {want}" in res.error, res
            assert not out.any()  # not one byte moved
        out = np.zeros(NB, dtype=np.uint8)
        good = caps.sign(READ, ns, h, node_id, F, g, exp)
        [res] = ucx.read_blocks(
            server.address, [BlockRead(F, g, NB, good, exp)], [memoryview(out)], timeout_s=5
        )
        assert res.ok and np.array_equal(out, data)
    finally:
        server.stop()
        tier.close()
