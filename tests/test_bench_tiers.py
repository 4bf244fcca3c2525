"""`kvpool bench tiers --disk-path DIR` (the disk half), small: the report's fields and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_tiers_reports_engine_and_dd_figures(tmp_path: Path) -> None:
    report = tmp_path / "tiers.json"
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "bench", "tiers", "--disk-path", str(tmp_path),
         "--total", "8MiB", "--reps", "1", "--json", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(report.read_text())
    s, rounds = doc["summary"], {r["batch_bytes"]: r for r in doc["records"]}
    assert [b["batch_bytes"] for b in s["batches"]] == [1 << 20, 4 << 20]
    for b in s["batches"]:
        for key in ("engine_write_gbps", "engine_read_gbps", "dd_write_gbps", "dd_read_gbps"):
            assert b[key] > 0, (key, b)
        r = rounds[b["batch_bytes"]]  # one round: its ratio is dd's time over the engine's
        assert b["read_over_baseline"] == round(r["dd_read_s"][0] / r["engine_read_s"][0], 3)
        assert b["write_over_baseline"] == round(r["dd_write_s"][0] / r["engine_write_s"][0], 3)
    assert s["disk_read_over_baseline"] == min(b["read_over_baseline"] for b in s["batches"])
    assert s["disk_write_over_baseline"] == min(b["write_over_baseline"] for b in s["batches"])
    assert s["direct_io"] and s["fs_type"] != "tmpfs" and s["alpha_s"] > 0 and s["beta_s_per_byte"] > 0
    c = s["engine_counters"]
    assert c["written_bytes"] == c["read_bytes"] == 2 * (8 << 20) and c["io_errors"] == 0
    assert "disk_read_over_baseline" in out.stdout and "dd read" in out.stdout
    assert list(tmp_path.iterdir()) == [report]  # its scratch files are gone


def test_bench_tiers_refuses_a_missing_directory(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "bench", "tiers", "--disk-path", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"},
    )  # fmt: skip
    assert out.returncode == 2 and "no such directory" in out.stderr and "Traceback" not in out.stderr
