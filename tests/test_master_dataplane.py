"""Data-plane health feeds placement (issue 26 item 1): a store whose data plane fails while it heartbeats
gets no new blocks and its replicas are not offered, until a trial after its back-off shows it works.

The state machine on its own (`DataPlaneHealth`, an injected time), then an in-process master over real
gRPC with an injected clock; a stub answers the master's control calls to its two stores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from kvpool.cli.main import app
from kvpool.client import MasterClient, PoolClient
from kvpool.client.faults import write_fault_kind
from kvpool.client.reports import DataPlaneReporter
from kvpool.client.types import NodeLoad
from kvpool.errors import InvalidArgument, NotFound
from kvpool.hashing import hash_blocks
from kvpool.master.core import Master
from kvpool.master.dataplane import DataPlaneHealth, DataPlanePolicy
from kvpool.master.metrics import master_registry
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import DEFAULT_LAYOUT, BlockHash, FakeClock, KVLayout, Location, NamespaceId
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.test_master_bounded_state import StubStores
from transfer.base import BlockResult, BlockWrite

LAY = KVLayout.from_fingerprint(DEFAULT_LAYOUT)
FP = LAY.fingerprint()
POLICY = DataPlanePolicy()


# ---- the state machine ---------------------------------------------------------------------------
def test_failures_within_the_window_fail_a_store_and_a_quiet_window_clears_a_suspect() -> None:
    h = DataPlaneHealth()
    assert not h.record("write", "refused", 0, POLICY) and h.state == "suspect"
    assert h.usable(1, POLICY)
    assert h.refresh(POLICY.window_ms + 1, POLICY) == "ok"  # the one failure aged out
    t, c = 100_000, POLICY.coalesce_ms
    assert not h.record("read", "x", t, POLICY)
    assert not h.record("read", "x", t + c, POLICY)
    assert h.record("write", "x", t + 2 * c, POLICY) and h.state == "failed"
    assert not h.usable(t + 2 * c + 1, POLICY) and h.num_failures == 4
    assert not h.record("write", "again", t + 2 * c + 2, POLICY)  # already failed: counted, no new back-off
    assert h.until_ms == t + 2 * c + POLICY.backoff_ms


def test_checksum_failures_count_like_others_and_a_failure_on_trial_doubles_the_backoff() -> None:
    h = DataPlaneHealth()
    assert not h.record("checksum", "mismatch", 0, POLICY) and h.state == "suspect"  # one bad slot: one block
    assert not h.record("checksum", "mismatch", 10, POLICY)  # the same pull's next bad block: one event
    assert not h.record("checksum", "mismatch", POLICY.coalesce_ms, POLICY)
    assert h.record("checksum", "mismatch", 2 * POLICY.coalesce_ms, POLICY)  # it keeps returning bad bytes
    t0 = 2 * POLICY.coalesce_ms
    assert not h.usable(t0 + POLICY.backoff_ms - 1, POLICY)
    t = t0 + POLICY.backoff_ms
    assert not h.usable(t, POLICY) and h.state == "probe"  # back-off over: due a probe, still out
    assert not h.record("write", "late report", t, POLICY) and h.state == "probe"
    h.probe_done(True, "copied", t, POLICY)
    assert h.usable(t, POLICY) and h.state == "trial"  # passed: on trial, real transfers check it too
    assert h.record("write", "refused", t + 1, POLICY)  # one failure on trial fails it again
    assert h.backoff_ms == 2 * POLICY.backoff_ms and not h.usable(t + 1 + 2 * POLICY.backoff_ms - 1, POLICY)
    t = t + 1 + 2 * POLICY.backoff_ms
    assert h.refresh(t, POLICY) == "probe"
    h.probe_done(False, "ChecksumMismatch: slot 3", t, POLICY)  # a failed probe: failed again, longer
    assert h.state == "failed" and h.backoff_ms == 4 * POLICY.backoff_ms and h.num_probes_failed == 1
    assert h.last_error.startswith("probe: ChecksumMismatch")
    t += 4 * POLICY.backoff_ms
    assert h.refresh(t, POLICY) == "probe"
    h.probe_done(True, "copied", t, POLICY)
    h.probe_done(False, "a late duplicate", t, POLICY)  # not in probe any more: dropped
    assert h.refresh(t + POLICY.trial_ms, POLICY) == "ok" and h.backoff_ms == 0  # a clean trial
    assert (h.num_probes, h.num_probes_failed) == (3, 1)
    t = 10**9
    for i in range(POLICY.fail_after):
        h.record("checksum", "x", t + i * POLICY.coalesce_ms, POLICY)
    t += (POLICY.fail_after - 1) * POLICY.coalesce_ms
    for _ in range(20):  # failing on every trial: the back-off doubles up to its cap
        t += h.backoff_ms
        assert h.refresh(t, POLICY) == "probe"
        h.probe_done(True, "copied", t, POLICY)
        assert h.record("checksum", "x", t, POLICY)
    assert h.backoff_ms == POLICY.max_backoff_ms


# ---- an in-process master over gRPC ----------------------------------------------------------------
@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000)


class ProbedStores(StubStores):
    """`StubStores` that records the copies the master orders (its data-plane probes) and fails them
    with `copy_error` while it is set."""

    def __init__(self) -> None:
        self.copies: list[tuple[str, list[tuple[Location, Location, int]]]] = []
        self.copy_error = ""

    def copy(self, address: str, src_data_address: str, blocks: object) -> dict[tuple[int, int], str]:
        got = list(blocks)  # type: ignore[call-overload]
        self.copies.append((src_data_address, got))
        return {(d.slot, d.generation): self.copy_error for _, d, _ in got}


@pytest.fixture
def server(clock: FakeClock) -> Iterator[MasterServer]:
    # the stub stores never heartbeat while the clock runs minutes ahead: silence (not offered to readers
    # past stale_after_ms, tests/test_master_unreachable.py) is not what these tests are about
    settings = MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, stale_after_ms=10**9)
    s = serve(settings, clock=clock)
    s.master.stores = ProbedStores()  # type: ignore[assignment]
    for node_id in ("s1", "s2"):
        s.master.register_node(
            node_id=node_id,
            role="store",
            grpc_address="127.0.0.1:1",
            data_address=f"127.0.0.1:{node_id[1]}",
            epoch=7,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=FP,
            num_slots=64,
            block_nbytes=LAY.block_nbytes,
        )
    try:
        _wait_ready(s.master)
        yield s
    finally:
        s.stop()


def _wait_ready(m: Master) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m.wake.set()
        with m.lock:
            if all(n.ready for n in m.st.nodes.values()):
                return
        time.sleep(0.02)
    raise AssertionError("stores not adopted")


def _beat(m: Master) -> None:
    for node_id in ("s1", "s2"):
        assert m.heartbeat(node_id, 7, [], 0, NodeLoad())


def _placed_on(c: MasterClient, ns: bytes, seed: int, replicas: int = 1) -> set[str]:
    """The stores a new block is placed on (placement prefers the one with the most free slots)."""
    hashes = hash_blocks(ns, [seed] * LAY.block_size, LAY.block_size)
    res = c.reserve(ns, None, hashes, num_replicas=replicas, block_nbytes=LAY.block_nbytes)
    return {loc.node_id for b in res.blocks for loc in b.locations}  # left open: its slots stay taken


def _index(m: Master, ns: bytes, hashes: list[BlockHash], nodes: list[list[str]]) -> None:
    """Committed blocks `hashes` (a chain) with replicas on `nodes` (slot 10 + i, generation 1)."""
    locations = [[Location(n, 10 + i, 1) for n in ns_] for i, ns_ in enumerate(nodes)]
    with m.lock:
        m.index.insert(NamespaceId(ns), hashes, parent=None, locations=locations, size_bytes=LAY.block_nbytes)
        m.index.set_block_meta(NamespaceId(ns), hashes, [0xC0FFEE] * len(hashes), 1)


def _state_becomes(c: MasterClient, m: Master, node_id: str, want: str) -> None:
    """Wait (≤ 5 s) for the maintenance thread to bring `node_id`'s data plane to `want`."""
    deadline = time.monotonic() + 5
    while (got := {n.node.node_id: n.dataplane_state for n in c.list_nodes()}[node_id]) != want:
        assert time.monotonic() < deadline, f"{node_id}: {got}, not {want}"
        m.wake.set()
        time.sleep(0.02)


