"""Same-host reads through a store's shared segment (transfer/shared_segment.py, transfer/ucx_mapped.py):
bytes, pins, late readers, abandoned reads, refused mappings; and a real store process."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.fresh_process import in_fresh_process
from tests.test_mread_wire import encode_rows
from tests.test_store_node import NS, h, put_blocks, rand_blocks, read, require_ucx, start_store
from transfer import BlockRead, UcxBlockServer, UcxTransport, checksum
from transfer.mread_wire import MREAD_VERSION, decode_reply
from transfer.shared_segment import SegmentDescriptor, SegmentMapping, SharedSegment

NB = 64 * 1024


@pytest.fixture(scope="module")
def transport() -> Iterator[UcxTransport]:
    require_ucx()
    t = UcxTransport(blocks_per_message=16)
    yield t
    t.close()


class _Store:
    """An in-process store: a SlotTable on a shared segment behind a UcxBlockServer."""

    def __init__(
        self, num_slots: int, *, pin_timeout_s: float | None = None, optimistic: bool = False
    ) -> None:
        """`optimistic`: the server advertises the slot state too (readers copy without asking first)."""
        from kvpool.store import Segment, SlotTable

        self.table = SlotTable(Segment(num_slots * NB, NB, pin_memory="off", share=True))
        assert self.table.segment.shared is not None
        self.server = UcxBlockServer(
            self.table,
            shared=self.table.segment.shared,
            slot_state=self.table.shared_state if optimistic else None,
            pin_timeout_s=pin_timeout_s,
        )
        self.peer = f"127.0.0.1:{self.server.start()}"

    def commit(self, data: np.ndarray) -> None:
        from kvpool.store.slots import Reservation

        n = len(data)
        self.table.reserve([Reservation(i, 1, NS, h(i)) for i in range(n)], 60_000)
        for i in range(n):
            self.table.begin_write(i, 1, NB)[:] = data[i]
            self.table.end_write(i, 1, checksum(data[i]), True)
        assert all(e == "" for *_, e in self.table.commit([(i, 1) for i in range(n)]))

    def read(self, t: UcxTransport, n: int, timeout_s: float = 10.0) -> tuple[list[Any], np.ndarray]:
        out = np.zeros((n, NB), dtype=np.uint8)
        res = t.read_blocks(
            self.peer,
            [BlockRead(i, 1, NB) for i in range(n)],
            [memoryview(o) for o in out],
            timeout_s=timeout_s,
        )
        return res, out


def _in_fresh_process(name: str) -> None:
    """Run an in-process-server case in a new interpreter (tests/fresh_process.py says why)."""
    in_fresh_process("tests.test_shared_segment", name, transport_kwargs="blocks_per_message=16")


def _wait_unpinned(table: Any, timeout_s: float = 5.0) -> None:
    """`mdone` is sent without waiting for it: the store unpins just after the read returns."""
    deadline = time.monotonic() + timeout_s
    while table.num_inflight and time.monotonic() < deadline:
        time.sleep(0.005)
    assert table.num_inflight == 0


def _slow_copies(
    t: UcxTransport, peer: str, delay_s: float, calls: list[int], num_slow: int = 1 << 30
) -> SegmentMapping:
    """Make the first `num_slow` copies from `peer`'s mapping wait `delay_s` first (a reader descheduled
    mid-read). Calls run on the hashing threads (batches over 256 KiB) or the UCX loop thread."""
    mapping = t._peers[peer].mapping
    assert mapping is not None
    real = mapping.copy_verify

    def slow(parts: Any, stop: Any = None) -> Any:
        calls.append(len(parts))
        if len(calls) <= num_slow:
            time.sleep(delay_s)
        return real(parts, stop)

    mapping.copy_verify = slow  # type: ignore[method-assign]
    return mapping


def _case_same_host_reads_copy_from_the_mapping_and_verify_every_block(transport: UcxTransport) -> None:
    s = _Store(64)
    try:
        data = rand_blocks(64, nb=NB, seed=21)
        s.commit(data)
        res, out = s.read(transport, 64)
        assert all(r.ok for r in res) and np.array_equal(out, data)
        calls: list[int] = []
        _slow_copies(transport, s.peer, 0.0, calls)
        res, out = s.read(transport, 64)
        assert all(r.ok for r in res) and np.array_equal(out, data) and sum(calls) == 64  # mapped, not UCX
        assert [r.checksum for r in res[:2]] == [checksum(d) for d in data[:2]]
        s.table.segment.array[5 * NB + 17] ^= 0x01  # a bit flip in the store's memory
        res, _ = s.read(transport, 64)
        assert [i for i, r in enumerate(res) if not r.ok] == [5] and "checksum mismatch" in res[5].error
        _wait_unpinned(s.table)  # every pin was released by `mdone`
    finally:
        s.server.stop()


def _watch_pins(transport: UcxTransport, s: _Store) -> list[int]:
    """The store's pinned-slot count at the start of every copy from its mapping (filled as reads run)."""
    seen: list[int] = []
    mapping = _slow_copies(transport, s.peer, 0.0, [])
    real = mapping.copy_verify

    def watching(parts: Any, stop: Any = None) -> Any:
        seen.append(s.table.num_inflight)
        return real(parts, stop)

    mapping.copy_verify = watching  # type: ignore[method-assign]
    return seen


