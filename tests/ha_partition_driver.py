"""The scenario of tests/test_ha_partition.py, run inside the "client" network namespace (where master B and
the store live), started by the test as `ip netns exec NS python -m tests.ha_partition_driver ...`.

etcd runs in its own namespace, master A in another; A leads first. A writer puts a new block every 0.1 s
through the list "A,B". Then A's route to etcd is blackholed (A still reaches the store and B): A steps
down (deposed), B leads with a higher epoch. Checked: a put through A alone is refused; an order carrying
A's epoch sent straight to the store is refused as fenced, counted by the store's
`kvpool_store_fenced_orders_total`, and allocates nothing; the store's leader epoch gauge is B's; the
store's slot table (its Inventory) holds every block the writer committed exactly once, each in its own
slot, and each reads back bit-exact; with the route restored, A stands by. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

TTL_S = 3


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds it took `cond` to hold; `RuntimeError` after `timeout_s`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def store_metrics(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


class Writer:
    """Puts one new block every 0.1 s through `masters`; `committed` maps hash -> the bytes written."""

    def __init__(self, masters: str, transport: Any, block_nbytes: int, block_size: int) -> None:
        from kvpool.client import MasterClient, PoolClient
        from kvpool.master.procs import LAYOUT

        self.master = MasterClient(masters, timeout_s=1.0)
        self.pool = PoolClient(masters, transport, block_nbytes=block_nbytes, timeout_s=1.0)
        self.layout, self.block_nbytes, self.block_size = LAYOUT, block_nbytes, block_size
        self.committed: dict[bytes, bytes] = {}
        self.failed: list[str] = []
        self.ok_times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def namespace(self) -> bytes:
        return self.master.register_namespace("partition", "v1", self.layout)[0]

    def _run(self) -> None:
        from kvpool.hashing import hash_blocks

        k = 0
        while not self._stop.wait(0.1):
            k += 1
            try:
                ns = self.namespace()  # a new leader learns it again (serving nodes re-register theirs)
                h = hash_blocks(
                    ns, list(range(k * self.block_size, (k + 1) * self.block_size)), self.block_size
                )
                data = np.random.default_rng(k).integers(0, 256, self.block_nbytes, dtype=np.uint8).tobytes()
                if self.pool.put_blocks(ns, None, h, [data]).num_committed == 1:
                    self.committed[h[0]] = data
                    self.ok_times.append(time.monotonic())
            except Exception as exc:  # noqa: BLE001 - a put refused in the failover window is counted
                self.failed.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("etcd-ns", "etcd-ip", "leader-ns", "leader-ip", "here-ip", "workdir"):
        ap.add_argument(f"--{flag}", required=True)
    a = ap.parse_args()
    os.environ["UCX_TLS"] = "tcp"  # one host to UCX otherwise: shared memory
    from kvpool.bench.failover_cluster import role_of
    from kvpool.bench.netns import python_in_netns
    from kvpool.client import MasterClient, PoolClient
    from kvpool.client import convert as cv
    from kvpool.cluster.etcd import EtcdPlan, require_etcd_binary
    from kvpool.master.procs import LAYOUT, Proc, start, start_master
    from kvpool.types import KVLayout
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
    from transfer import UcxTransport

    lay = KVLayout.from_fingerprint(LAYOUT)
    work = Path(a.workdir)
    plan = EtcdPlan(require_etcd_binary(), a.etcd_ip, 2379, 2380, str(work / "etcd"))  # ports of its own ns
    etcd_ep = plan.endpoint
    etcd = subprocess.Popen(
        ["ip", "netns", "exec", a.etcd_ns, *plan.argv],
        stdout=(work / "etcd.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    procs: list[Proc] = []
    out: dict[str, Any] = {}
    cut = ["ip", "-n", a.leader_ns, "route", "add", "blackhole", f"{a.etcd_ip}/32"]
    try:

        def etcd_up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection((a.etcd_ip, 2379), timeout=0.2):
                return True
            return False

        wait_until(etcd_up, 20, "etcd")
        ha = ("--etcd", etcd_ep, "--ha-lease-ttl-s", str(TTL_S), "--no-metrics")
        with python_in_netns(a.leader_ns, str(work)):
            procs.append(start_master("--listen", a.leader_ip, "--port", "50051", *ha))
        addr_a = procs[0].grpc_address
        wait_until(lambda: role_of(addr_a) == "leader", 20, "A leads")
        procs.append(start_master("--listen", a.here_ip, "--port", "50052", *ha))
        addr_b = procs[1].grpc_address
        wait_until(lambda: role_of(addr_b) == "standby", 20, "B stands by")
        masters = f"{addr_a},{addr_b}"
        store = start(
            [
                *(
                    "store",
                    "--master",
                    masters,
                    "--listen",
                    a.here_ip,
                    "--grpc-port",
                    "0",
                    "--data-port",
                    "0",
                ),
                *("--segment-size", "16MiB", "--layout", LAYOUT, "--node-id", "s0", "--pin-memory", "off"),
            ]
        )
        procs.append(store)
        metrics_at = str(store.ready["metrics_address"])
        with MasterClient(addr_a, timeout_s=2.0) as c:
            e0 = c.masters().epoch
        transport = UcxTransport()
        writer = Writer(masters, transport, lay.block_nbytes, lay.block_size)
        wait_until(lambda: len(writer.committed) >= 10, 30, "10 blocks through A")
        out["store_epoch_before"] = store_metrics(metrics_at)["kvpool_store_leader_epoch"]

        t_cut = time.monotonic()
        subprocess.run(cut, check=True)  # A is cut off from etcd only
        out["stepdown_s"] = wait_until(lambda: role_of(addr_a) == "deposed", 3 * TTL_S, "A steps down")
        wait_until(lambda: role_of(addr_b) == "leader", 3 * TTL_S, "B leads")
        out["takeover_s"] = time.monotonic() - t_cut
        with MasterClient(addr_b, timeout_s=2.0) as c:
            e1 = c.masters().epoch
        n_before = len(writer.committed)
        wait_until(lambda: len(writer.committed) >= n_before + 10, 30, "10 blocks through B")
        out["store_epoch_after"] = store_metrics(metrics_at)["kvpool_store_leader_epoch"]

        # the partitioned leader itself: a put through A alone is refused (it is deposed)
        with PoolClient(addr_a, transport, block_nbytes=lay.block_nbytes, timeout_s=1.0) as only_a:
            ns = writer.namespace()
            try:
                put = only_a.put_blocks(ns, None, [b"\x07" * 16], [bytes(lay.block_nbytes)])
                out["put_through_a"] = f"committed {put.num_committed}"
            except Exception as exc:  # noqa: BLE001 - the refusal is the result
                out["put_through_a"] = f"{type(exc).__name__}: {exc}"

        writer.stop()  # the slot table holds still from here
        # an order as a partitioned leader that missed its deposition would send: A's epoch, a free slot
        with grpc.insecure_channel(store.grpc_address) as ch:
            stub = pb_grpc.StoreStub(ch)
            batches = [cv.inventory_batch(r) for r in stub.Inventory(pb.InventoryRequest(), timeout=10)]
            used = {int(s) for b in batches for s in b.slots}
            free = next(s for s in range(int(store.ready["num_slots"])) if s not in used)
            order = pb.SlotReservation(slot=free, generation=0, namespace=ns, block_hash=b"\x09" * 16)
            try:
                stub.ReserveSlots(
                    pb.ReserveSlotsRequest(slots=[order], write_lease_ms=5000, leader_epoch=e0), timeout=5
                )
                out["stale_order"] = "accepted"
            except grpc.RpcError as exc:
                out["stale_order"] = f"{exc.code().name}: {exc.details()}"
            out["fenced_orders"] = store_metrics(metrics_at)["kvpool_store_fenced_orders_total"]
            batches = [cv.inventory_batch(r) for r in stub.Inventory(pb.InventoryRequest(), timeout=10)]
        slots = [int(s) for b in batches for s in b.slots]
        hashes = [bytes(x.tobytes()) for b in batches for x in b.block_hashes]
        out |= {
            "epochs": [e0, e1],
            "writer_committed": len(writer.committed),
            "writer_failed": len(writer.failed),
            "writer_errors": writer.failed[:5],
            "inventory_blocks": len(slots),
            "inventory_slots_unique": len(set(slots)) == len(slots),
            "inventory_hashes_unique": len(set(hashes)) == len(hashes),
            "committed_in_inventory": all(h in set(hashes) for h in writer.committed),
            "stale_slot_in_inventory": free in slots,
        }
        # through the leader: the deposed A still answers matches from its own (older) index, a miss at worst
        with PoolClient(addr_b, transport, block_nbytes=lay.block_nbytes) as reader:
            ns, exact, missed = writer.namespace(), 0, []
            for k, (h, data) in enumerate(writer.committed.items()):  # each block its own one-block chain
                got = reader.get_blocks(ns, [h], count_hit=False)
                if got.num_ok == 1 and got.blocks[0].data == data:
                    exact += 1
                else:
                    missed.append((k, got.num_matched, got.num_ok, h in set(hashes)))
            out["readback_exact"], out["readback_missed"] = exact, missed
        subprocess.run([*cut[:4], "del", *cut[5:]], check=True)  # heal the partition
        out["a_rejoins_s"] = wait_until(lambda: role_of(addr_a) == "standby", 5 * TTL_S, "A stands by")
        out["b_role_after"] = role_of(addr_b)
        transport.close()
    finally:
        for p in procs:
            p.kill()
        etcd.kill()
        etcd.wait(10)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
