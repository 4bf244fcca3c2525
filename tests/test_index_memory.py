"""`RadixIndex.memory_bytes` against the process's measured RSS growth at 1 M blocks (in a fresh
subprocess, so nothing else this test process holds moves the figure; after `malloc_trim`, so the
allocator's slack of freed batch temporaries, ~15 MB here, is not counted against the index)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, psutil
    from kvpool.bench.index_memory import fill
    from kvpool.index import RadixIndex
    from kvpool.types import MonotonicClock

    n = 1_000_000
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    index = RadixIndex(clock=MonotonicClock(), policy="fwlru", max_blocks=4 * n)
    fill(index, n, 64, 65_536)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc's slack of freed batch temporaries is not the index's
    grown = proc.memory_info().rss - before
    print(json.dumps({"grown": grown, "accounted": index.memory_bytes(), "blocks": index.num_blocks}))
    """
)


@pytest.mark.slow
def test_memory_bytes_is_within_ten_percent_of_rss_growth_at_1m_blocks() -> None:
    """Reserved capacity (4x the blocks) must not be counted: only touched rows, the table, the heap."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["blocks"] == 1_000_000
    assert abs(got["accounted"] - got["grown"]) <= 0.1 * got["grown"], got
    assert got["accounted"] / got["blocks"] <= 200, got  # the compact representation: far below ~650 B
