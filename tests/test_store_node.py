"""Store node in real processes: gRPC control + UCX data over tcp on 127.0.0.1.

Also holds the helpers (`StoreProc`, `put_blocks`) that tests/test_transfer*.py reuse.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # the tests exercise the tcp path (set before UCX initialises)

from kvpool.client import convert as cv  # noqa: E402
from kvpool.rpc import PROTOCOL_VERSION  # noqa: E402
from kvpool.rpc.server import channel, start_server  # noqa: E402
from kvpool.types import KVLayout  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc  # noqa: E402
from tests.capabilities import require_ucx
from transfer import BlockRead, BlockWrite, UcxTransport, checksum  # noqa: E402

LAYOUT = "kv1:float32:b16:l4:h2:d32"  # 32 KiB blocks
NB = KVLayout.from_fingerprint(LAYOUT).block_nbytes
NS = b"N" * 16
MIB_LAYOUT = "kv1:float32:b64:l8:h4:d64"  # 1 MiB blocks


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


class StoreProc:
    """A `kvpool store` child process; `info` is its KVPOOL_READY line."""

    def __init__(self, *args: str, ready_timeout_s: float = 30.0) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvpool-store-", suffix=".log", delete=False)  # noqa: SIM115 - lives with the child
        env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.cli.main", "store", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        out = self.proc.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in out], daemon=True).start()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"store not ready: {self.stderr()}") from None
            if line.startswith("KVPOOL_READY "):
                self.info = json.loads(line.split(" ", 1)[1])
                break
        self.grpc_address: str = self.info["grpc_address"]
        self.data_address: str = self.info["data_address"]
        self._channel = channel(self.grpc_address)
        self.stub = pb_grpc.StoreStub(self._channel)

    def stderr(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if hasattr(self, "_channel"):
            self._channel.close()


def start_store(*extra: str, segment: str = "64MiB", layout: str = LAYOUT) -> StoreProc:
    return StoreProc("--segment-size", segment, "--layout", layout, "--node-id", "t", *extra)


def reserve(
    s: StoreProc,
    slots: Sequence[int],
    gen: int = 1,
    lease_ms: int = 30_000,
    hashes: Sequence[bytes] | None = None,
) -> None:
    hashes = hashes or [h(x) for x in slots]
    s.stub.ReserveSlots(
        pb.ReserveSlotsRequest(
            slots=[
                pb.SlotReservation(slot=x, generation=gen, namespace=NS, block_hash=hb)
                for x, hb in zip(slots, hashes, strict=True)
            ],
            write_lease_ms=lease_ms,
        ),
        timeout=10,
    )


def commit(s: StoreProc, slots: Sequence[int], gen: int = 1) -> list[pb.SlotResult]:
    resp = s.stub.CommitSlots(
        pb.CommitSlotsRequest(slots=[pb.SlotRef(slot=x, generation=gen) for x in slots]), timeout=10
    )
    return list(resp.results)


def put_blocks(
    s: StoreProc, t: UcxTransport, slots: Sequence[int], data: np.ndarray, gen: int = 1, nb: int = NB
) -> None:
    """Reserve, write over UCX and commit `data[i]` into `slots[i]`."""
    reserve(s, slots, gen)
    res = t.write_blocks(
        s.data_address,
        [BlockWrite(x, gen, data[i], checksum(data[i])) for i, x in enumerate(slots)],
        timeout_s=30,
    )
    assert all(r.ok for r in res), [r.error for r in res if not r.ok][:3]
    assert all(r.ok for r in commit(s, slots, gen))


def read(
    t: UcxTransport, s: StoreProc, slots: Sequence[int], gen: int = 1, nb: int = NB, timeout_s: float = 30
):
    out = np.zeros((len(slots), nb), dtype=np.uint8)
    res = t.read_blocks(
        s.data_address,
        [BlockRead(x, gen, nb) for x in slots],
        [memoryview(o) for o in out],
        timeout_s=timeout_s,
    )
    return res, out


def rand_blocks(n: int, nb: int = NB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, nb), dtype=np.uint8)


@pytest.fixture(scope="module")
def transport() -> Iterator[UcxTransport]:
    require_ucx()
    t = UcxTransport()
    yield t
    t.close()


@pytest.fixture(scope="module")
def store(transport: UcxTransport) -> Iterator[StoreProc]:
    s = start_store()
    try:
        yield s
    finally:
        s.kill()


def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()


# ---------------------------------------------------------------- tests


def test_round_trip_bit_exact_and_1000_block_batch(store: StoreProc, transport: UcxTransport) -> None:
    info = store.stub.GetInfo(pb.GetInfoRequest(), timeout=5)
    assert (
        info.layout_fingerprint == LAYOUT and info.block_nbytes == NB and info.num_slots == (64 << 20) // NB
    )
    assert info.node.role == "store" and info.node.data_address == store.data_address
    data = rand_blocks(1000, seed=1)
    slots = list(range(1000, 2000))
    put_blocks(store, transport, slots, data)
    res, out = read(transport, store, slots)
    assert all(r.ok for r in res), [r.error for r in res if not r.ok][:3]
    assert np.array_equal(out, data)
    assert [r.checksum for r in res[:3]] == [checksum(d) for d in data[:3]]
    link = transport.link(store.data_address)
    assert link.alpha_s > 0 and link.beta_bytes_per_s > 1e6
    deadline = time.monotonic() + 5  # a same-host reader's `mdone` (its unpin) is not waited for
    while (info := store.stub.GetInfo(pb.GetInfoRequest(), timeout=5)).num_inflight_transfers:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert info.num_used_slots == 1000 and info.num_inflight_transfers == 0


def test_writer_checksum_mismatch_refused(store: StoreProc, transport: UcxTransport) -> None:
    reserve(store, [10])
    d = rand_blocks(1, seed=2)[0]
    [r] = transport.write_blocks(store.data_address, [BlockWrite(10, 1, d, checksum(d) ^ 1)], timeout_s=10)
    assert not r.ok and "ChecksumMismatch" in r.error
    [c] = commit(store, [10])
    assert not c.ok and "not written" in c.error
    [r] = transport.write_blocks(store.data_address, [BlockWrite(10, 1, d, checksum(d))], timeout_s=10)
    assert r.ok  # the writer may retry within its lease
    assert commit(store, [10])[0].ok


def test_stale_generation_read_refused_b17(store: StoreProc, transport: UcxTransport) -> None:
    old, new = rand_blocks(2, seed=3)
    put_blocks(store, transport, [20], old[None])
    [f] = store.stub.FreeSlots(
        pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=20, generation=1)]), timeout=5
    ).slots
    assert (f.new_generation, f.deferred) == (2, False)
    [f2] = store.stub.FreeSlots(
        pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=20, generation=1)]), timeout=5
    ).slots
    assert (f2.new_generation, f2.deferred) == (2, False)  # idempotent
    put_blocks(store, transport, [20], new[None], gen=2)
    res, out = read(transport, store, [20], gen=1)
    assert not res[0].ok and "StaleGeneration" in res[0].error
    assert not np.array_equal(out[0], new)
    res, out = read(transport, store, [20], gen=2)
    assert res[0].ok and np.array_equal(out[0], new)


def test_reserve_without_commit_is_reclaimed(store: StoreProc, transport: UcxTransport) -> None:
    used = store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_used_slots
    lease_ms = 1500  # long enough for the write below on a loaded host
    reserve(store, [30, 31], lease_ms=lease_ms)
    d = rand_blocks(1, seed=4)[0]
    assert transport.write_blocks(store.data_address, [BlockWrite(30, 1, d, checksum(d))], timeout_s=10)[0].ok
    assert store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_used_slots == used + 2
    deadline = time.monotonic() + 10  # reclaimed after the lease, by the store's own sweep
    while (
        store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_used_slots != used
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_used_slots == used
    assert [c.error.split(":")[0] for c in commit(store, [30, 31])] == ["StaleGeneration"] * 2
    [r] = transport.write_blocks(store.data_address, [BlockWrite(31, 1, d, checksum(d))], timeout_s=10)
    assert not r.ok and "StaleGeneration" in r.error
    assert code_of(lambda: reserve(store, [30], gen=1)) == grpc.StatusCode.FAILED_PRECONDITION
    reserve(store, [30], gen=2)  # the master reuses it at the new generation


def test_free_during_inflight_read_is_deferred_b14_b16(store: StoreProc, transport: UcxTransport) -> None:
    from transfer.ucx import _Runtime, _tag

    data = rand_blocks(1, seed=5)
    put_blocks(store, transport, [40], data)
    rt = _Runtime.get()
    conn = rt.run(transport._conn(store.data_address, 0), 10)
    rid = 1 << 30
    # a reader asks for the block but has not taken the bytes yet: the store's send is in flight
    hdr = rt.run(conn.request({"op": "read", "id": rid, "b": [[40, 1, NB]]}), 10)
    assert hdr["r"][0][0] is True
    [f] = store.stub.FreeSlots(
        pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=40, generation=1)]), timeout=5
    ).slots
    assert f.deferred and f.new_generation == 2
    assert store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_inflight_transfers == 1
    assert (
        code_of(lambda: reserve(store, [40], gen=2)) == grpc.StatusCode.FAILED_PRECONDITION
    )  # not reused yet
    res, _ = read(transport, store, [40], gen=1)
    assert not res[0].ok  # new reads of a slot being freed are refused
    out = np.zeros(NB, dtype=np.uint8)
    rt.run(conn.ep.recv(out, tag=_tag(rid, 0)), 10)
    assert np.array_equal(out, data[0]) and checksum(out) == hdr["r"][0][1]  # intact bytes
    deadline = time.monotonic() + 5
    while store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_inflight_transfers:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    reserve(store, [40], gen=2)  # now it is free at the new generation


def test_bad_requests_get_clear_errors_and_node_stays_up(store: StoreProc, transport: UcxTransport) -> None:
    n = store.stub.GetInfo(pb.GetInfoRequest(), timeout=5).num_slots
    assert code_of(lambda: reserve(store, [n])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: reserve(store, [50], hashes=[b"short"])) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: reserve(store, [50], lease_ms=0)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: reserve(store, [50, 50])) == grpc.StatusCode.INVALID_ARGUMENT
    too_many = pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=0, generation=1)] * 8193)
    assert code_of(lambda: store.stub.FreeSlots(too_many, timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    unknown = pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=n + 5, generation=1)])
    assert code_of(lambda: store.stub.FreeSlots(unknown, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    [c] = commit(store, [n + 1])
    assert not c.ok and "out of range" in c.error
    bad_copy = pb.CopyBlocksRequest(src_data_address="nowhere", blocks=[])
    assert code_of(lambda: store.stub.CopyBlocks(bad_copy, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    # data plane: unknown slot, uncommitted slot, misaligned / oversize sizes (B23: the layout's byte length)
    put_blocks(store, transport, [51], rand_blocks(1, seed=6))
    reads = [
        BlockRead(n + 3, 1, NB),
        BlockRead(52, 1, NB),
        BlockRead(51, 1, NB // 2),
        BlockRead(51, 1, NB * 2),
    ]
    out = [memoryview(bytearray(r.nbytes)) for r in reads]
    res = transport.read_blocks(store.data_address, reads, out, timeout_s=10)
    assert [r.ok for r in res] == [False] * 4
    assert "out of range" in res[0].error and "not committed" in res[1].error
    assert "layout" in res[2].error and "layout" in res[3].error
    [w] = transport.write_blocks(
        store.data_address, [BlockWrite(53, 1, b"x" * NB, checksum(b"x" * NB))], timeout_s=10
    )
    assert not w.ok and "not reserved" in w.error
    # still serving, bytes still right
    assert store.proc.poll() is None
    res, _ = read(transport, store, [51])
    assert res[0].ok


def test_inventory_lists_committed_blocks(store: StoreProc, transport: UcxTransport) -> None:
    put_blocks(store, transport, [60], rand_blocks(1, seed=7))
    reserve(store, [61])  # reserved only: not in the inventory
    [resp] = list(store.stub.Inventory(pb.InventoryRequest(after_slot=60), timeout=10))
    b = cv.inventory_batch(resp)
    assert resp.epoch == store.info["epoch"] and b.next_slot == -1  # one message: the whole rest
    by_slot = {int(s): i for i, s in enumerate(b.slots)}
    assert 61 not in by_slot
    i = by_slot[60]
    assert b.namespaces[b.ns_index[i]] == NS and b.block_hashes[i].tobytes() == h(60)
    assert (int(b.generations[i]), int(b.size_bytes[i])) == (1, NB)
    assert int(b.checksums[i]) == checksum(rand_blocks(1, seed=7)[0])


def test_inventory_streams_batches_and_resumes_from_a_cursor(transport: UcxTransport) -> None:
    """`max_entries` bounds each message; each carries the cursor to ask again from (a broken stream
    resumes there), the last one -1; asking from a cursor lists exactly the slots at or after it. (Its own
    store: the module's store holds other tests' blocks.)"""
    store = start_store()
    try:
        put_blocks(store, transport, [5, 80, 81, 83], rand_blocks(4, seed=9))
        msgs = [
            cv.inventory_batch(r)
            for r in store.stub.Inventory(pb.InventoryRequest(after_slot=80, max_entries=2))
        ]
        assert [b.slots.tolist() for b in msgs] == [[80, 81], [83]]
        assert [b.next_slot for b in msgs] == [82, -1]
        assert [bool(x) for b in msgs for x in b.has_parent] == [False, False, False]
        [rest] = [cv.inventory_batch(r) for r in store.stub.Inventory(pb.InventoryRequest(after_slot=82))]
        assert rest.slots.tolist() == [83] and rest.block_hashes[0].tobytes() == h(83)
    finally:
        store.kill()


def test_copy_blocks_between_stores(store: StoreProc, transport: UcxTransport) -> None:
    data = rand_blocks(8, seed=8)
    put_blocks(store, transport, list(range(70, 78)), data)
    other = start_store()
    try:
        reserve(other, list(range(8)))
        req = pb.CopyBlocksRequest(
            src_data_address=store.data_address,
            blocks=[
                pb.CopyBlock(
                    src=pb.SlotRef(slot=70 + i, generation=1),
                    dst=pb.SlotRef(slot=i, generation=1),
                    checksum=checksum(data[i]),
                )
                for i in range(8)
            ]
            + [pb.CopyBlock(src=pb.SlotRef(slot=999, generation=1), dst=pb.SlotRef(slot=9, generation=1))],
        )
        results = other.stub.CopyBlocks(req, timeout=30).results
        assert [r.ok for r in results] == [True] * 8 + [False]
        assert all(r.ok for r in commit(other, list(range(8))))
        res, out = read(transport, other, list(range(8)))
        assert all(r.ok for r in res) and np.array_equal(out, data)
    finally:
        other.kill()


def test_memory_stays_within_segment_plus_overhead(transport: UcxTransport) -> None:
    layout, nb = MIB_LAYOUT, 1 << 20
    s = start_store(segment="128MiB", layout=layout)
    try:
        proc = psutil.Process(s.proc.pid)
        data = rand_blocks(32, nb=nb, seed=9)
        for start in range(0, 128, 32):
            put_blocks(s, transport, list(range(start, start + 32)), data, nb=nb)
        rss_full = proc.memory_info().rss
        for _ in range(3):
            for start in range(0, 128, 64):
                res, _ = read(transport, s, list(range(start, start + 64)), nb=nb)
                assert all(r.ok for r in res)
        rss_after = proc.memory_info().rss
        assert rss_full < (128 << 20) + (400 << 20), rss_full
        assert rss_after - rss_full < 48 << 20, (rss_full, rss_after)
    finally:
        s.kill()


def test_sigterm_stops_cleanly() -> None:
    require_ucx()
    s = start_store(segment="8MiB")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0, s.stderr()
    s.kill()


# ---------------------------------------------------------------- master link


class FakeMaster(pb_grpc.MasterServicer):
    def __init__(self, layout: str = LAYOUT, *, taken_ids: Sequence[str] = (), token: bool = False) -> None:
        self.layout = layout
        self.taken_ids = set(taken_ids)  # node ids held by a live store: refused as the master does
        self.token = token  # a master with KVPOOL_AUTH_TOKEN set, which the store does not send
        self.registrations: list[pb.RegisterNodeRequest] = []
        self.heartbeats: list[pb.HeartbeatRequest] = []
        self.forget = False

    def RegisterNode(self, request, context):  # type: ignore[no-untyped-def]
        self.registrations.append(request)
        if self.token:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        if request.node.node_id in self.taken_ids:
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"node id {request.node.node_id!r} is held by a live store"
            )
        if request.layout_fingerprint != self.layout:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"layout {request.layout_fingerprint} != {self.layout}"
            )
        return pb.RegisterNodeResponse(
            heartbeat_interval_ms=50, master_epoch=7, layout_fingerprint=self.layout
        )

    def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        self.heartbeats.append(request)
        known, self.forget = not self.forget, False
        return pb.HeartbeatResponse(known=known, master_epoch=7)


def _fake_master(m: FakeMaster):  # type: ignore[no-untyped-def]
    return start_server(
        [(pb_grpc.add_MasterServicer_to_server, m, "kvpool.v1.Master")], host="127.0.0.1", port=0
    )


def _wait(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_registers_heartbeats_and_reregisters(transport: UcxTransport) -> None:
    m = FakeMaster()
    server = _fake_master(m)
    s = start_store("--master", f"127.0.0.1:{server.port}", segment="8MiB")
    try:
        _wait(lambda: len(m.heartbeats) >= 2)
        [reg] = m.registrations
        assert reg.protocol_version == PROTOCOL_VERSION and reg.layout_fingerprint == LAYOUT
        assert reg.num_slots == (8 << 20) // NB and reg.block_nbytes == NB
        assert reg.node.role == "store" and reg.node.node_id == "t" and reg.node.epoch == s.info["epoch"]
        assert reg.node.grpc_address == s.grpc_address and reg.node.data_address == s.data_address
        reserve(s, [3], lease_ms=100)  # reclaimed on expiry: reported as freed in a heartbeat
        _wait(lambda: any((f.slot, f.generation) == (3, 2) for hb in m.heartbeats for f in hb.freed_slots))
        m.forget = True
        _wait(lambda: len(m.registrations) == 2)
    finally:
        s.kill()
        server.stop(0)


def _store_until_exit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--segment-size", "8MiB", "--layout", LAYOUT, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("refusal", "expected"),
    [
        ({"layout": "kv1:float8_e4m3fn:b16:l4:h2:d32"}, "kvpool store: FailedPrecondition"),  # b23
        ({"taken_ids": ["t"]}, "kvpool store: AlreadyExists"),
        ({"token": True}, "kvpool store: Unauthenticated"),  # it retried for good, reported ready
    ],
    ids=["layout-mismatch", "duplicate-node-id", "bad-auth-token"],
)
def test_a_store_the_master_refuses_never_reports_ready(refusal: dict[str, Any], expected: str) -> None:
    """Found by a new-user pass: the store printed KVPOOL_READY before the master answered its
    registration, so a launcher waiting for that line was told "ready" by a store that then exited 2."""
    require_ucx()
    master = FakeMaster(**refusal)
    server = _fake_master(master)
    try:
        out = _store_until_exit("--master", f"127.0.0.1:{server.port}", "--node-id", "t")
    finally:
        server.stop(0)
    assert out.returncode == 2, out.stderr
    assert "KVPOOL_READY" not in out.stdout
    errors = [line for line in out.stderr.splitlines() if " INFO " not in line]
    assert "Traceback" not in out.stderr and len(errors) == 1 and errors[0].startswith(expected), errors
    assert len(master.registrations) == 1


def test_a_store_started_before_its_master_reports_ready_and_registers_later() -> None:
    """By design (README "Running a cluster by hand") a store does not wait for an unreachable master."""
    require_ucx()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = start_store("--master", f"127.0.0.1:{port}", segment="8MiB")
    m = FakeMaster()
    server = start_server(
        [(pb_grpc.add_MasterServicer_to_server, m, "kvpool.v1.Master")], host="127.0.0.1", port=port
    )
    try:
        _wait(lambda: len(m.registrations) == 1, timeout_s=15)
        assert m.registrations[0].node.grpc_address == s.grpc_address and s.proc.poll() is None
    finally:
        s.kill()
        server.stop(0)


_ = futures  # (thread pools come with start_server)