def test_reports_are_validated(server: MasterServer) -> None:
    with MasterClient(server.address) as c:
        with pytest.raises(InvalidArgument, match="kind"):
            c.report_dataplane_failure("s1", 7, "bogus", "")
        with pytest.raises(NotFound):
            c.report_dataplane_failure("nobody", 0, "write", "")
        c.register_namespace("m", "v1", FP)
        for _ in range(5):
            c.report_dataplane_failure("s1", 6, "write", "an earlier process")  # another epoch: ignored
    ch = grpc.insecure_channel(server.address)
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.MasterStub(ch).ReportDataPlaneFailure(pb.ReportDataPlaneFailureRequest(node_id="s1", kind=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ch.close()
    with server.master.lock:
        assert server.master.st.nodes["s1"].dataplane.state == "ok"


def test_a_failed_data_plane_is_not_placed_on_nor_offered_until_a_trial(
    server: MasterServer, clock: FakeClock
) -> None:
    m = server.master
    with MasterClient(server.address) as c:
        ns, _ = c.register_namespace("m", "v1", FP)
        assert set().union(*(_placed_on(c, ns, seed) for seed in range(8))) == {"s1", "s2"}
        both, only_s2, after = hash_blocks(ns, list(range(3 * LAY.block_size)), LAY.block_size)
        _index(m, ns, [both, only_s2, after], [["s2", "s1"], ["s2"], ["s1"]])
        assert c.match(ns, [both, only_s2, after]).num_matched == 3

        for i in range(3):  # writes refused by s2: three reports in the window fail it
            clock.advance(m.dataplane_policy.coalesce_ms)  # three events, not one burst
            c.report_dataplane_failure("s2", 7, "write", f"write refused {i}")
        state = {n.node.node_id: n.dataplane_state for n in c.list_nodes()}
        assert state == {"s1": "ok", "s2": "failed"}
        shown = CliRunner().invoke(app, ["admin", "--master", server.address, "nodes", "--json"])
        assert shown.exit_code == 0, shown.output
        rows = {r["node"]["node_id"]: r for r in json.loads(shown.output)}
        assert (rows["s2"]["dataplane_state"], rows["s2"]["num_dataplane_failures"]) == ("failed", 3)
        table = CliRunner().invoke(app, ["admin", "--master", server.address, "nodes"], terminal_width=250)
        assert "failed (3)" in table.output and "ok (0)" in table.output
        assert all(_placed_on(c, ns, 100 + seed) == {"s1"} for seed in range(8))
        assert _placed_on(c, ns, 200, replicas=2) == {"s1"}  # fewer replicas rather than a bad one
        got = c.match(ns, [both, only_s2, after])
        assert got.num_matched == 1 and [x.node_id for x in got.replicas[0]] == ["s1"]  # ends at only_s2
        text = _metrics(m)
        assert 'kvpool_master_store_dataplane_failed{node="s2"} 1.0' in text
        assert 'kvpool_master_store_dataplane_failures_total{node="s2"} 3.0' in text

        stores: ProbedStores = m.stores  # type: ignore[assignment]
        stores.copy_error = "ChecksumMismatch: slot 3: bytes hash to 0x1, writer said 0x2"
        clock.advance(m.dataplane_policy.backoff_ms)  # back-off over: the master probes it
        _beat(m)
        deadline = time.monotonic() + 5
        while m.st.nodes["s2"].dataplane.num_probes_failed < 1:
            assert time.monotonic() < deadline, "no probe"
            m.wake.set()
            time.sleep(0.02)
        src_address, [(src, dst, checksum)] = stores.copies[0]
        assert (src_address, src.node_id, dst.node_id) == ("127.0.0.1:2", "s2", "s2")  # its own replica
        assert checksum == 0xC0FFEE and src.capability == b"" and dst.slot not in (10, 11)
        _state_becomes(c, m, "s2", "failed")  # the probe failed: out again, for twice as long
        assert m.st.nodes["s2"].dataplane.backoff_ms == 2 * m.dataplane_policy.backoff_ms
        assert c.match(ns, [both, only_s2, after]).num_matched == 1
        assert 'kvpool_master_store_dataplane_probes_total{node="s2",result="failed"} 1.0' in _metrics(m)
        with m.lock:  # the spare slot was given back (never indexed)
            assert (
                m.st.nodes["s2"].free.is_free(dst.slot)
                or m.st.nodes["s2"].free.is_pending(dst.slot)
                or any(s == dst.slot for s, _ in m.st.free_q.get("s2", []))
            )

        stores.copy_error = ""
        clock.advance(2 * m.dataplane_policy.backoff_ms)
        _beat(m)
        _state_becomes(c, m, "s2", "trial")  # the next probe passed
        assert len(stores.copies) == 2
        assert c.match(ns, [both, only_s2, after]).num_matched == 3  # offered again: the next reads probe
        assert "s2" in set().union(*(_placed_on(c, ns, 300 + seed) for seed in range(8)))
        clock.advance(m.dataplane_policy.trial_ms)
        _beat(m)
        assert {n.node.node_id: n.dataplane_state for n in c.list_nodes()}["s2"] == "ok"


def test_checksum_failures_reported_by_readers_fail_the_store(server: MasterServer, clock: FakeClock) -> None:
    m = server.master
    with MasterClient(server.address) as c:
        ns, _ = c.register_namespace("m", "v1", FP)
        a, b = hash_blocks(ns, list(range(2 * LAY.block_size)), LAY.block_size)
        _index(m, ns, [a, b], [["s1", "s2"], ["s2", "s1"]])
        c.report_bad_replica(ns, a, Location("s2", 10, 1), "checksum mismatch")
        assert {n.node.node_id: n.dataplane_state for n in c.list_nodes()}["s2"] == "suspect"  # one bad slot
        got = c.match(ns, [a, b])  # its other blocks are still offered
        assert sorted(x.node_id for x in got.replicas[1]) == ["s1", "s2"], got
        c.report_bad_replica(ns, a, Location("s2", 13, 1), "checksum mismatch")  # the same burst: one event
        assert {n.node.node_id: n.dataplane_state for n in c.list_nodes()}["s2"] == "suspect"
        for slot in (11, 12):  # a store that keeps returning bad bytes
            clock.advance(m.dataplane_policy.coalesce_ms)
            c.report_bad_replica(ns, a, Location("s2", slot, 1), "checksum mismatch")
        assert {n.node.node_id: n.dataplane_state for n in c.list_nodes()}["s2"] == "failed"
        got = c.match(ns, [a, b])  # b's replica on s2 was not reported, yet it is not offered
        assert got.num_matched == 2 and all([x.node_id for x in r] == ["s1"] for r in got.replicas)
        c.report_bad_replica(ns, a, Location("s1", 11, 1), "StaleGeneration")  # not a data-plane fault
        assert {n.node.node_id: n.dataplane_state for n in c.list_nodes()}["s1"] == "ok"
        clock.advance(m.dataplane_policy.backoff_ms)
        _beat(m)
        _state_becomes(c, m, "s2", "trial")  # its probe (copying its own replica of b) passed
        c.report_dataplane_failure("s2", 0, "read", "transfer failed")  # on trial: failed again, longer
        with m.lock:
            assert m.st.nodes["s2"].dataplane.backoff_ms == 2 * m.dataplane_policy.backoff_ms


def _metrics(m: Master) -> str:
    return generate_latest(master_registry(m)).decode()


# ---- writers report -------------------------------------------------------------------------------
def test_write_errors_that_are_the_stores_are_told_from_the_writers_own() -> None:
    assert write_fault_kind("UCX error: Endpoint timeout") == "write"
    assert write_fault_kind("FailedPrecondition: slot 3 is not reserved") == "write"
    assert write_fault_kind("ChecksumMismatch: slot 3: bytes hash to 0x1, writer said 0x2") == "checksum"
    late = [
        "LeaseExpired: the write lease of slot 3 expired",
        "StaleGeneration: slot 3 is at generation 2, not 1",
        "PermissionDenied: capability expired",
        "peer x unreachable, backing off 1.0 s after: y",
    ]
    assert [write_fault_kind(e) for e in late] == [None] * 4


class RefusingTransport:
    """Accepts every write but those to `refuse` (a store whose data plane fails: its UCX errors)."""

    def __init__(self, refuse: str) -> None:
        self.refuse = refuse

    def write_blocks(self, peer: str, writes: list[BlockWrite], *, timeout_s: float) -> list[BlockResult]:
        if peer == self.refuse:
            return [BlockResult(False, error="UCX error: Connection reset by remote peer")] * len(writes)
        return [BlockResult(True, w.checksum) for w in writes]


def _failures(master: MasterClient, node_id: str) -> int:
    return {n.node.node_id: n.num_dataplane_failures for n in master.list_nodes()}[node_id]


def test_a_writer_reports_refused_writes_and_the_master_stops_placing_there(
    server: MasterServer, clock: FakeClock
) -> None:
    tr = RefusingTransport(refuse="127.0.0.1:2")  # s2's data address
    with PoolClient(server.address, tr, block_nbytes=LAY.block_nbytes) as pool:  # type: ignore[arg-type]
        pool.reports = DataPlaneReporter(pool.master.report_dataplane_failure, min_interval_s=0)
        ns, _ = pool.master.register_namespace("m", "v1", FP)
        for seed in range(3):  # each writes both replicas; s2's write fails and is reported (off-path)
            h = hash_blocks(ns, [seed] * LAY.block_size, LAY.block_size)
            put = pool.put_blocks(ns, None, h, [np.zeros(LAY.block_nbytes, np.uint8)], num_replicas=2)
            assert put.num_committed == 1  # the replica on s1 landed
            deadline = time.monotonic() + 10
            while _failures(pool.master, "s2") < seed + 1:  # its report arrived (off-path)
                assert time.monotonic() < deadline, "the refused write was not reported"
                time.sleep(0.02)
            clock.advance(server.master.dataplane_policy.coalesce_ms)  # the next one is another event
        deadline = time.monotonic() + 10
        while {n.node.node_id: n.dataplane_state for n in pool.master.list_nodes()}["s2"] != "failed":
            assert time.monotonic() < deadline, "s2 never failed"
            time.sleep(0.05)
        h = hash_blocks(ns, [99] * LAY.block_size, LAY.block_size)
        put = pool.put_blocks(ns, None, h, [np.zeros(LAY.block_nbytes, np.uint8)], num_replicas=2)
        assert put.num_committed == 1 and put.num_replicas_placed == 1  # only s1 was asked