def _case_optimistic_reads_copy_without_pins_and_verify_every_block(transport: UcxTransport) -> None:
    """With the slot state mapped, a read asks nothing: no slot is pinned while it copies; a bit flip is
    still caught (the block then takes the pinned path, which reports the mismatch)."""
    s = _Store(64, optimistic=True)
    try:
        data = rand_blocks(64, nb=NB, seed=29)
        s.commit(data)
        res, out = s.read(transport, 64)  # connect and map (this first read asks the store: `mread`)
        assert all(r.ok for r in res) and np.array_equal(out, data)
        assert transport._peers[s.peer].state is not None
        _wait_unpinned(s.table)
        pinned = _watch_pins(transport, s)
        res, out = s.read(transport, 64)
        assert all(r.ok for r in res) and np.array_equal(out, data)
        assert pinned and max(pinned) == 0  # copied without a pin: no `mread`
        assert [r.checksum for r in res[:2]] == [checksum(d) for d in data[:2]]
        s.table.segment.array[5 * NB + 17] ^= 0x01  # a bit flip in the store's memory
        res, _ = s.read(transport, 64)
        assert [i for i, r in enumerate(res) if not r.ok] == [5] and "checksum mismatch" in res[5].error
        s.table.segment.array[5 * NB + 17] ^= 0x01
        _wait_unpinned(s.table)
        # blocks the slot state does not vouch for are asked of the store, which says why they fail
        bad = [BlockRead(0, 1, NB), BlockRead(999, 1, NB), BlockRead(1, 7, NB), BlockRead(2, 1, NB - 1)]
        res = transport.read_blocks(
            s.peer, bad, [memoryview(o) for o in out[:3]] + [memoryview(out[3])[:-1]], timeout_s=10.0
        )
        assert res[0].ok and [r.error.split(":")[0] for r in res[1:]] == [
            "InvalidArgument",
            "StaleGeneration",
            "InvalidArgument",
        ], res
        # reads that carry capabilities always ask the store (it checks them on `mread`)
        pinned.clear()
        caps = [BlockRead(i, 1, NB, capability=b"c" * 16, expiry_ms=1) for i in range(8)]
        res = transport.read_blocks(s.peer, caps, [memoryview(o) for o in out[:8]], timeout_s=10.0)
        assert all(r.ok for r in res) and pinned and min(pinned) == 8, (pinned, [r.error for r in res])
        _wait_unpinned(s.table)
    finally:
        s.server.stop()


