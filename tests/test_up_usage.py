"""`kvpool up`'s own options are checked before anything starts: a start timeout that is not a positive
finite number of seconds is a usage error naming `--timeout-s` (exit 2), not a cluster that starts and
fails at once with "no answer within -5 s" (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app

SPEC = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_a_bad_start_timeout_is_a_usage_error(value: str) -> None:
    result = CliRunner().invoke(app, ["up", "-c", str(SPEC), "--timeout-s", value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--timeout-s'" in result.output and "must be > 0" in result.output
    assert "master" not in result.output and "Traceback" not in result.output, result.output
