"""UCX transport, the network path (same-host mapped reads are off here: tests/test_shared_segment.py):
in-process server round trip and checksum checks; dead and stalled peers (real processes)."""

from __future__ import annotations

import os
import signal
import threading
import time
import types
from collections.abc import Iterator

import numpy as np
import psutil
import pytest

from tests.test_store_node import (
    MIB_LAYOUT,
    NS,
    StoreProc,
    h,
    put_blocks,
    rand_blocks,
    read,
    require_ucx,
    start_store,
)
from transfer import BlockRead, BlockWrite, UcxBlockServer, UcxTransport, checksum

MIB = 1 << 20


@pytest.fixture(scope="module")
def transport() -> Iterator[UcxTransport]:
    require_ucx()
    t = UcxTransport(blocks_per_message=16, map_local_segments=False)
    yield t
    t.close()


def test_env_defaults_documented_and_set() -> None:
    require_ucx()
    assert os.environ["UCX_MM_ERROR_HANDLING"] == "y"
    assert os.environ["UCXPY_PROGRESS_MODE"] == "blocking"
    assert "tcp" in os.environ.get("UCX_TLS", "tcp")
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == os.environ["UCX_TCP_RX_SEG_SIZE"] == "512k"
    assert os.environ["UCX_TCP_CM_REUSEADDR"] == "y"


def test_a_store_restarts_at_once_on_its_fixed_data_port(transport: UcxTransport) -> None:
    """Killed after serving reads and restarted on the same ports, a store used to fail with ucxx's
    "Device is busy" for about a minute (its listener's connections in TIME_WAIT)."""
    import socket

    def free_port() -> int:
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            return int(sk.getsockname()[1])

    ports = ["--grpc-port", str(free_port()), "--data-port", str(free_port())]
    s = start_store(*ports, segment="8MiB")
    try:
        data = rand_blocks(4, seed=9)
        put_blocks(s, transport, [0, 1, 2, 3], data)
        assert all(r.ok for r in read(transport, s, [0, 1, 2, 3])[0])
    finally:
        s.kill()
    s = start_store(*ports, segment="8MiB")
    try:
        assert s.data_address.endswith(":" + ports[3])
        data = rand_blocks(4, seed=10)
        deadline = time.monotonic() + 10  # the transport backs the address off after the kill
        while True:
            try:
                put_blocks(s, transport, [0, 1, 2, 3], data)
                break
            except AssertionError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        res, out = read(transport, s, [0, 1, 2, 3])
        assert all(r.ok for r in res) and np.array_equal(out, data)
    finally:
        s.kill()


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id."""
    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def _busy_threads(before: dict[int, float], min_s: float = 0.2) -> list[tuple[str, float]]:
    """The threads of this process that used more than `min_s` of CPU since `before`: (name, seconds),
    named by Python where it started them, else by the kernel's comm (UCX, gRPC and library threads)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = []
    for tid, cpu_s in _thread_cpu_s().items():
        used_s = cpu_s - before.get(tid, 0.0)
        if used_s > min_s:
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
            out.append((f"{name} ({tid})", round(used_s, 2)))
    return out


def test_idle_connections_do_not_spin(transport: UcxTransport) -> None:
    """A store with open connections and a client holding them, both idle, use ~no CPU: ucxx's blocking
    mode left the worker's event fd unarmed and polled posted receives with sleep(0), which spun one core
    in every process with a connection (transfer/ucx_wait.py)."""
    from transfer.ucx_runtime import _Runtime

    assert _Runtime.get().waker.installed
    s = start_store(segment="8MiB")
    try:
        data = rand_blocks(4, seed=5)
        put_blocks(s, transport, [0, 1, 2, 3], data)
        res, out = read(transport, s, [0, 1, 2, 3])  # connections are open and have carried traffic
        assert all(r.ok for r in res) and np.array_equal(out, data)
        store, me = psutil.Process(s.proc.pid), psutil.Process()
        c0, m0, threads0 = _cpu_s(store), _cpu_s(me), _thread_cpu_s()
        time.sleep(2.0)
        store_s, me_s = _cpu_s(store) - c0, _cpu_s(me) - m0
        # a spinning loop thread: ~2 s each
        assert store_s < 0.5 and me_s < 0.5, (store_s, me_s, _busy_threads(threads0))
        res, out = read(transport, s, [0, 1, 2, 3])  # and an idle connection still answers at once
        assert all(r.ok for r in res) and np.array_equal(out, data)
    finally:
        s.kill()