def _case_a_block_freed_during_an_optimistic_copy_is_never_returned(transport: UcxTransport) -> None:
    """Field case B17 without pins: slot 0 is evicted (freed) right after its bytes were copied, intact,
    and slot 1 is freed and written again with other bytes before they are copied; neither read may
    succeed (the second look at the generation, and the checksum, catch them), the others do."""
    from kvpool.store.slots import Reservation

    s = _Store(8, optimistic=True)
    try:
        data = rand_blocks(8, nb=NB, seed=30)
        s.commit(data)
        s.read(transport, 8)  # connect and map
        _wait_unpinned(s.table)
        mapping = _slow_copies(transport, s.peer, 0.0, [])
        real = mapping.copy_verify
        calls: list[int] = []

        def racing(parts: Any, stop: Any = None) -> Any:
            calls.append(len(parts))
            first = len(calls) == 1  # the first of the read's copy jobs (they may run concurrently)
            if first:
                s.table.free([(1, 1)])
                s.table.reserve([Reservation(1, 2, NS, h(101))], 60_000)
                s.table.begin_write(1, 2, NB)[:] = data[7]
                s.table.end_write(1, 2, checksum(data[7]), True)
                assert s.table.commit([(1, 2)])[0][2] == ""
            out = real(parts, stop)
            if first:
                assert s.table.free([(0, 1)])[0].new_generation == 2  # released at once: nothing pinned
            return out

        mapping.copy_verify = racing  # type: ignore[method-assign]
        res, out = s.read(transport, 8)
        assert [r.ok for r in res] == [False, False] + [True] * 6, [r.error for r in res]
        assert all("generation" in r.error for r in res[:2]), [r.error for r in res[:2]]
        assert np.array_equal(out[2:], data[2:])
        _wait_unpinned(s.table)
    finally:
        s.server.stop()


def _case_slots_stay_pinned_while_the_reader_copies(transport: UcxTransport) -> None:
    """A free order for a slot being copied waits for the reader's `mdone` (DESIGN: deferred frees)."""
    s = _Store(8)
    try:
        data = rand_blocks(8, nb=NB, seed=22)
        s.commit(data)
        s.read(transport, 8)  # connect and map
        _wait_unpinned(s.table)
        seen = _watch_pins(transport, s)
        res, out = s.read(transport, 8)
        assert all(r.ok for r in res) and np.array_equal(out, data)
        assert seen and min(seen) == 8  # all eight pinned during the copy
        _wait_unpinned(s.table)
    finally:
        s.server.stop()


def _case_a_late_reader_gets_a_checksum_error_never_the_bytes_that_replaced_its_block(
    transport: UcxTransport,
) -> None:
    """The store unpins after its pin timeout even if the reader never says `mdone`; if the slot is then
    reused, the late copy fails its checksum instead of returning another block's bytes."""
    s = _Store(8, pin_timeout_s=0.3)
    try:
        data = rand_blocks(8, nb=NB, seed=23)
        s.commit(data)
        s.read(transport, 8)
        calls: list[int] = []
        _slow_copies(transport, s.peer, 1.0, calls, num_slow=2)  # 512 KiB: on the two hashing threads
        result: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: result.update(r=s.read(transport, 8, timeout_s=10.0)))
        reader.start()
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # past the store's 0.3 s: slot 0 is unpinned while the reader still waits
        assert s.table.num_inflight == 0
        s.table.segment.array[:] = 0x5A  # the slots' memory reused for other bytes
        reader.join(10)
        res, out = result["r"]
        assert all(not r.ok and "checksum mismatch" in r.error for r in res), [r.error for r in res]
    finally:
        s.server.stop()


def _case_an_abandoned_read_never_writes_into_the_caller_buffer_after_it_returns(
    transport: UcxTransport,
) -> None:
    s = _Store(64)
    try:
        data = rand_blocks(64, nb=NB, seed=24)
        s.commit(data)
        s.read(transport, 64)
        _slow_copies(transport, s.peer, 0.6, [])  # each job of the read sleeps past its deadline
        t0 = time.monotonic()
        res, out = s.read(transport, 64, timeout_s=0.4)  # 4 MiB: split over the hashing threads
        assert time.monotonic() - t0 < 2.0
        assert not all(r.ok for r in res)
        snapshot = out.copy()
        time.sleep(1.0)  # a copy job still running would keep filling `out`
        assert np.array_equal(out, snapshot)
    finally:
        s.server.stop()


