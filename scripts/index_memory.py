"""Measure the radix index's memory per block (process RSS) and its rates at N blocks; prints JSON.

Usage: `PYTHONPATH=. .venv/bin/python scripts/index_memory.py 1000000 [5000000 ...]` — each N runs in
its own subprocess (one at a time), so every figure starts from a fresh process. See
`kvpool/bench/index_memory.py` for what is measured.
"""

from __future__ import annotations

import json
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--one":
        from kvpool.bench.index_memory import measure

        print(json.dumps(measure(int(argv[1]))))
        return 0
    for n in argv or ["1000000"]:
        out = subprocess.run(
            [sys.executable, __file__, "--one", n], capture_output=True, text=True, check=False
        )
        print(out.stdout.strip() or out.stderr.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
