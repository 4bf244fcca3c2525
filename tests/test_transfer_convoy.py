"""UCX transport under a convoy (field case B39): a read that misses its own deadline while the store answers
is slow, not a lost store; a store that dies or goes silent is lost. Real store processes over UCX tcp."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.test_store_node import MIB_LAYOUT, StoreProc, read, require_ucx, start_store
from tests.test_transfer import MIB, _fill
from transfer import UcxTransport

NUM_BLOCKS = 32


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreProc]:
    """A store whose sends give up after 3 s: a message nobody receives makes it abort the endpoint."""
    require_ucx()
    monkeypatch.setenv("KVPOOL_TRANSFER_TIMEOUT_S", "3")
    s = start_store(segment="64MiB", layout=MIB_LAYOUT)
    yield s
    s.kill()


def _convoy(
    t: UcxTransport, s: StoreProc, deadlines_s: list[float]
) -> list[tuple[list[bool], list[str], np.ndarray, list[int]]]:
    """One read of 4 blocks per deadline, all started at once (threads); per read: oks, errors, out, slots."""
    out: list[tuple[list[bool], list[str], np.ndarray, list[int]] | None] = [None] * len(deadlines_s)
    gate = threading.Barrier(len(deadlines_s))

    def one(k: int) -> None:
        slots = [(4 * k + j) % NUM_BLOCKS for j in range(4)]
        gate.wait()
        res, got = read(t, s, slots, nb=MIB, timeout_s=deadlines_s[k])
        out[k] = ([r.ok for r in res], [r.error for r in res], got, slots)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(deadlines_s))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert all(o is not None for o in out)
    return [o for o in out if o is not None]


def test_reads_past_their_deadline_in_a_convoy_leave_the_store_and_connection_alone(store: StoreProc) -> None:
    """16 reads share one endpoint; every other one has a 2 ms (then 10 ms) deadline. Those fail as timed
    out (or land, if their bytes were already moving), the others complete bit-exact; the store is not backed off, the
    shared connection is neither aborted nor broken by the store (its sends of the abandoned blocks were
    received and discarded, else it would abort the endpoint after its 3 s send timeout), and the next
    read on it succeeds (a backed-off store would fail it at once). The stall bound is 3 s here, not the
    default 1 s: a loaded 2-core CI host can keep a live store's answer back for a second (the silent-store
    test below checks the bound itself)."""
    t = UcxTransport(endpoints_per_peer=1, blocks_per_message=2, map_local_segments=False, peer_stall_s=3.0)
    try:
        data = _fill(store, t, NUM_BLOCKS)
        conn = t._peers[store.data_address].conns[0]
        assert conn is not None and not conn.dead
        timed_out = 0
        for short_s in (0.0005, 0.002, 0.01):  # before the store answers, and (some) while its bytes move
            results = _convoy(t, store, [short_s if k % 2 else 30.0 for k in range(16)])
            for k, (oks, errors, got, slots) in enumerate(results):
                for ok, err, row, slot in zip(oks, errors, got, slots, strict=True):
                    if ok:
                        assert np.array_equal(row, data[slot]), (k, slot)
                    else:
                        assert k % 2 and "TransferTimedOut" in err, (k, err)
                        timed_out += 1
                if k % 2 == 0:
                    assert all(oks), (k, errors)
            assert not t.backoff.down(store.data_address)
            assert t._peers[store.data_address].conns[0] is conn and not conn.dead
        assert timed_out > 0, "no read missed its short deadline: the test proves nothing"
        time.sleep(3.5)  # past the store's send timeout: an undrained message would have cost the endpoint
        assert not conn.dead and t._peers[store.data_address].conns[0] is conn
        res, got = read(t, store, list(range(8)), nb=MIB, timeout_s=10.0)
        assert all(r.ok for r in res) and np.array_equal(got, data[:8]), res[0].error
        assert t._peers[store.data_address].conns[0] is conn
    finally:
        t.close()


def test_a_killed_store_fails_every_read_in_flight_with_a_typed_error_and_is_backed_off(
    store: StoreProc,
) -> None:
    """Reads in flight on a store that stops answering and is then killed: every one fails (no raise, no
    AttributeError from an endpoint that went away), each block's error names `PeerLost`, and the store
    is backed off: the next read fails at once."""
    t = UcxTransport(endpoints_per_peer=2, blocks_per_message=2, map_local_segments=False)
    try:
        _fill(store, t, NUM_BLOCKS)
        os.kill(store.proc.pid, signal.SIGSTOP)
        threading.Timer(0.3, lambda: os.kill(store.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        results = _convoy(t, store, [10.0] * 12)
        assert time.monotonic() - t0 < 5.0
        for oks, errors, _, _ in results:
            assert not any(oks)
            for err in errors:
                assert "PeerLost" in err and "AttributeError" not in err, err
        assert t.backoff.down(store.data_address)
        t0 = time.monotonic()
        res, _ = read(t, store, [0], nb=MIB, timeout_s=5.0)
        # at once (~ms), not at the 5 s deadline: half of it leaves a loaded host seconds
        assert not res[0].ok and "unreachable" in res[0].error and time.monotonic() - t0 < 2.5
    finally:
        t.close()


def test_a_silent_store_is_lost_after_the_stall_bound(store: StoreProc) -> None:
    """A store that stops answering (SIGSTOP) is heard from for none of the stall bound: the read fails
    at its deadline, the store is backed off and the connection aborted (nothing of it can be trusted)."""
    t = UcxTransport(endpoints_per_peer=1, blocks_per_message=2, map_local_segments=False, peer_stall_s=0.3)
    try:
        _fill(store, t, 4)
        conn = t._peers[store.data_address].conns[0]
        time.sleep(0.4)  # a quiet connection is not a silent store: only time waited on it counts
        os.kill(store.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        res, _ = read(t, store, list(range(4)), nb=MIB, timeout_s=0.6)
        assert time.monotonic() - t0 < 3.0
        assert not any(r.ok for r in res)
        assert t.backoff.down(store.data_address)
        assert conn is not None and conn.dead
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
        t.close()