def _stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and wait until every one of its threads is stopped: `kill` returns when the signal is
    sent, and a thread of a busy store may still answer a request until the stop reaches it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: thread states {states}"
        time.sleep(0.01)


def test_a_stalled_peer_costs_no_cpu_while_the_transfer_waits(transport: UcxTransport) -> None:
    """A read waiting on a SIGSTOPped store until its deadline: the busy regime naps once nothing moves
    and the worker arms (transfer/ucx_wait.py); it used to poll the worker without pause, a whole core for
    the length of the deadline."""
    s = start_store(segment="8MiB")
    try:
        data = rand_blocks(4, seed=6)
        put_blocks(s, transport, [0, 1, 2, 3], data)
        res, _ = read(transport, s, [0, 1, 2, 3])  # the connections are open
        assert all(r.ok for r in res)
        _stop(s.proc.pid)
        me = psutil.Process()
        c0, t0, threads0 = _cpu_s(me), time.monotonic(), _thread_cpu_s()
        res, _ = read(transport, s, [0, 1, 2, 3], timeout_s=2.0)
        cpu_s, wall_s = _cpu_s(me) - c0, time.monotonic() - t0
        assert not any(r.ok for r in res), res
        assert cpu_s < 0.4 * wall_s, (cpu_s, wall_s, _busy_threads(threads0))  # spinning: ~1.0 x wall
    finally:
        s.kill()


def test_a_connection_attempt_to_a_stopped_peer_costs_no_cpu() -> None:
    """A stopped store accepts the TCP connection but never answers ucxx's handshake; the attempt outlives the
    read's deadline (`connect_endpoint` never abandons one midway) and waited in `UCXRequest.wait`, which
    polls: the loop thread burned CPU for as long as the peer stayed stopped (a CI run saw a whole core).
    The handshake now waits through the progress waker (transfer/ucx_wait.py)."""
    require_ucx()
    t = UcxTransport(blocks_per_message=16, map_local_segments=False)  # no connection to the store yet
    s = start_store(segment="8MiB")
    try:
        _stop(s.proc.pid)
        res, _ = read(t, s, [0, 1], timeout_s=1.0)
        assert not any(r.ok for r in res), res
        threads0 = _thread_cpu_s()
        time.sleep(2.0)
        busy = _busy_threads(threads0, min_s=0.1)
        assert not busy, busy  # polling: 0.25-2 s of the loop thread
    finally:
        s.kill()
        t.close()


def test_transport_code_never_waits_on_a_ucxx_request_by_polling() -> None:
    """ucxx's own waits (`Endpoint.am_send/send/recv/am_recv`, `UCXRequest.wait`) poll the loop; the
    transport waits through `transfer/ucx_wait.py` only (a polling wait on a stopped peer spins a core)."""
    import re
    from pathlib import Path

    polling = re.compile(r"\.am_send\(|\bawait [\w.]+\.(send|recv|am_recv)\(|\.wait\(\)")
    root = Path(__file__).resolve().parents[1] / "transfer"
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted(root.glob("*.py"))
        if path.name != "ucx_wait.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if polling.search(line)
    ]
    assert not found, found


def test_tagged_messages_interoperate_with_plain_ucxx() -> None:
    """`tag_send`/`tag_recv` put the same tags on the wire as ucxx's `Endpoint.send`/`recv` (the raw-UCX
    baseline and any ucxx peer use those), in both directions."""
    require_ucx()
    from transfer.ucx_runtime import _Runtime
    from transfer.ucx_wait import tag_recv, tag_send

    rt = _Runtime.get()
    payload = np.arange(1 << 18, dtype=np.uint8)  # 256 KiB: a rendezvous-sized message
    got_plain = np.zeros_like(payload)
    got_ours = np.zeros_like(payload)
    served: list[np.ndarray] = []

    async def on_connect(ep: object) -> None:
        buf = np.zeros_like(payload)
        await tag_recv(ep, buf, 7, rt.waker)  # ours receives ucxx's send
        served.append(buf)
        await ep.send(buf, tag=8)  # type: ignore[attr-defined] # ucxx's send, received by ours below
        await tag_send(ep, buf, 9, rt.waker)  # ours, received by ucxx's recv below

    async def scenario() -> None:
        listener = rt.ucxx.create_listener(on_connect)
        ep = await rt.ucxx.create_endpoint("127.0.0.1", listener.port)
        with rt.waker.busy():
            await ep.send(payload, tag=7)
            await tag_recv(ep, got_ours, 8, rt.waker)
            await ep.recv(got_plain, tag=9)
        ep.abort()
        listener.close()

    rt.run(scenario(), 30.0)
    assert np.array_equal(served[0], payload)
    assert np.array_equal(got_ours, payload) and np.array_equal(got_plain, payload)