def _case_a_request_id_already_in_flight_is_refused_and_pins_nothing(transport: UcxTransport) -> None:
    """A second `mread` reusing the id of one still pinned is refused: it used to overwrite the first's
    record, whose end then failed before unpinning (its slots pinned for good)."""

    from transfer.ucx_conn import PeerRefused
    from transfer.ucx_runtime import _pack

    s = _Store(4)
    try:
        s.commit(rand_blocks(4, nb=NB, seed=26))
        s.read(transport, 4)
        _wait_unpinned(s.table)
        rt = transport._rt

        async def go() -> tuple[Any, str]:
            conn = await transport._conn(s.peer, 0)
            rid = next(rt.ids)
            first = await conn.request({"op": "mread", "id": rid, "b": encode_rows([(0, 1, NB)])})
            try:
                await conn.request({"op": "mread", "id": rid, "b": encode_rows([(1, 1, NB)])})
                refused = ""
            except PeerRefused as exc:
                refused = str(exc)
            pinned = s.table.num_inflight
            await conn.ep.am_send(_pack({"op": "mdone", "id": rid}))
            return (decode_reply(first, 1)[0], pinned), refused

        (ok, pinned), refused = rt.run(go(), 10.0)
        assert ok.tolist() == [True] and pinned == 1  # the first pinned slot 0; the second pinned nothing
        assert "already in flight" in refused
        _wait_unpinned(s.table)
    finally:
        s.server.stop()


def _case_malformed_mread_requests_are_refused_and_the_store_keeps_serving(transport: UcxTransport) -> None:
    """A request in the list form of an older wire, a ragged array or an oversized one: refused with a
    reason, nothing pinned, and the next read on the same connection works."""
    from transfer.ucx_conn import PeerRefused

    s = _Store(4)
    try:
        data = rand_blocks(4, nb=NB, seed=28)
        s.commit(data)
        rt = transport._rt

        async def go() -> list[str]:
            conn = await transport._conn(s.peer, 0)
            why = []
            for b in ([[0, 1, NB]], b"\x00" * 23, encode_rows([(0, 1, NB)] * 4097)):
                try:
                    await conn.request({"op": "mread", "id": next(rt.ids), "b": b})
                    why.append("")
                except PeerRefused as exc:
                    why.append(str(exc))
            return why

        why = rt.run(go(), 10.0)
        assert [
            "malformed block array" in why[0],
            "malformed block array" in why[1],
            "at most" in why[2],
        ] == [True] * 3, why
        assert s.table.num_inflight == 0
        # ids no store could hold fail those blocks as a refused request, not a lost link (no back-off)
        bad = [BlockRead(-1, 1, NB), BlockRead(True, 1, NB)]  # type: ignore[arg-type]
        conns = list(transport._peers[s.peer].conns)
        res = transport.read_blocks(s.peer, bad, [memoryview(o) for o in data[:2].copy()], timeout_s=10.0)
        assert [("must be ints" in r.error) for r in res] == [True, True], res
        assert not transport.backoff.down(s.peer)
        assert all(a is b for a, b in zip(transport._peers[s.peer].conns, conns, strict=True))  # kept
        res, out = s.read(transport, 4)
        assert all(r.ok for r in res) and np.array_equal(out, data)
    finally:
        s.server.stop()


def test_malformed_mread_requests_are_refused_and_the_store_keeps_serving() -> None:
    _in_fresh_process("_case_malformed_mread_requests_are_refused_and_the_store_keeps_serving")


def _case_blocks_outside_the_shared_segment_fail_alone_and_stay_unpinned(transport: UcxTransport) -> None:
    """A handler whose blocks are not in the segment the server shares: each block says so, none stays
    pinned (the offsets are looked up after the pins are recorded for release)."""
    from transfer.ucx_runtime import _pack

    s = _Store(4)
    other = UcxBlockServer(s.table, shared=SharedSegment(4 * NB))
    peer = f"127.0.0.1:{other.start()}"
    try:
        s.commit(rand_blocks(4, nb=NB, seed=27))
        rt = transport._rt

        async def go() -> Any:
            conn = await transport._conn(peer, 0)
            rid = next(rt.ids)
            reply = await conn.request(
                {"op": "mread", "id": rid, "b": encode_rows([(k, 1, NB) for k in range(4)])}
            )
            await conn.ep.am_send(_pack({"op": "mdone", "id": rid}))
            return decode_reply(reply, 4)

        ok, _, _, errors = rt.run(go(), 10.0)
        assert ok.tolist() == [False] * 4, errors
        assert all("not in the shared segment" in e for e in errors.values())
        _wait_unpinned(s.table)
    finally:
        other.stop()
        s.server.stop()


def test_blocks_outside_the_shared_segment_fail_alone_and_stay_unpinned() -> None:
    _in_fresh_process("_case_blocks_outside_the_shared_segment_fail_alone_and_stay_unpinned")


def test_same_host_reads_copy_from_the_mapping_and_verify_every_block() -> None:
    _in_fresh_process("_case_same_host_reads_copy_from_the_mapping_and_verify_every_block")


