"""`kvpool bench transfer`: the data plane against raw UCX, `ucx_perftest`, memcpy and Mooncake.

Per UCX transport (`tcp`: `UCX_TLS=tcp`; `shm`: `UCX_TLS=sm,self,tcp` with `UCX_MM_ERROR_HANDLING=y`) one
worker process (`python -m kvpool.bench.transfer_bench worker CFG`, the transport fixed by its
environment) runs, per block size, a real `kvpool store` process and a raw-UCX peer
(`kvpool.bench.raw_ucx`), and measures, interleaved and repeated: pool batch `get` (checksums verified)
and `put` (checksummed, reserved slots) of `batch` blocks through `UcxTransport`; raw ucxx tagged
send/recv of the same blocks with the same endpoints and message split; a numpy copy of the same bytes;
and single-block read latency. The parent runs the C `ucx_perftest` (`tag_bw`, same message size) from
the libucx wheel per transport and size, and Mooncake's store (`mooncake_master` with its HTTP metadata
server, one storage process, one client; `tcp` protocol) when `mooncake-transfer-engine-non-cuda` is
installed. Which UCX transports really carried the bytes is read from the raw peer's `UCX_LOG_LEVEL=info`
line (`intra-node cfg#0 tag(...)`). Medians over the repeats are reported; pool/raw and pool/memcpy are
medians of the per-repeat ratios (each repeat measures them back to back, see `_paired_ratio`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

KIB, MIB = 1 << 10, 1 << 20
FULL_SIZES = (64 * KIB, 1 * MIB, 4 * MIB)
QUICK_SIZES = (64 * KIB,)
TRANSPORTS = {
    "tcp": {"UCX_TLS": "tcp"},
    "shm": {"UCX_TLS": "sm,self,tcp", "UCX_MM_ERROR_HANDLING": "y"},
}
TARGET_RAW_RATIO = 0.85
TARGET_MEMCPY_RATIO = 0.5
NS = b"B" * 16


def layout_for(block_bytes: int) -> str:
    """A KV layout fingerprint whose blocks are `block_bytes` long (a multiple of 128)."""
    if block_bytes % 128:
        raise ValueError("block sizes must be multiples of 128 B")
    return f"kv1:float32:b16:l1:h1:d{block_bytes // 128}"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Child:
    """A child process whose stdout is read until a line starting with `ready` (its rest is `info`)."""

    def __init__(self, args: Sequence[str], ready: str, env: dict[str, str], timeout_s: float = 60.0) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="kvpool-bench-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.proc.stdout.readline()
            if line.startswith(ready):
                self.info = line[len(ready) :].strip()
                return
            if not line or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{args[:4]} did not start: {self.stderr()}")

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


# ---------------------------------------------------------------- worker (one UCX transport)


class _Store:
    """A `kvpool store` child with `batch` committed blocks (slots 0..batch-1) and `batch` put slots."""

    def __init__(self, block_bytes: int, batch: int, env: dict[str, str]) -> None:
        from kvpool.rpc.server import channel
        from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

        segment = 2 * batch * block_bytes
        self.child = _Child(
            [
                sys.executable, "-m", "kvpool.cli.main", "store", "--listen", "127.0.0.1", "--grpc-port", "0",
                "--data-port", "0", "--segment-size", str(segment), "--layout", layout_for(block_bytes),
                "--node-id", f"bench-{block_bytes}",
            ],
            "KVPOOL_READY ",
            env,
        )  # fmt: skip
        info = json.loads(self.child.info)
        self.data_address: str = info["data_address"]
        self._channel = channel(info["grpc_address"])
        self.stub = pb_grpc.StoreStub(self._channel)
        self.put_gen = 1

    def reserve(self, slots: Sequence[int], gen: int) -> None:
        from kvpool.v1 import kvpool_pb2 as pb

        self.stub.ReserveSlots(
            pb.ReserveSlotsRequest(
                slots=[
                    pb.SlotReservation(slot=s, generation=gen, namespace=NS, block_hash=s.to_bytes(16, "big"))
                    for s in slots
                ],
                write_lease_ms=600_000,
            ),
            timeout=30,
        )

    def commit(self, slots: Sequence[int], gen: int) -> None:
        from kvpool.v1 import kvpool_pb2 as pb

        resp = self.stub.CommitSlots(
            pb.CommitSlotsRequest(slots=[pb.SlotRef(slot=s, generation=gen) for s in slots]), timeout=30
        )
        bad = [r.error for r in resp.results if not r.ok]
        if bad:
            raise RuntimeError(f"commit failed: {bad[:3]}")

    def free(self, slots: Sequence[int], gen: int) -> int:
        """Free `slots` at `gen`; returns their next generation."""
        from kvpool.v1 import kvpool_pb2 as pb

        resp = self.stub.FreeSlots(
            pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=s, generation=gen) for s in slots]), timeout=30
        )
        return max(f.new_generation for f in resp.slots)

    def stop(self) -> None:
        self._channel.close()
        self.child.stop()


def _emit(kind: str, payload: Any) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def _worker(cfg: dict[str, Any]) -> None:
    """Measure one UCX transport (fixed by this process's environment); emits STEP and RESULT lines."""
    from kvpool.bench.raw_ucx import RawUcxClient
    from transfer import BlockRead, UcxTransport
    from transfer.ucx_runtime import apply_ucx_env_defaults

    apply_ucx_env_defaults()
    env = dict(os.environ)
    batch, reps, eps, per_msg = cfg["batch"], cfg["reps"], cfg["endpoints"], cfg["blocks_per_message"]
    env.pop("UCX_LOG_LEVEL", None)  # only this process logs its endpoint configurations (see _run_worker)
    raw_peer = _Child([sys.executable, "-m", "kvpool.bench.raw_ucx"], "RAW_UCX_READY ", env)
    # a generous connect deadline: on a loaded 2-core machine a fresh store's handshake + probe can take seconds
    # shm: the pool's same-host read path (the store's mapped segment), and the same reads over UCX alone
    kw = {"endpoints_per_peer": eps, "blocks_per_message": per_msg, "connect_timeout_s": 60.0}
    t = UcxTransport(**kw, map_local_segments=cfg["mapped"])  # type: ignore[arg-type]
    t_ucx = UcxTransport(**kw, map_local_segments=False) if cfg["mapped"] else None  # type: ignore[arg-type]
    raw = RawUcxClient("127.0.0.1", int(raw_peer.info), endpoints=eps, blocks_per_message=per_msg)
    result: dict[str, Any] = {"sizes": {}, "latency": {}}
    rng = np.random.default_rng(0)
    try:
        for size in cfg["sizes"]:
            store = _Store(size, batch, env)
            try:
                result["sizes"][str(size)] = _measure_size(t, raw, store, size, batch, reps, rng, t_ucx)
                if size == cfg["latency_bytes"]:
                    reads = [BlockRead(0, 1, size)]
                    result["latency"] = _latency(
                        t, raw, store.data_address, reads[0], size, cfg["latency_iters"]
                    )
            finally:
                store.stop()
        _emit("RESULT", result)
    finally:
        raw.close()
        t.close()
        if t_ucx is not None:
            t_ucx.close()
        raw_peer.stop()


def _measure_size(
    t: Any,
    raw: Any,
    store: _Store,
    size: int,
    batch: int,
    reps: int,
    rng: np.random.Generator,
    t_ucx: Any = None,
) -> dict[str, list[float]]:
    """Seed `batch` committed blocks, then interleave pool get/put, raw get/put and memcpy `reps` times
    (and, given `t_ucx`, pool get through it: the UCX path where `t` reads from the mapped segment)."""
    from transfer import BlockRead, BlockWrite, checksum, checksums

    data = rng.integers(0, 256, (batch, size), dtype=np.uint8)
    out = np.empty_like(data)
    get_slots = list(range(batch))
    put_slots = list(range(batch, 2 * batch))
    sums = [checksum(d) for d in data]
    t.link(store.data_address)  # connect and probe before anything is timed
    store.reserve(get_slots, 1)
    res = t.write_blocks(
        store.data_address,
        [BlockWrite(s, 1, data[i], sums[i]) for i, s in enumerate(get_slots)],
        timeout_s=120,
    )
    if not all(r.ok for r in res):
        raise RuntimeError(f"seeding the store failed: {[r.error for r in res if not r.ok][:3]}")
    store.commit(get_slots, 1)
    reads = [BlockRead(s, 1, size) for s in get_slots]
    outs = [memoryview(o) for o in out]
    keys = ("get", "put", "raw_get", "raw_put", "memcpy") + (("get_ucx",) if t_ucx is not None else ())
    samples: dict[str, list[float]] = {k: [] for k in keys}
    nbytes = batch * size

    def get_with(tr: Any, key: str) -> None:
        out.fill(0)
        t0 = time.perf_counter()
        res = tr.read_blocks(store.data_address, reads, outs, timeout_s=120)
        dt = time.perf_counter() - t0
        if not all(r.ok for r in res) or not np.array_equal(out, data):
            raise RuntimeError(f"pool get failed: {[r.error for r in res if not r.ok][:3]}")
        samples[key].append(_gbps(nbytes, dt))

    def pool_get() -> None:
        get_with(t, "get")

    def pool_put() -> None:
        gen = store.put_gen
        store.reserve(put_slots, gen)
        t0 = time.perf_counter()
        sums = checksums(data)  # as `PoolClient.put_blocks` does: on the hashing threads
        writes = [BlockWrite(s, gen, data[i], sums[i]) for i, s in enumerate(put_slots)]
        res = t.write_blocks(store.data_address, writes, timeout_s=120)
        dt = time.perf_counter() - t0
        if not all(r.ok for r in res):
            raise RuntimeError(f"pool put failed: {[r.error for r in res if not r.ok][:3]}")
        store.put_gen = store.free(put_slots, gen)
        samples["put"].append(_gbps(nbytes, dt))

    def raw_get() -> None:
        t0 = time.perf_counter()
        raw.get(out)
        samples["raw_get"].append(_gbps(nbytes, time.perf_counter() - t0))

    def raw_put() -> None:
        t0 = time.perf_counter()
        raw.put(data)
        samples["raw_put"].append(_gbps(nbytes, time.perf_counter() - t0))

    def memcpy() -> None:
        t0 = time.perf_counter()
        np.copyto(out, data)
        samples["memcpy"].append(_gbps(nbytes, time.perf_counter() - t0))

    steps: list[Callable[[], None]] = [pool_get, raw_get, pool_put, raw_put, memcpy]
    if t_ucx is not None:
        t_ucx.link(store.data_address)
        steps.append(lambda: get_with(t_ucx, "get_ucx"))
    for step in steps:  # warm-up: first touch of the segment, connections, buffers
        step()
    for k in samples:
        samples[k].clear()
    for rep in range(reps):
        for step in steps if rep % 2 == 0 else steps[::-1]:
            step()
        _emit("STEP", f"{size} rep {rep}")
    return samples


def _latency(t: Any, raw: Any, addr: str, read: Any, size: int, iters: int) -> dict[str, Any]:
    out = np.empty((1, size), dtype=np.uint8)
    views = [memoryview(out[0])]
    pool, base = [], []
    for i in range(iters + 5):
        t0 = time.perf_counter()
        res = t.read_blocks(addr, [read], views, timeout_s=30)
        t1 = time.perf_counter()
        raw.get(out)
        t2 = time.perf_counter()
        if not res[0].ok:
            raise RuntimeError(f"latency read failed: {res[0].error}")
        if i >= 5:
            pool.append((t1 - t0) * 1e6)
            base.append((t2 - t1) * 1e6)
    return {
        "block_bytes": size,
        "iters": iters,
        "pool_p50_us": float(np.percentile(pool, 50)),
        "pool_p99_us": float(np.percentile(pool, 99)),
        "raw_ucx_p50_us": float(np.percentile(base, 50)),
        "raw_ucx_p99_us": float(np.percentile(base, 99)),
    }


# ---------------------------------------------------------------- ucx_perftest


def perftest_binary() -> tuple[Path, Path] | None:
    """(ucx_perftest, its lib dir) from the libucx wheel, or None."""
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    return (binary, root / "lib") if binary.exists() else None


def run_perftest(transport: str, size: int, iters: int) -> float | None:
    """`tag_bw` between a server and a client on 127.0.0.1; overall GB/s (None if it cannot run)."""
    found = perftest_binary()
    if found is None:
        return None
    binary, lib = found
    env = dict(
        os.environ,
        **TRANSPORTS[transport],
        UCX_WARN_UNUSED_ENV_VARS="n",
        LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    )
    port = _free_port()
    args = ["-t", "tag_bw", "-s", str(size), "-n", str(iters), "-p", str(port)]
    server = subprocess.Popen(
        [str(binary), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):
            time.sleep(0.1)
            client = subprocess.run(
                [str(binary), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=120
            )
            if client.returncode == 0:
                break
        else:
            return None
        for line in client.stdout.splitlines()[::-1]:
            fields = line.replace("Final:", "").split()
            if len(fields) == 8:
                return float(fields[5]) * MIB / 1e9  # "overall" bandwidth, MB/s with MB = 2^20
        return None
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)


# ---------------------------------------------------------------- Mooncake (optional peer)


def mooncake_unavailable() -> str | None:
    """None when Mooncake's store can run here, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not measured"
        return f"mooncake-transfer-engine-non-cuda not importable: {type(exc).__name__}: {exc}"
    if _mooncake_master() is None:
        return "mooncake_master binary not found"
    return None


def _mooncake_master() -> str | None:
    found = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    return found if Path(found).exists() else None


def _mooncake_setup(store: Any, meta: str, master: str, segment: int, local_buf: int) -> None:
    rc = store.setup("127.0.0.1", meta, segment, local_buf, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup failed: {rc}")


def _mooncake_storage(meta: str, master: str, segment: int) -> None:
    """A Mooncake storage process: contributes `segment` bytes, then waits to be killed."""
    import threading

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    _mooncake_setup(store, meta, master, segment, 16 * MIB)
    print("MOONCAKE_READY", flush=True)
    threading.Event().wait()


def _mooncake_client(cfg: dict[str, Any]) -> None:
    """Batch put/get of `batch` values per size through a client with no segment of its own."""
    from mooncake.store import MooncakeDistributedStore

    batch, reps, meta, master = cfg["batch"], cfg["reps"], cfg["meta"], cfg["master"]
    biggest = max(cfg["sizes"]) * batch
    store = MooncakeDistributedStore()
    _mooncake_setup(store, meta, master, 0, biggest + 64 * MIB)
    buf = np.zeros(biggest, dtype=np.uint8)
    dst = np.zeros(biggest, dtype=np.uint8)
    for b in (buf, dst):
        if store.register_buffer(b.ctypes.data, b.nbytes) != 0:
            raise RuntimeError("mooncake register_buffer failed")
    result: dict[str, Any] = {}
    for size in cfg["sizes"]:
        nbytes = batch * size
        buf[:nbytes] = np.random.default_rng(size).integers(0, 256, nbytes, dtype=np.uint8)
        ptrs = [buf.ctypes.data + i * size for i in range(batch)]
        dptrs = [dst.ctypes.data + i * size for i in range(batch)]
        sizes = [size] * batch
        samples: dict[str, list[float]] = {"put": [], "get": []}
        for rep in range(reps + 1):
            keys = [f"b{size}-{rep}-{i}" for i in range(batch)]
            t0 = time.perf_counter()
            rcs = store.batch_put_from(keys, ptrs, sizes)
            t1 = time.perf_counter()
            if any(rc != 0 for rc in rcs):
                raise RuntimeError(f"mooncake put failed: {[rc for rc in rcs if rc != 0][:3]}")
            dst[:nbytes] = 0
            t2 = time.perf_counter()
            got = store.batch_get_into(keys, dptrs, sizes)
            t3 = time.perf_counter()
            if any(g != size for g in got) or not np.array_equal(dst[:nbytes], buf[:nbytes]):
                raise RuntimeError(f"mooncake get failed: {list(got)[:3]}")
            store.batch_remove(keys) if hasattr(store, "batch_remove") else None
            if rep:  # rep 0 warms up
                samples["put"].append(_gbps(nbytes, t1 - t0))
                samples["get"].append(_gbps(nbytes, t3 - t2))
            _emit("STEP", f"mooncake {size} rep {rep}")
        result[str(size)] = samples
    _emit("RESULT", result)
    store.close()


def run_mooncake(sizes: Sequence[int], batch: int, reps: int, on_step: Callable[[], None]) -> dict[str, Any]:
    """Mooncake batch put/get per size over its tcp protocol: {"samples": {...}} or {"error": why}."""
    why = mooncake_unavailable()
    if why is not None:
        return {"error": why}
    master_bin = _mooncake_master()
    assert master_bin is not None
    rpc_port, http_port = _free_port(), _free_port()
    meta = f"http://127.0.0.1:{http_port}/metadata"
    master_addr = f"127.0.0.1:{rpc_port}"
    env = dict(os.environ, MC_LOG_LEVEL="WARNING")
    log = tempfile.NamedTemporaryFile(prefix="kvpool-bench-mc-", suffix=".log", delete=False)  # noqa: SIM115
    master = subprocess.Popen(
        [
            master_bin, f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http_port}",
            f"--metrics_port={_free_port()}",
        ],
        stdout=log, stderr=log, env=env,
    )  # fmt: skip
    storage: _Child | None = None
    try:
        time.sleep(1.0)
        # puts stay leased a while, so removed values free no space: room for every rep of every size
        segment = (reps + 2) * sum(sizes) * batch + 256 * MIB
        me = [sys.executable, "-m", "kvpool.bench.transfer_bench"]
        storage = _Child([*me, "mooncake-storage", meta, master_addr, str(segment)], "MOONCAKE_READY", env)
        cfg = {"sizes": list(sizes), "batch": batch, "reps": reps, "meta": meta, "master": master_addr}
        result = _run_worker([*me, "mooncake-client", json.dumps(cfg)], env, on_step)
        return {"samples": result}
    except Exception as exc:  # noqa: BLE001 - an optional peer: record why and go on
        return {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
    finally:
        if storage is not None:
            storage.stop()
        master.kill()
        master.wait(10)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


# ---------------------------------------------------------------- parent


def ucx_tag_lanes(log: str) -> list[str]:
    """The UCX lanes of tagged messages in a `UCX_LOG_LEVEL=info` log, e.g. "sysv/memory tcp/lo"."""
    return sorted(set(re.findall(r"intra-node cfg#\d+ tag\(([^)]*)\)", log)))


def _run_worker(
    args: Sequence[str], env: dict[str, str], on_step: Callable[[], None], log: list[str] | None = None
) -> Any:
    """Run a worker, calling `on_step` per STEP line; returns its RESULT payload (other lines into `log`)."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        result = None
        for line in proc.stdout:
            if line.startswith("STEP "):
                on_step()
            elif line.startswith("RESULT "):
                result = json.loads(line[7:])
            elif log is not None:  # UCX logs to stdout
                log.append(line)
        proc.wait()
        err.seek(0)
        if proc.returncode != 0 or result is None:
            raise RuntimeError(
                f"worker failed ({proc.returncode}): {err.read().decode(errors='replace')[-2000:]}"
            )
        return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired_ratio(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Median over repetitions of x_i / y_i. Each rep measures pool and raw back to back (`_measure_size`),
    so the ratio of a pair cancels the machine's drift between reps, which the ratio of medians does not."""
    ratios = [x / y for x, y in zip(xs, ys, strict=False) if y]
    return _median(ratios)


def build_report(
    measured: dict[str, Any], perftest: dict[str, dict[int, list[float]]], mooncake: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records (one per transport, size, op) and the summary with the target ratios."""
    records: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    mc = mooncake.get("samples") or {}
    for transport, res in measured.items():
        for size_key, s in res["sizes"].items():
            size = int(size_key)
            memcpy = _median(s["memcpy"])
            pt = _median(perftest.get(transport, {}).get(size, []))
            for op in ("get", "put"):
                pool, raw = _median(s[op]), _median(s[f"raw_{op}"])
                mcv = _median(mc.get(size_key, {}).get(op, [])) if transport == "tcp" else None
                records.append(
                    {
                        "transport": transport, "block_bytes": size, "op": op, "gb_per_s": pool,
                        "raw_ucx_gb_per_s": raw, "perftest_gb_per_s": pt, "memcpy_gb_per_s": memcpy,
                        "mooncake_gb_per_s": mcv, "samples_gb_per_s": s[op], "raw_ucx_samples_gb_per_s": s[f"raw_{op}"],
                        "pool_over_raw": _paired_ratio(s[op], s[f"raw_{op}"]),
                        "path": "mapped" if op == "get" and "get_ucx" in s else "ucx",
                        "ucx_path_gb_per_s": _median(s["get_ucx"]) if op == "get" and "get_ucx" in s else None,
                    }
                )  # fmt: skip
                r = records[-1]["pool_over_raw"]
                targets.append(
                    {"target": f"{transport} {op} >= 85% raw UCX", "block_bytes": size, "ratio": r,
                     "met": r is not None and r >= TARGET_RAW_RATIO}
                )  # fmt: skip
                if op == "get" and transport == "tcp":
                    r = _ratio(pool, mcv)
                    targets.append(
                        {"target": "tcp get >= Mooncake get", "block_bytes": size, "ratio": r,
                         "met": None if r is None else r >= 1.0}
                    )  # fmt: skip
                if op == "get" and transport == "shm":
                    r = _paired_ratio(s["get"], s["memcpy"])
                    targets.append(
                        {"target": "shm get >= 50% memcpy", "block_bytes": size, "ratio": r,
                         "met": r is not None and r >= TARGET_MEMCPY_RATIO}
                    )  # fmt: skip
    summary = {
        "targets": targets,
        "all_targets_met": all(t["met"] is not False for t in targets),
        "latency": {tr: res.get("latency") for tr, res in measured.items()},
        "ucx_tag_lanes": {tr: res.get("ucx_tag_lanes") for tr, res in measured.items()},
        "mooncake": {"measured": "samples" in mooncake, "error": mooncake.get("error")},
    }
    return records, summary


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _size_name(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


def print_tables(console: Any, records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="data plane throughput (GB/s, medians)")
    cols = ("transport", "block", "op", "pool", "pool, UCX path", "raw UCX", "pool/raw", "perftest", "memcpy")
    for col in (*cols, "Mooncake"):
        table.add_column(col, justify="right")
    for r in records:
        op = r["op"] + (" (mapped)" if r.get("path") == "mapped" else "")
        table.add_row(
            r["transport"], _size_name(r["block_bytes"]), op, _fmt(r["gb_per_s"]), _fmt(r.get("ucx_path_gb_per_s")),
            _fmt(r["raw_ucx_gb_per_s"]), _fmt(r["pool_over_raw"], ".0%"),
            _fmt(r["perftest_gb_per_s"]), _fmt(r["memcpy_gb_per_s"]), _fmt(r["mooncake_gb_per_s"]),
        )  # fmt: skip
    console.print(table)
    lat = Table(title="one-block read latency (µs)")
    for col in ("transport", "block", "pool p50", "pool p99", "raw p50", "raw p99"):
        lat.add_column(col, justify="right")
    for tr, v in summary["latency"].items():
        if v:
            lat.add_row(
                tr, _size_name(v["block_bytes"]), _fmt(v["pool_p50_us"], ".0f"), _fmt(v["pool_p99_us"], ".0f"),
                _fmt(v["raw_ucx_p50_us"], ".0f"), _fmt(v["raw_ucx_p99_us"], ".0f"),
            )  # fmt: skip
    console.print(lat)
    for t in summary["targets"]:
        mark = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}[
            t["met"]
        ]
        console.print(
            f"  {t['target']:<28} {_size_name(t['block_bytes']):>7}: {_fmt(t['ratio'], '.0%'):>5}  {mark}"
        )
    console.print(f"UCX lanes seen: {summary['ucx_tag_lanes']}")
    if summary["mooncake"]["error"]:
        console.print(f"[yellow]Mooncake not measured: {summary['mooncake']['error']}[/yellow]")


def plot_report(records: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = sorted({r["transport"] for r in records}, key=list(TRANSPORTS).index)
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4.5), squeeze=False)
    series = [
        ("get", "gb_per_s", "pool get", "C0", "-o"), ("put", "gb_per_s", "pool put", "C1", "-o"),
        ("get", "raw_ucx_gb_per_s", "raw ucxx get", "C0", "--x"), ("put", "raw_ucx_gb_per_s", "raw ucxx put", "C1", "--x"),
        ("get", "perftest_gb_per_s", "ucx_perftest tag_bw", "C2", ":s"), ("get", "memcpy_gb_per_s", "memcpy", "C7", ":^"),
        ("get", "mooncake_gb_per_s", "Mooncake get", "C3", "-.d"), ("put", "mooncake_gb_per_s", "Mooncake put", "C4", "-.d"),
        ("get", "ucx_path_gb_per_s", "pool get, UCX path (not mapped)", "C5", "-v"),
    ]  # fmt: skip
    for ax, tr in zip(axes[0], transports, strict=True):
        for op, key, label, color, style in series:
            pts = sorted(
                (r["block_bytes"], r[key])
                for r in records
                if r["transport"] == tr and r["op"] == op and r.get(key) is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"UCX {tr}: batch of blocks, 2 processes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[], None]]:
    from tqdm import tqdm

    with tqdm(total=total, desc="bench transfer", unit="step", file=sys.stderr) as bar:
        yield lambda: bar.update(1)


def run_transfer_bench(
    *,
    json_out: Path | None = None,
    plot_out: Path | None = None,
    quick: bool = False,
    reps: int | None = None,
    batch: int | None = None,
    endpoints: int | None = None,
    blocks_per_message: int | None = None,
    mooncake: bool = True,
) -> dict[str, Any]:
    """Measure everything (see the module docstring), print the tables, write the report and the plot."""
    from rich.console import Console

    from kvpool.bench.report import write_report

    sizes = list(QUICK_SIZES if quick else FULL_SIZES)
    batch = batch or (8 if quick else 256)
    reps = reps or (2 if quick else 3)
    eps = endpoints or 4
    per_msg = blocks_per_message or max(1, min(64, batch // eps))
    cfg = {
        "sizes": sizes, "batch": batch, "reps": reps, "endpoints": eps, "blocks_per_message": per_msg,
        "latency_bytes": 64 * KIB, "latency_iters": 10 if quick else 200,
    }  # fmt: skip
    pt_reps = 1 if quick else 3
    mc_on = mooncake and not quick and mooncake_unavailable() is None
    total = len(TRANSPORTS) * len(sizes) * (reps + pt_reps) + (len(sizes) * (reps + 1) if mc_on else 0)
    measured: dict[str, Any] = {}
    perftest: dict[str, dict[int, list[float]]] = {}
    mc: dict[str, Any] = {"error": "skipped (--quick or --no-mooncake)"} if not mc_on else {}
    with _progress(total) as step:
        for tr, tr_env in TRANSPORTS.items():
            env = dict(os.environ, **tr_env, UCX_LOG_LEVEL="info")
            wcfg = {**cfg, "mapped": tr == "shm"}  # tcp: the network path (as from another host)
            args = [sys.executable, "-m", "kvpool.bench.transfer_bench", "worker", json.dumps(wcfg)]
            log: list[str] = []
            measured[tr] = _run_worker(args, env, step, log)
            measured[tr]["ucx_tag_lanes"] = ucx_tag_lanes("".join(log))
            perftest[tr] = {}
            for size in sizes:
                iters = max(100, min(5000, (64 if quick else 512) * MIB // size))
                perftest[tr][size] = []
                for _ in range(pt_reps):
                    v = run_perftest(tr, size, iters)
                    if v is not None:
                        perftest[tr][size].append(v)
                    step()
        if mc_on:
            mc = run_mooncake(sizes, batch, reps, step)
        elif mooncake and not quick:
            mc = {"error": mooncake_unavailable()}
    records, summary = build_report(measured, perftest, mc)
    summary["config"] = {k: v for k, v in cfg.items()}
    summary["transports_env"] = TRANSPORTS
    print_tables(Console(), records, summary)
    report = write_report(json_out, "transfer", records, summary)
    if plot_out is not None:
        plot_report(records, plot_out)
    return report


def main(argv: Sequence[str]) -> None:
    if argv[0] == "worker":
        _worker(json.loads(argv[1]))
    elif argv[0] == "mooncake-storage":
        _mooncake_storage(argv[1], argv[2], int(argv[3]))
    elif argv[0] == "mooncake-client":
        _mooncake_client(json.loads(argv[1]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