def _fill(s: StoreProc, t: UcxTransport, n: int) -> np.ndarray:
    data = rand_blocks(n, nb=MIB, seed=12)
    for start in range(0, n, 32):
        put_blocks(s, t, list(range(start, min(n, start + 32))), data[start : start + 32], nb=MIB)
    return data


def test_kill_9_peer_mid_batch_fails_every_block_within_deadline(transport: UcxTransport) -> None:
    live = start_store("--node-id", "live", segment="8MiB", layout=MIB_LAYOUT)
    doomed = start_store("--node-id", "doomed", segment="64MiB", layout=MIB_LAYOUT)
    try:
        live_data = _fill(live, transport, 4)
        _fill(doomed, transport, 64)
        os.kill(doomed.proc.pid, signal.SIGSTOP)  # the batch starts against a peer that never answers...
        threading.Timer(0.3, lambda: os.kill(doomed.proc.pid, signal.SIGKILL)).start()  # ...then dies
        t0 = time.monotonic()
        res, _ = read(transport, doomed, list(range(64)), nb=MIB, timeout_s=5.0)
        elapsed = time.monotonic() - t0
        assert [r.ok for r in res] == [False] * 64
        assert all("failed" in r.error or "lost" in r.error for r in res), res[0].error
        assert elapsed < 5.0 + 1.0, elapsed
        # the transport stays healthy: a live peer works, the dead one fails fast
        res, out = read(transport, live, list(range(4)), nb=MIB)
        assert all(r.ok for r in res) and np.array_equal(out, live_data)
        t0 = time.monotonic()
        res, _ = read(transport, doomed, [0], nb=MIB, timeout_s=3.0)
        assert not res[0].ok and time.monotonic() - t0 < 4.0
    finally:
        doomed.kill()
        live.kill()


