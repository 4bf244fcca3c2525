"""Bytes of bookkeeping per slot of a store's slot table, filled with committed blocks.

Usage: python scripts/measure_slot_memory.py NUM_SLOTS [--private] [--timings]

Builds a store segment of NUM_SLOTS slots in the tiny layout (`kv1:float16:b1:l1:h1:d1`, 4 B a block;
shared with same-host readers as a store does by default, `--private` not), reserves, writes and commits
every slot through the table's own calls (64-block chains under 4 namespaces, fresh `bytes` objects per
order as a parsed gRPC message gives), then prints one JSON line: the VmRSS growth after gc minus the
segment's own bytes, per slot. `--timings` adds, once filled: the seconds to read the whole inventory in
65,536-block batches (`inventory_batch`) and the longest batch (the table's lock is held for each), the
legacy `inventory()` list, and one `reap_expired` scan over every slot.
"""

from __future__ import annotations

import gc
import json
import sys
import time

from kvpool.store import Segment, SlotTable
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock

BLOCK_NBYTES = 4  # kv1:float16:b1:l1:h1:d1
BATCH = 1 << 14
CHAIN = 64


def vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    n = int(sys.argv[1])
    share = "--private" not in sys.argv[2:]
    namespaces = [bytes([k]) * 16 for k in range(4)]
    gc.collect()
    before = vm_rss_bytes()
    t0 = time.perf_counter()
    clock = FakeClock(1000)
    table = SlotTable(Segment(n * BLOCK_NBYTES, BLOCK_NBYTES, pin_memory="off", share=share), clock)
    data = b"\x01\x02\x03\x04"
    for start in range(0, n, BATCH):
        slots = range(start, min(start + BATCH, n))
        table.reserve(
            [
                Reservation(
                    s,
                    1,
                    bytes(bytearray(namespaces[(s // CHAIN) % 4])),
                    s.to_bytes(16, "little"),
                    (s - 1).to_bytes(16, "little") if s % CHAIN else b"",
                )
                for s in slots
            ],
            600_000,
        )
        for s in slots:
            table.begin_write(s, 1, BLOCK_NBYTES)[:] = data
            table.end_write(s, 1, 7, True, landed_checksum=7)
        assert all(not err for _, _, err in table.commit((s, 1) for s in slots))
    fill_s = time.perf_counter() - t0
    gc.collect()
    after = vm_rss_bytes()
    assert table.num_used == n
    seg = table.segment.nbytes
    out = {
        "num_slots": n,
        "shared": table.shared_state is not None,
        "rss_growth_bytes": after - before,
        "segment_bytes": seg,
        "bytes_per_slot": round((after - before - seg) / n, 1),
        "fill_s": round(fill_s, 1),
    }
    if "--timings" in sys.argv[2:]:
        out.update(timings(table, clock, n))
    print(json.dumps(out))


def timings(table: SlotTable, clock: FakeClock, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if hasattr(table, "inventory_batch"):
        t0, longest, cursor, seen = time.perf_counter(), 0.0, 0, 0
        while cursor != -1:
            b0 = time.perf_counter()
            batch = table.inventory_batch(cursor, 65_536)
            longest = max(longest, time.perf_counter() - b0)
            cursor, seen = batch.next_slot, seen + len(batch)
        assert seen == n
        out["inventory_batch_all_s"] = round(time.perf_counter() - t0, 3)
        out["inventory_batch_longest_ms"] = round(longest * 1000, 2)
    t0 = time.perf_counter()
    assert len(table.inventory()) == n
    out["inventory_list_s"] = round(time.perf_counter() - t0, 2)
    table.free([(0, 1)])
    table.reserve([Reservation(0, 2, bytes(16), bytes(16))], 1)
    clock.advance(1)
    t0 = time.perf_counter()
    assert table.reap_expired() == 1
    out["reap_scan_ms"] = round((time.perf_counter() - t0) * 1000, 2)
    return out


if __name__ == "__main__":
    main()
