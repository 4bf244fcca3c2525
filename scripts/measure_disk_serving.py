"""Serve a disk block from disk, or promote it first? One store process with a disk tier; N blocks of 1 MiB
demoted to disk, then (median of several rounds) a batched read of the N blocks from memory, from disk
(over UCX, each block read from disk and verified by the store), and a batched `PromoteBlocks` of them.

Usage: .venv/bin/python scripts/measure_disk_serving.py [--dir DIR] [--blocks 32]
(DIR: a directory on the file system to measure, not tmpfs; default: a fresh one under /tmp).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("UCX_TLS", "tcp")

import numpy as np  # noqa: E402

from kvpool.types import KVLayout  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from tests.test_store_disk_serving import disk_info, moves  # noqa: E402
from tests.test_store_node import MIB_LAYOUT, StoreProc, commit, rand_blocks, reserve  # noqa: E402
from transfer import BlockRead, BlockWrite, UcxTransport, checksum  # noqa: E402

NB = KVLayout.from_fingerprint(MIB_LAYOUT).block_nbytes
F = 1 << 31


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="")
    ap.add_argument("--blocks", type=int, default=32)
    opts = ap.parse_args()
    n, rounds = opts.blocks, 4
    path = tempfile.mkdtemp(dir=opts.dir or None)
    seg = f"{n * (rounds + 1)}MiB"
    s = StoreProc(
        "--segment-size", seg, "--layout", MIB_LAYOUT, "--disk-path", path, "--disk-size", f"{2 * n}MiB"
    )
    t = UcxTransport()
    try:
        info = disk_info(s.stub)
        g = info.first_generation
        data = rand_blocks(n, NB, seed=1)
        slots = list(range(n))
        reserve(s, slots, 1)
        writes = [BlockWrite(x, 1, data[i], checksum(data[i])) for i, x in enumerate(slots)]
        assert all(r.ok for r in t.write_blocks(s.data_address, writes, timeout_s=60))
        assert all(r.ok for r in commit(s, slots, 1))
        assert all(
            r.status == pb.TIER_MOVE_OK for r in moves(s.stub, True, [(i, 1, F + i, g) for i in range(n)])
        )
        out = np.zeros((n, NB), np.uint8)

        def read_s(which: list[int], gen: int) -> float:
            t0 = time.perf_counter()
            res = t.read_blocks(
                s.data_address,
                [BlockRead(x, gen, NB) for x in which],
                [memoryview(o) for o in out],
                timeout_s=60,
            )
            assert all(r.ok for r in res) and np.array_equal(out, data)
            return time.perf_counter() - t0

        memory = [read_s(slots, 1) for _ in range(7)]
        disk = [read_s([F + i for i in range(n)], g) for _ in range(7)]
        promote = []
        for k in range(rounds):
            t0 = time.perf_counter()
            res = moves(s.stub, False, [(F + i, g, n * (k + 1) + i, 1) for i in range(n)])
            promote.append(time.perf_counter() - t0)
            assert all(r.status == pb.TIER_MOVE_OK for r in res)
        m = statistics.median
        print(
            f"disk alpha {info.alpha_s * 1e6:.0f} us, 1/beta {1 / info.beta_s_per_byte / 1e9:.2f} GB/s "
            f"(direct {info.direct}); {n} x 1 MiB: memory read {m(memory) * 1e3:.1f} ms, "
            f"disk read {m(disk) * 1e3:.1f} ms, promote {m(promote) * 1e3:.1f} ms"
        )
    finally:
        t.close()
        s.kill()


if __name__ == "__main__":
    main()
