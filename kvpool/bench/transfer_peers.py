"""The peers of `kvpool bench transfer` outside kvpool: C `ucx_perftest` from the libucx wheel and
Mooncake's store (`mooncake_master` with its HTTP metadata server, one storage process, one client; `tcp`
protocol) when `mooncake-transfer-engine-non-cuda` is installed. The Mooncake storage and client run as
`python -m kvpool.bench.transfer_peers mooncake-storage|mooncake-client ...`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.procs import MIB, Child, emit, free_port, gbps, run_worker


def perftest_binary() -> tuple[Path, Path] | None:
    """(ucx_perftest, its lib dir) from the libucx wheel, or None."""
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    return (binary, root / "lib") if binary.exists() else None


def run_perftest(transport_env: dict[str, str], size: int, iters: int) -> float | None:
    """`tag_bw` between a server and a client on 127.0.0.1; overall GB/s (None if it cannot run)."""
    found = perftest_binary()
    if found is None:
        return None
    binary, lib = found
    env = dict(
        os.environ,
        **transport_env,
        UCX_WARN_UNUSED_ENV_VARS="n",
        LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    )
    port = free_port()
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
                samples["put"].append(gbps(nbytes, t1 - t0))
                samples["get"].append(gbps(nbytes, t3 - t2))
            emit("STEP", f"mooncake {size} rep {rep}")
        result[str(size)] = samples
    emit("RESULT", result)
    store.close()


def run_mooncake(sizes: Sequence[int], batch: int, reps: int, on_step: Callable[[], None]) -> dict[str, Any]:
    """Mooncake batch put/get per size over its tcp protocol: {"samples": {...}} or {"error": why}."""
    why = mooncake_unavailable()
    if why is not None:
        return {"error": why}
    master_bin = _mooncake_master()
    assert master_bin is not None
    rpc_port, http_port = free_port(), free_port()
    meta = f"http://127.0.0.1:{http_port}/metadata"
    master_addr = f"127.0.0.1:{rpc_port}"
    env = dict(os.environ, MC_LOG_LEVEL="WARNING")
    log = tempfile.NamedTemporaryFile(prefix="kvpool-bench-mc-", suffix=".log", delete=False)  # noqa: SIM115
    master = subprocess.Popen(
        [
            master_bin,
            f"--rpc_port={rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http_port}",
            f"--metrics_port={free_port()}",
        ],
        stdout=log,
        stderr=log,
        env=env,
    )
    storage: Child | None = None
    try:
        time.sleep(1.0)
        # puts stay leased a while, so removed values free no space: room for every rep of every size
        segment = (reps + 2) * sum(sizes) * batch + 256 * MIB
        me = [sys.executable, "-m", "kvpool.bench.transfer_peers"]
        storage = Child([*me, "mooncake-storage", meta, master_addr, str(segment)], "MOONCAKE_READY", env)
        cfg = {"sizes": list(sizes), "batch": batch, "reps": reps, "meta": meta, "master": master_addr}
        result = run_worker([*me, "mooncake-client", json.dumps(cfg)], env, on_step)
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


def main(argv: Sequence[str]) -> None:
    if argv[0] == "mooncake-storage":
        _mooncake_storage(argv[1], argv[2], int(argv[3]))
    elif argv[0] == "mooncake-client":
        _mooncake_client(json.loads(argv[1]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
