"""How fast a real master adopts a store's inventory of N blocks, and the longest its lock is held meanwhile.

Usage: python scripts/measure_adoption.py NUM_BLOCKS [--batch BLOCKS]  (blocks per inventory message)

Starts `kvpool master` (tiny layout `kv1:float16:b1:l1:h1:d1`, 4 B a block) as a child process. In this
process: a store's slot table of NUM_BLOCKS slots filled with committed blocks through the table's own calls
(64-block chains under 4 namespaces, as `scripts/measure_slot_memory.py` fills it), served by the store's
real gRPC servicer (`kvpool.store.service.StoreServicer`) on an ephemeral port, and registered with the master
over its RPC as a store does (then heartbeating). The namespaces are registered first, as serving nodes
would have. Prints one JSON line: the wall clock from the registration call to the master's Stats
answering NUM_BLOCKS resident blocks (polled every 20 ms: the wire, the inventory stream and the index
included), blocks/s, and the master's own figures from /metrics (the longest lock hold for one batch, the
adoption's time from first read to last block indexed).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request

from kvpool.client import MasterClient
from kvpool.client.types import NodeInfo, NodeLoad
from kvpool.errors import DeadlineExceeded
from kvpool.master.procs import start
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.rpc.server import start_server
from kvpool.store import Segment, SlotTable
from kvpool.store.service import StoreServicer
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock, KVLayout
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

LAYOUT = "kv1:float16:b1:l1:h1:d1"
BATCH = 1 << 14
CHAIN = 64
FILL = 0.75
"""The store's slots holding blocks."""


def fill(table: SlotTable, n: int, namespaces: list[bytes]) -> None:
    nb = table.block_nbytes
    for first in range(0, n, BATCH):
        slots = range(first, min(first + BATCH, n))
        table.reserve(
            [
                Reservation(
                    s,
                    1,
                    namespaces[(s // CHAIN) % len(namespaces)],
                    s.to_bytes(16, "little"),
                    (s - 1).to_bytes(16, "little") if s % CHAIN else b"",
                )
                for s in slots
            ],
            600_000,
        )
        for s in slots:
            table.begin_write(s, 1, nb)[:] = b"\x01" * nb
            table.end_write(s, 1, 7, True, landed_checksum=7)
        assert all(not err for _, _, err in table.commit((s, 1) for s in slots))


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvpool_master_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    n = int(sys.argv[1])
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 0
    lay = KVLayout.from_fingerprint(LAYOUT)
    env = {"KVPOOL_INVENTORY_BATCH_BLOCKS": str(batch)} if batch else {}
    master = start(["master", "--port", "0", "--layout", LAYOUT, "--metrics-port", "0"], env=env)
    try:
        with MasterClient(master.grpc_address) as c:
            namespaces = [c.register_namespace(f"m{k}", "v1", LAYOUT)[0] for k in range(4)]
            t0 = time.perf_counter()
            num_slots = int(n / FILL) + 1  # below the master's high watermark: no eviction meanwhile
            segment = Segment(num_slots * lay.block_nbytes, lay.block_nbytes, pin_memory="off")
            table = SlotTable(segment, FakeClock(1000))
            fill(table, n, namespaces)
            fill_s = time.perf_counter() - t0
            epoch = time.time_ns()
            servicer = StoreServicer(
                table,
                endpoint=lambda: pb.NodeEndpoint(),
                layout_fingerprint=lay.fingerprint(),
                epoch=epoch,
                copy=lambda src, blocks: [],
                max_batch_slots=8192,
                inflight=lambda: 0,
            )
            server = start_server(
                [(pb_grpc.add_StoreServicer_to_server, servicer, "kvpool.v1.Store")], host="127.0.0.1", port=0
            )
            node = NodeInfo("s0", "store", f"127.0.0.1:{server.port}", "127.0.0.1:1", epoch)
            stop = threading.Event()

            def beat() -> None:
                while not stop.wait(0.3):
                    c.heartbeat(node.node_id, epoch, num_used_slots=n, load=NodeLoad())

            t0 = time.perf_counter()
            c.register_node(
                node,
                protocol_version=PROTOCOL_VERSION,
                layout_fingerprint=lay.fingerprint(),
                num_slots=num_slots,
                block_nbytes=lay.block_nbytes,
            )
            threading.Thread(target=beat, daemon=True).start()
            stalls = 0  # Stats calls that timed out (the master's lock held past the call's deadline)
            while True:
                try:
                    if c.stats().num_blocks >= n:
                        break
                except DeadlineExceeded:
                    stalls += 1
                time.sleep(0.02)
            took = time.perf_counter() - t0
            stop.set()
            m = scrape(master.ready["metrics_address"])
            for _ in range(250):  # the adoption's own figures land just after its last block
                if m.get("kvpool_master_last_adoption_seconds"):
                    break
                time.sleep(0.02)
                m = scrape(master.ready["metrics_address"])
            print(
                json.dumps(
                    {
                        "num_blocks": n,
                        "fill_s": round(fill_s, 1),
                        "adoption_s": round(took, 3),
                        "adoption_blocks_per_s": round(n / took),
                        "master_adoption_s": m.get("kvpool_master_last_adoption_seconds"),
                        "lock_hold_max_ms": round(
                            1000 * m.get("kvpool_master_adoption_lock_hold_max_seconds", 0), 2
                        ),
                        "inventory_batch_blocks": batch or 65_536,
                        "stats_calls_timed_out": stalls,
                    }
                )
            )
            server.stop(0)
    finally:
        master.kill()


if __name__ == "__main__":
    main()
