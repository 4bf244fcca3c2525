"""`kvpool.bench.faults`: the gray-failure figures (docs/bench_faults.md) from the real master in process."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvpool.bench import faults


def test_a_store_failing_every_write_is_left_after_a_few_commits_whatever_the_rate() -> None:
    fail_after = 3  # the master's default dataplane_fail_after
    for rate in (100, 1000):
        on = faults.run_rate(rate, seconds=1.0)
        assert on["blocks_after_first_failure"] <= (fail_after - 1) * on["blocks_per_publish"], on
        off = faults.run_rate(rate, seconds=1.0, commit_counting=False)  # seconds-coalesced reports only
        assert off["blocks_after_first_failure"] > 10 * on["blocks_after_first_failure"], off


def test_the_command_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    app_result = CliRunner().invoke(_app(), ["--json", str(out), "--seconds", "1"])
    assert app_result.exit_code == 0, app_result.output
    figures = json.loads(out.read_text())
    assert figures["transient_store_failed"] == 0
    assert [r["publishes_per_s"] for r in figures["gray_writes"]] == [10, 100, 1000] * 2


def _app():  # type: ignore[no-untyped-def]
    import typer

    app = typer.Typer()
    app.command()(faults.main)
    return app