def test_optimistic_reads_copy_without_pins_and_verify_every_block() -> None:
    _in_fresh_process("_case_optimistic_reads_copy_without_pins_and_verify_every_block")


def test_a_block_freed_during_an_optimistic_copy_is_never_returned() -> None:
    _in_fresh_process("_case_a_block_freed_during_an_optimistic_copy_is_never_returned")


def test_slots_stay_pinned_while_the_reader_copies() -> None:
    _in_fresh_process("_case_slots_stay_pinned_while_the_reader_copies")


def test_a_late_reader_gets_a_checksum_error_never_the_bytes_that_replaced_its_block() -> None:
    _in_fresh_process("_case_a_late_reader_gets_a_checksum_error_never_the_bytes_that_replaced_its_block")


def test_an_abandoned_read_never_writes_into_the_caller_buffer_after_it_returns() -> None:
    _in_fresh_process("_case_an_abandoned_read_never_writes_into_the_caller_buffer_after_it_returns")


def test_a_request_id_already_in_flight_is_refused_and_pins_nothing() -> None:
    _in_fresh_process("_case_a_request_id_already_in_flight_is_refused_and_pins_nothing")


def test_mappings_are_refused_unless_everything_matches() -> None:
    seg = SharedSegment(1 << 20)
    good = seg.descriptor
    m = SegmentMapping.attach(good)
    seg.array[:4] = [1, 2, 3, 4]
    out = np.zeros(8, dtype=np.uint8)
    [(ok, cs, err)] = m.copy_verify([(memoryview(out), 0, checksum(seg.array[:8]))])
    assert ok and list(out[:4]) == [1, 2, 3, 4]
    [(ok, _, err)] = m.copy_verify([(memoryview(out), (1 << 20) - 4, 0)])  # past the end: refused
    assert not ok and "outside" in err
    m.close()
    [(ok, _, err)] = m.copy_verify([(memoryview(out), 0, 0)])
    assert not ok and "closed" in err
    for bad in (
        SegmentDescriptor(good.pid, good.fd, good.dev, good.ino + 1, good.nbytes, good.boot),  # another file
        SegmentDescriptor(good.pid, good.fd, good.dev, good.ino, good.nbytes * 2, good.boot),  # too large
        SegmentDescriptor(good.pid, good.fd, good.dev, good.ino, good.nbytes, "another-host"),
        SegmentDescriptor(good.pid, 9999, good.dev, good.ino, good.nbytes, good.boot),  # no such fd
    ):
        with pytest.raises(OSError):
            SegmentMapping.attach(bad)
    fd = os.memfd_create("unsealed")  # resizable: a shrink would SIGBUS the reader
    try:
        os.ftruncate(fd, 4096)
        st = os.fstat(fd)
        with pytest.raises(OSError, match="sealed"):
            SegmentMapping.attach(SegmentDescriptor(os.getpid(), fd, st.st_dev, st.st_ino, 4096, good.boot))
        assert fcntl.fcntl(seg.descriptor.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        assert os.fstat(seg.descriptor.fd).st_mode & 0o777 == 0o400  # reopened: owner, read-only
    finally:
        os.close(fd)
    for wire in ({}, {**good.to_wire(), "pid": -1}, {**good.to_wire(), "boot": 3}, "x"):
        with pytest.raises(ValueError):
            SegmentDescriptor.from_wire(wire)
    assert SegmentDescriptor.from_wire(good.to_wire()) == good


def test_store_process_shares_its_segment_unless_told_not_to(transport: UcxTransport) -> None:
    """A real `kvpool store`: a same-host reader maps it; with --no-share-segment it reads over UCX."""
    for share in (True, False):
        s = start_store(*([] if share else ["--no-share-segment"]), segment="8MiB")
        try:
            data = rand_blocks(8, seed=25)
            put_blocks(s, transport, list(range(8)), data)
            res, out = read(transport, s, list(range(8)))
            assert all(r.ok for r in res) and np.array_equal(out, data)
            assert (transport._peers[s.data_address].mapping is not None) == share
        finally:
            s.kill()


def test_a_peer_keeps_its_mapping_only_while_its_store_advertises_that_segment() -> None:
    """The mapping follows the store at an address: the same descriptor keeps it, a restarted store's new
    segment replaces it, and a store restarted with sharing off drops it (reads go back to UCX, which a
    stale mapping would have sent to a store that no longer answers `mread`)."""
    from transfer.ucx_conn import PeerConns

    a, b = SharedSegment(1 << 16), SharedSegment(1 << 16)
    p = PeerConns(1)
    p.map_segment("s:1", {"seg": a.descriptor.to_wire(), "mv": MREAD_VERSION})
    first = p.mapping
    assert first is not None and first.descriptor == a.descriptor
    p.map_segment("s:1", {"seg": a.descriptor.to_wire(), "mv": MREAD_VERSION})
    assert p.mapping is first
    p.map_segment("s:1", {"seg": b.descriptor.to_wire(), "mv": MREAD_VERSION})
    assert p.mapping is not None and p.mapping.descriptor == b.descriptor and first.address == 0  # unmapped
    p.map_segment("s:1", {"seg": {"pid": "x"}, "mv": MREAD_VERSION})  # malformed: stays on UCX
    p.map_segment("s:1", {})
    assert p.mapping is None
    p.map_segment("s:1", {"seg": a.descriptor.to_wire(), "mv": MREAD_VERSION - 1})  # another mread wire
    assert p.mapping is None
    p.map_segment("s:1", {"seg": a.descriptor.to_wire()})  # a store from before the versioned wire
    assert p.mapping is None


def test_a_peer_maps_the_slot_state_its_store_advertises_and_only_that() -> None:
    from transfer.slot_state import SharedSlotState
    from transfer.ucx_conn import PeerConns

    seg, st = SharedSegment(1 << 16), SharedSlotState(4, 1 << 14)
    hello = {"seg": seg.descriptor.to_wire(), "mv": MREAD_VERSION, "st": st.to_wire()}
    p = PeerConns(1)
    p.map_segment("s:1", hello)
    state = p.state
    assert state is not None and (state.num_slots, state.block_nbytes) == (4, 1 << 14)
    st.generation[2], st.readable[2] = 7, 1
    with state.hold() as live:
        assert live and state.readable_at(np.array([2, 3]), np.array([7, 1], np.uint64)).tolist() == [
            True,
            False,
        ]
    p.map_segment("s:1", hello)
    assert p.state is state  # the same store: kept
    p.map_segment("s:1", {k: v for k, v in hello.items() if k != "st"})  # restarted without it
    assert p.state is None and p.mapping is not None
    with state.hold() as live:
        assert not live  # closed: nothing may be read through it
    for bad in ({"seg": st.to_wire()["seg"], "n": 10**6, "nb": 1}, {"seg": {}, "n": 4, "nb": 1}, "x"):
        p.map_segment("s:1", {**hello, "st": bad})  # malformed or larger than its file: not mapped
        assert p.state is None
    p.map_segment("s:1", hello)
    assert p.state is not None
    p.unmap()
    assert p.state is None and p.mapping is None


def _mapped_segments(name: str = "kvpool-segment-") -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def test_a_dead_stores_segment_is_unmapped_by_its_readers(transport: UcxTransport) -> None:
    """A reader held a killed store's memfd mapped (its memory allocated) until the transport closed: a
    store crash-looping on new ports grew shared memory without limit. Once no connection to the store is
    alive, the mapping goes."""
    before, states_before = _mapped_segments(), _mapped_segments("kvpool-slot-state-")
    s = start_store(segment="8MiB")
    try:
        data = rand_blocks(4, seed=27)
        put_blocks(s, transport, [0, 1, 2, 3], data)
        assert all(r.ok for r in read(transport, s, [0, 1, 2, 3])[0])
        assert transport._peers[s.data_address].mapping is not None
        assert transport._peers[s.data_address].state is not None  # optimistic reads: no request
        assert _mapped_segments() == before + 1
        assert _mapped_segments("kvpool-slot-state-") == states_before + 1
    finally:
        s.kill()
    res, _ = read(transport, s, [0], timeout_s=3.0)  # fails (the mapping outlives the store: not read)
    assert not res[0].ok
    deadline = time.monotonic() + 5
    while _mapped_segments() > before or _mapped_segments("kvpool-slot-state-") > states_before:
        assert time.monotonic() < deadline, "the dead store's segment is still mapped"
        time.sleep(0.05)
    assert transport._peers[s.data_address].mapping is None
