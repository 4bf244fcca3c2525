"""`kvpool bench transfer`: the data plane against raw UCX, `ucx_perftest`, memcpy and Mooncake.

Per UCX transport (`tcp`: `UCX_TLS=tcp`; `shm`: `UCX_TLS=sm,self,tcp` with `UCX_MM_ERROR_HANDLING=y`) one
worker process (`python -m kvpool.bench.transfer_bench worker CFG`, the transport fixed by its
environment) runs, per block size, a real `kvpool store` process and a raw-UCX peer
(`kvpool.bench.raw_ucx`), and measures, interleaved and repeated: pool batch `get` (checksums verified)
and `put` (checksummed, reserved slots) of `batch` blocks through `UcxTransport`; raw ucxx tagged
send/recv of the same blocks with the same endpoints and message split, without and with the pool's
xxh3 checksums (`raw_ucx.py`: what the end-to-end checksum costs by itself); a numpy copy of the same
bytes; and single-block read latency. The parent runs the C `ucx_perftest` (`tag_bw`, same message size) from
the libucx wheel per transport and size, and Mooncake's store (`mooncake_master` with its HTTP metadata
server, one storage process, one client; `tcp` protocol) when `mooncake-transfer-engine-non-cuda` is
installed. Which UCX transports really carried the bytes is read from the raw peer's `UCX_LOG_LEVEL=info`
line (`intra-node cfg#0 tag(...)`). Medians over the repeats are reported; pool/raw and pool/memcpy are
medians of the per-repeat ratios (each repeat measures them back to back). The peers outside kvpool are in
`transfer_peers.py`, the report (targets, tables, plot) in `transfer_report.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.bench.procs import KIB, MIB, Child, emit, gbps, run_worker
from kvpool.bench.transfer_peers import mooncake_unavailable, run_mooncake, run_perftest
from kvpool.bench.transfer_report import build_report, plot_report, print_tables

FULL_SIZES = (64 * KIB, 1 * MIB, 4 * MIB)
QUICK_SIZES = (64 * KIB,)
TRANSPORTS = {
    "tcp": {"UCX_TLS": "tcp"},
    "shm": {"UCX_TLS": "sm,self,tcp", "UCX_MM_ERROR_HANDLING": "y"},
}
NS = b"B" * 16


def layout_for(block_bytes: int) -> str:
    """A KV layout fingerprint whose blocks are `block_bytes` long (a multiple of 128)."""
    if block_bytes % 128:
        raise ValueError("block sizes must be multiples of 128 B")
    return f"kv1:float32:b16:l1:h1:d{block_bytes // 128}"


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


# ---------------------------------------------------------------- worker (one UCX transport)


class _Store:
    """A `kvpool store` child with `batch` committed blocks (slots 0..batch-1) and `batch` put slots."""

    def __init__(self, block_bytes: int, batch: int, env: dict[str, str]) -> None:
        from kvpool.rpc.server import channel
        from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

        segment = 2 * batch * block_bytes
        self.child = Child(
            [
                sys.executable,
                "-m",
                "kvpool.cli.main",
                "store",
                "--listen",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--data-port",
                "0",
                "--segment-size",
                str(segment),
                "--layout",
                layout_for(block_bytes),
                "--node-id",
                f"bench-{block_bytes}",
            ],
            "KVPOOL_READY ",
            env,
        )
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


def _worker(cfg: dict[str, Any]) -> None:
    """Measure one UCX transport (fixed by this process's environment); emits STEP and RESULT lines."""
    from kvpool.bench.raw_ucx import RawUcxClient
    from transfer import BlockRead, UcxTransport
    from transfer.ucx_runtime import apply_ucx_env_defaults

    apply_ucx_env_defaults()
    env = dict(os.environ)
    batch, reps, eps, per_msg = cfg["batch"], cfg["reps"], cfg["endpoints"], cfg["blocks_per_message"]
    env.pop("UCX_LOG_LEVEL", None)  # only this process logs its endpoint configurations (see _run_worker)
    raw_peer = Child([sys.executable, "-m", "kvpool.bench.raw_ucx"], "RAW_UCX_READY ", env)
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
        emit("RESULT", result)
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
    keys = ["get", "put", "raw_get", "raw_put", "raw_get_xxh3", "raw_put_xxh3", "memcpy"]
    keys += ["get_ucx"] if t_ucx is not None else []
    samples: dict[str, list[float]] = {k: [] for k in keys}
    nbytes = batch * size

    def get_with(tr: Any, key: str) -> None:
        out.fill(0)
        t0 = time.perf_counter()
        res = tr.read_blocks(store.data_address, reads, outs, timeout_s=120)
        dt = time.perf_counter() - t0
        if not all(r.ok for r in res) or not np.array_equal(out, data):
            raise RuntimeError(f"pool get failed: {[r.error for r in res if not r.ok][:3]}")
        samples[key].append(gbps(nbytes, dt))

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
        samples["put"].append(gbps(nbytes, dt))

    def raw_get(verify: bool = False) -> None:
        t0 = time.perf_counter()
        raw.get(out, verify=verify)
        samples["raw_get_xxh3" if verify else "raw_get"].append(gbps(nbytes, time.perf_counter() - t0))

    def raw_put(verify: bool = False) -> None:
        t0 = time.perf_counter()
        raw.put(data, verify=verify)
        samples["raw_put_xxh3" if verify else "raw_put"].append(gbps(nbytes, time.perf_counter() - t0))

    def memcpy() -> None:
        t0 = time.perf_counter()
        np.copyto(out, data)
        samples["memcpy"].append(gbps(nbytes, time.perf_counter() - t0))

    steps: list[Callable[[], None]] = [
        pool_get,
        raw_get,
        lambda: raw_get(verify=True),
        pool_put,
        raw_put,
        lambda: raw_put(verify=True),
        memcpy,
    ]
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
        emit("STEP", f"{size} rep {rep}")
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


# ---------------------------------------------------------------- parent


def ucx_tag_lanes(log: str) -> list[str]:
    """The UCX lanes of tagged messages in a `UCX_LOG_LEVEL=info` log, e.g. "sysv/memory tcp/lo"."""
    return sorted(set(re.findall(r"intra-node cfg#\d+ tag\(([^)]*)\)", log)))


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
    from kvpool.console import console
    from kvpool.report import write_report

    sizes = list(QUICK_SIZES if quick else FULL_SIZES)
    batch = batch or (8 if quick else 256)
    reps = reps or (2 if quick else 3)
    eps = endpoints or 4
    per_msg = blocks_per_message or max(1, min(64, batch // eps))
    cfg = {
        "sizes": sizes,
        "batch": batch,
        "reps": reps,
        "endpoints": eps,
        "blocks_per_message": per_msg,
        "latency_bytes": 64 * KIB,
        "latency_iters": 10 if quick else 200,
    }
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
            measured[tr] = run_worker(args, env, step, log)
            measured[tr]["ucx_tag_lanes"] = ucx_tag_lanes("".join(log))
            perftest[tr] = {}
            for size in sizes:
                iters = max(100, min(5000, (64 if quick else 512) * MIB // size))
                perftest[tr][size] = []
                for _ in range(pt_reps):
                    v = run_perftest(tr_env, size, iters)
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
    print_tables(console(), records, summary)
    report = write_report(json_out, "transfer", records, summary)
    if plot_out is not None:
        plot_report(records, plot_out)
    return report


def main(argv: Sequence[str]) -> None:
    if argv[0] == "worker":
        _worker(json.loads(argv[1]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
