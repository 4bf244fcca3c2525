"""The examples in examples/ run as documented against a real cluster (so they cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.capabilities import require_ucx

ROOT = Path(__file__).resolve().parents[1]


def test_pool_client_example_publishes_and_reads_back_through_a_real_cluster() -> None:
    require_ucx()
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec
    from kvpool.types import DEFAULT_LAYOUT

    spec = LocalClusterSpec(
        layout=DEFAULT_LAYOUT, num_stores=1, num_prefill=0, num_decode=0, segment_size="16MiB"
    )
    with LocalCluster(spec) as cluster:
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "pool_client.py"), "--master", cluster.master_address],
            capture_output=True, text=True, timeout=120, cwd=ROOT,
        )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "put: 4 committed" in out.stdout and "exists: 4 of 5 blocks cached" in out.stdout, out.stdout
    assert "get: 4 blocks read, bytes equal to what was put: True" in out.stdout, out.stdout


def test_pool_client_example_against_no_master_is_one_line() -> None:
    """Found by a new-user pass: against a dead master the example printed a traceback."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "pool_client.py"), "--master", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().startswith("pool_client: Unavailable"), out.stderr
