"""A master holding N resident blocks, filled only through its real paths (for `kvpool bench master` and
the restart-at-scale test).

`ScaleCluster` runs one `kvpool master` on a fixed 127.0.0.1 port (so it can be killed and restarted in
place) and `num_stores` `kvpool store` processes with a tiny layout (`TINY_LAYOUT`, 4-byte blocks: what is
measured is the master, not the data). `fill` publishes the conversation trace's tree under salted
namespaces (`master_scale_work`) with `PoolClient.put_blocks` (Reserve → UCX write → Commit) from
`writers` processes, one namespace at a time each. Block i's bytes are the first bytes of its hash, so a
reader can tell a block's own bytes from any other's (`block_bytes`).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from kvpool.bench.master_scale_work import TreePuts, replica_puts
from kvpool.client import MasterClient
from kvpool.master.procs import Proc, start_master, start_store
from kvpool.types import KVLayout

TINY_LAYOUT = "kv1:float16:b1:l1:h1:d1"
MODEL = "bench-scale"
FILL_FRACTION = 0.7
"""Stores are sized so the fill uses this much of their slots (below the master's watermarks)."""


MASTER_BYTES_PER_BLOCK = 240
"""The master's peak bytes per resident block a run is planned for (the target `peak_bytes_per_block`)."""
STORE_BYTES_PER_SLOT = 110
"""A store's slot table and columns per slot (kvpool/store/slots.py, slot_columns.py) plus a tiny block."""
BASE_BYTES = 1 << 30
"""The processes themselves (interpreters, gRPC, UCX, the clients' trees), all together, about."""


def memory_estimate_bytes(num_blocks: int, extra_blocks: int = 0) -> int:
    """RAM a `kvpool bench master` run of `num_blocks` needs at its peak, all processes together: the
    master at `MASTER_BYTES_PER_BLOCK`, the stores' slots (sized for the blocks at `FILL_FRACTION`) at
    `STORE_BYTES_PER_SLOT`, and `BASE_BYTES` (20 M blocks: about 9.6 GB)."""
    slots = (num_blocks + extra_blocks) / FILL_FRACTION
    return int(num_blocks * MASTER_BYTES_PER_BLOCK + slots * STORE_BYTES_PER_SLOT + BASE_BYTES)


def block_bytes(block_hash: bytes, nbytes: int) -> np.ndarray:
    """The bytes the fill writes for a block: its hash repeated to `nbytes` (uint8)."""
    reps = -(-nbytes // len(block_hash))
    return np.frombuffer((block_hash * reps)[:nbytes], dtype=np.uint8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vm_kib(pid: int, field_name: str) -> int:
    """`VmRSS` / `VmHWM` (peak) of process `pid` from /proc, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field_name} for pid {pid}")


@dataclass
class ScaleCluster:
    """A master and its stores for N blocks. Use as a context manager (kills every process on exit)."""

    num_blocks: int
    num_stores: int = 4
    layout: str = TINY_LAYOUT
    master_args: tuple[str, ...] = ()
    store_args: tuple[str, ...] = ()
    extra_blocks: int = 0
    port: int = field(default_factory=free_port)
    master: Proc | None = None
    stores: list[Proc] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def block_nbytes(self) -> int:
        return KVLayout.from_fingerprint(self.layout).block_nbytes

    def __enter__(self) -> ScaleCluster:
        self.start_master()
        slots = int((self.num_blocks + self.extra_blocks) / self.num_stores / FILL_FRACTION) + 1024
        for i in range(self.num_stores):
            self.stores.append(
                start_store(
                    self.address,
                    f"scale-s{i}",
                    segment=str(slots * self.block_nbytes),
                    layout=self.layout,
                    extra=self.store_args,
                )
            )
        self.wait_stores()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.stores:
            s.kill()
        if self.master is not None:
            self.master.kill()

    def start_master(self) -> None:
        """(Re)start the master on this cluster's port."""
        self.master = start_master(
            "--metrics-port", "0", *self.master_args, port=self.port, layout=self.layout
        )

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.kill()

    def wait_stores(self, timeout_s: float = 120.0) -> None:
        """Until every store is registered, alive and holds slots."""
        with MasterClient(self.address) as c:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                up = [n for n in c.list_nodes() if n.alive and n.num_slots > 0 and n.node.role == "store"]
                if len(up) >= self.num_stores:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"{self.num_stores} stores did not register within {timeout_s} s")

    def register(self, salts: list[str]) -> list[bytes]:
        """Register (again) the namespace of each salt; returns their digests."""
        with MasterClient(self.address) as c:
            return [c.register_namespace(MODEL, "v1", self.layout, cache_salt=s)[0] for s in salts]

    def master_rss_bytes(self) -> int:
        assert self.master is not None
        return vm_kib(self.master.popen.pid, "VmRSS") * 1024

    def master_peak_bytes(self) -> int:
        assert self.master is not None
        return vm_kib(self.master.popen.pid, "VmHWM") * 1024

    def master_cpu_s(self) -> float:
        assert self.master is not None
        t = psutil.Process(self.master.popen.pid).cpu_times()
        return float(t.user + t.system)


def _writer(address: str, block_nbytes: int, trace: Path, jobs: list[tuple[bytes, int]], out: Any) -> None:
    """One writer process: publish each (namespace, blocks) job's share of the tree; puts the blocks
    committed (and raises on a short put: the fill must be exact)."""
    from kvpool.client import PoolClient
    from transfer import UcxTransport

    tree = TreePuts.from_trace(trace)
    transport = UcxTransport()
    done = 0
    try:
        with PoolClient(address, transport, block_nbytes=block_nbytes) as pc:
            for ns, limit in jobs:
                for put in replica_puts(tree, ns, limit):
                    data = [block_bytes(h, block_nbytes) for h in put.hashes]
                    r = pc.put_blocks(ns, put.parent, put.hashes, data)
                    if r.num_committed + r.num_existing != len(put.hashes):
                        raise RuntimeError(f"a put of {len(put.hashes)} blocks committed {r.num_committed}")
                    done += r.num_committed
    except Exception as exc:  # reported to the parent, which raises
        out.put(f"error: {type(exc).__name__}: {exc}")
        return
    finally:
        transport.close()
    out.put(done)


@dataclass
class Fill:
    """What `fill` made resident: `namespaces[k]` (salt `salts[k]`) holds `resident[k]` blocks."""

    tree: TreePuts
    salts: list[str]
    namespaces: list[bytes]
    resident: list[int]
    seconds: float
    calls: int = 0  # Reserve+Commit pairs (0: not counted)

    @property
    def num_blocks(self) -> int:
        return sum(self.resident)


def _plan(
    cluster: ScaleCluster, trace: Path, num_blocks: int, workers: int
) -> tuple[TreePuts, list[int], list[str], list[bytes], list[list[tuple[bytes, int]]]]:
    """The tree of `trace` in namespaces r0, r1, ... (the last cut short) until `num_blocks`: (tree, blocks
    per namespace, salts, namespaces registered, each worker's (namespace, blocks) jobs)."""
    tree = TreePuts.from_trace(trace)
    per = tree.num_blocks
    resident = [min(per, num_blocks - k * per) for k in range(-(-num_blocks // per))]
    salts = [f"r{k}" for k in range(len(resident))]
    namespaces = cluster.register(salts)
    jobs: list[list[tuple[bytes, int]]] = [[] for _ in range(min(workers, len(resident)))]
    for k, (ns, n) in enumerate(zip(namespaces, resident, strict=True)):
        jobs[k % len(jobs)].append((ns, n))
    return tree, resident, salts, namespaces, jobs


def fill_without_bytes(
    cluster: ScaleCluster, trace: Path, num_blocks: int, *, clients: int = 8, progress: bool = False
) -> Fill:
    """`fill` through Reserve + Commit only (`master_publish`), for stores started `--metadata-only`: each
    put of the tree (cut into chains of at most 64 blocks) is one Reserve and one Commit of the master's
    gRPC service, from `clients` processes (one namespace at a time each)."""
    from kvpool.bench.master_publish import TreeWork, publish

    tree, resident, salts, namespaces, jobs = _plan(cluster, trace, num_blocks, clients)
    got = publish(cluster.address, [TreeWork(trace, j) for j in jobs], progress=progress)
    if got.blocks != num_blocks:
        raise RuntimeError(f"fill committed {got.blocks} blocks, not {num_blocks}")
    return Fill(tree, salts, namespaces, resident, got.seconds, got.calls)


def fill(
    cluster: ScaleCluster, trace: Path, num_blocks: int, *, writers: int = 3, progress: bool = False
) -> Fill:
    """Publish `num_blocks` blocks with bytes (`PoolClient.put_blocks`): the tree of `trace` in namespaces
    r0, r1, ... (the last cut short)."""
    tree, resident, salts, namespaces, jobs = _plan(cluster, trace, num_blocks, writers)
    ctx = mp.get_context("spawn")  # no fork: the parent holds gRPC channels
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(cluster.address, cluster.block_nbytes, trace, j, out)) for j in jobs
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    results: list[int | str] = []
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=5.0))
        except queue.Empty:
            if sum(p.exitcode not in (None, 0) for p in procs) > 0:  # died without a word (a crash)
                raise RuntimeError("a fill writer died") from None
            continue
        if progress:
            print(f"  writer done after {time.perf_counter() - t0:.0f} s: {results[-1]}", flush=True)
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"fill failed: {errors[0]}")
    done = sum(r for r in results if isinstance(r, int))
    if done != num_blocks:
        raise RuntimeError(f"fill committed {done} blocks, not {num_blocks}")
    return Fill(tree, salts, namespaces, resident, seconds)