def test_peer_killed_while_bytes_flow(transport: UcxTransport) -> None:
    s = start_store(segment="128MiB", layout=MIB_LAYOUT)
    try:
        data = _fill(s, transport, 128)
        threading.Timer(0.05, lambda: os.kill(s.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        res, out = read(transport, s, list(range(128)) * 2, nb=MIB, timeout_s=5.0)
        assert time.monotonic() - t0 < 6.0
        assert not all(r.ok for r in res)
        for i, r in enumerate(res):  # whatever did arrive is exact; the rest failed explicitly
            if r.ok:
                assert np.array_equal(out[i], data[i % 128])
            else:
                assert r.error
    finally:
        s.kill()


def test_a_refused_request_keeps_its_connection(transport: UcxTransport) -> None:
    """A request the store refuses as a whole (a slot no store can hold) fails its blocks, but the store
    answered before anything moved: the connection is kept (it was aborted, and the next call reconnected),
    no reply is left expected, and the next read on it works."""
    s = start_store(segment="8MiB", layout=MIB_LAYOUT)
    try:
        data = _fill(s, transport, 4)
        conns = list(transport._peers[s.data_address].conns)
        assert any(c is not None for c in conns)
        res, _ = read(transport, s, [-1], nb=MIB)
        assert not res[0].ok and "refused" in res[0].error, res[0].error
        bad = transport.write_blocks(
            s.data_address, [BlockWrite(-1, 1, data[0], checksum(data[0]))], timeout_s=10
        )
        assert not bad[0].ok and "refused" in bad[0].error, bad[0].error
        after = transport._peers[s.data_address].conns
        assert all(a is b for a, b in zip(after, conns, strict=True)), (
            "a refused request dropped its connection"
        )
        assert all(c is None or (not c.dead and not c._pending) for c in after)
        assert not transport.backoff.down(s.data_address)
        res, out = read(transport, s, list(range(4)), nb=MIB)
        assert all(r.ok for r in res) and np.array_equal(out, data)
    finally:
        s.kill()


_STALL_SCRIPT = """
import os, signal, sys, time
from tests.test_store_node import start_store, read, MIB_LAYOUT
from tests.test_transfer import _fill, MIB
from transfer import UcxTransport
t = UcxTransport(blocks_per_message=16, map_local_segments=False)
s = start_store(segment="8MiB", layout=MIB_LAYOUT)
try:
    _fill(s, t, 4)
    os.kill(s.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    res, _ = read(t, s, list(range(4)), nb=MIB, timeout_s=1.0)
    print("STALL", [r.ok for r in res] == [False] * 4 and "deadline" in res[0].error, time.monotonic() - t0)
    os.kill(s.proc.pid, signal.SIGCONT)
    t0 = time.monotonic()
    while time.monotonic() - t0 < float(sys.argv[1]):
        res, _ = read(t, s, [0], nb=MIB, timeout_s=2.0)
        if res[0].ok:
            break
    print("RECOVERED", res[0].ok, time.monotonic() - t0)
finally:
    s.kill()
"""


def _run_stall(recover_s: float) -> dict[str, tuple[bool, float]]:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _STALL_SCRIPT, str(recover_s)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {
        w[0]: (w[1] == "True", float(w[2]))
        for w in (line.split() for line in out.stdout.splitlines())
        if len(w) == 3
    }


def test_stalled_peer_fails_within_deadline_then_recovers_after_resume() -> None:
    """In a child process: a SIGSTOPped peer makes every block fail within the deadline, no hang; once it
    resumes, new endpoints to it work at once (they used to lose their first replies, see ucx_runtime)."""
    require_ucx()
    r = _run_stall(10.0)
    ok, elapsed = r["STALL"]
    assert ok and elapsed < 5.0, r  # the 1 s deadline, 5x for a loaded host: no hang
    ok, elapsed = r["RECOVERED"]
    assert ok and elapsed < 5.0, r


def test_dead_peer_leaves_transport_healthy_for_survivors_and_new_peers() -> None:
    """Regression: aborting endpoints whose reader waits (a stalled-then-killed peer's at the deadline, or a
    closed transport's) orphaned ucxx active-message receives keyed by a recycled `ucp_ep_h`; endpoints
    opened afterwards lost their first replies and every batch on them hit its deadline."""
    require_ucx()
    t = UcxTransport(blocks_per_message=16, map_local_segments=False)
    live = start_store("--node-id", "live", segment="8MiB", layout=MIB_LAYOUT)
    doomed = start_store("--node-id", "doomed", segment="64MiB", layout=MIB_LAYOUT)
    fresh: StoreProc | None = None
    t2: UcxTransport | None = None
    try:
        live_data = _fill(live, t, 8)
        _fill(doomed, t, 32)
        os.kill(doomed.proc.pid, signal.SIGSTOP)
        threading.Timer(0.3, lambda: os.kill(doomed.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        res, _ = read(t, doomed, list(range(32)), nb=MIB, timeout_s=2.0)
        assert not any(r.ok for r in res) and time.monotonic() - t0 < 3.0
        for tr in (t, None):  # this transport, then a new one after closing it (its readers still wait)
            if tr is None:
                t.close()
                tr = t2 = UcxTransport(blocks_per_message=16, map_local_segments=False)
            t0 = time.monotonic()
            res, out = read(tr, live, list(range(8)), nb=MIB, timeout_s=20.0)
            assert all(r.ok for r in res) and np.array_equal(out, live_data), res[0].error
            assert time.monotonic() - t0 < 5.0
            if fresh is not None:
                fresh.kill()
            fresh = start_store("--node-id", "fresh", segment="8MiB", layout=MIB_LAYOUT)
            t0 = time.monotonic()
            data = _fill(fresh, tr, 8)
            res, out = read(tr, fresh, list(range(8)), nb=MIB, timeout_s=20.0)
            assert all(r.ok for r in res) and np.array_equal(out, data), res[0].error
            assert time.monotonic() - t0 < 8.0
    finally:
        t.close()
        if t2 is not None:
            t2.close()
        for s in (doomed, live, fresh):
            if s is not None:
                s.kill()


def test_in_process_server_round_trip_and_flipped_byte(transport: UcxTransport) -> None:
    from kvpool.store import Segment, SlotTable
    from kvpool.store.slots import Reservation

    nb = 64 * 1024
    table = SlotTable(Segment(64 * nb, nb, pin_memory="off"))
    server = UcxBlockServer(table)
    peer = f"127.0.0.1:{server.start()}"
    try:
        data = rand_blocks(64, nb=nb, seed=11)
        table.reserve([Reservation(i, 1, NS, h(i)) for i in range(64)], 10_000)
        res = transport.write_blocks(
            peer, [BlockWrite(i, 1, data[i], checksum(data[i])) for i in range(64)], timeout_s=10
        )
        assert all(r.ok for r in res)
        assert all(e == "" for _, _, e in table.commit([(i, 1) for i in range(64)]))
        out = np.zeros_like(data)
        res = transport.read_blocks(
            peer, [BlockRead(i, 1, nb) for i in range(64)], [memoryview(o) for o in out], timeout_s=10
        )
        assert all(r.ok for r in res) and np.array_equal(out, data)
        table.segment.array[5 * nb + 17] ^= 0x01  # flip one byte of block 5 in the segment
        res = transport.read_blocks(
            peer, [BlockRead(i, 1, nb) for i in range(64)], [memoryview(o) for o in out], timeout_s=10
        )
        assert [i for i, r in enumerate(res) if not r.ok] == [5]
        assert "checksum mismatch" in res[5].error
        # a single small block is verified on the loop thread (no hop to a hashing thread), just as strictly
        import transfer.ucx_messages as ucx_messages

        hops: list[object] = []
        pool = ucx_messages.HASH_POOL
        ucx_messages.HASH_POOL = types.SimpleNamespace(submit=lambda *a: hops.append(a) or pool.submit(*a))  # type: ignore[assignment]
        try:
            res = transport.read_blocks(peer, [BlockRead(5, 1, nb)], [memoryview(out[5])], timeout_s=10)
            assert not res[0].ok and "checksum mismatch" in res[0].error
            res = transport.read_blocks(peer, [BlockRead(6, 1, nb)], [memoryview(out[6])], timeout_s=10)
            assert res[0].ok and np.array_equal(out[6], data[6])
        finally:
            ucx_messages.HASH_POOL = pool
        assert hops == []
        est = transport.link(peer)
        assert est.alpha_s > 0 and est.beta_bytes_per_s > 0 and est.predict_s(MIB) > est.alpha_s
        # a read-only or wrong-sized output buffer fails that block only
        res = transport.read_blocks(
            peer,
            [BlockRead(0, 1, nb), BlockRead(1, 1, nb), BlockRead(2, 1, nb)],
            [memoryview(bytes(nb)), memoryview(out[1]), memoryview(out[2])[:100]],
            timeout_s=10,
        )
        assert [r.ok for r in res] == [False, True, False] and res[1].checksum == checksum(data[1])
        assert "unusable" in res[0].error and "unusable" in res[2].error
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("tls", ["tcp", "all"])
def test_throughput_256_x_1mib_reads(tls: str) -> None:
    """Prints GB/s for 256 x 1 MiB reads from a store process (tcp only, or every transport incl. shm)."""
    import subprocess
    import sys

    code = f"""
import os, time, numpy as np
os.environ["UCX_TLS"] = {tls!r}
from tests.test_store_node import start_store, put_blocks, read, rand_blocks, MIB_LAYOUT
from transfer import UcxTransport
s = start_store(segment="256MiB", layout=MIB_LAYOUT)
t = UcxTransport(map_local_segments=False)
data = rand_blocks(32, nb=1 << 20)
for st in range(0, 256, 32):
    put_blocks(s, t, list(range(st, st + 32)), data, nb=1 << 20)
best = 0.0
for _ in range(5):
    t0 = time.perf_counter(); res, _ = read(t, s, list(range(256)), nb=1 << 20); dt = time.perf_counter() - t0
    assert all(r.ok for r in res); best = max(best, 256 * (1 << 20) / dt / 1e9)
print(f"UCX_TLS={tls}: 256 x 1 MiB reads best {{best:.2f}} GB/s; link {{t.link(s.data_address)}}")
s.kill(); t.close()
"""
    env = dict(os.environ, UCX_TLS=tls)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
