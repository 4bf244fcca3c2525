"""`kvpool up`'s own options are checked before anything starts: a start timeout that is not a positive
finite number of seconds is a usage error naming `--timeout-s` (exit 2), not a cluster that starts and
fails at once with "no answer within -5 s" (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.cli.main import app
from tests.tenant_files import write_private

SPEC = Path(__file__).resolve().parents[1] / "examples" / "cluster.toml"


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_a_bad_start_timeout_is_a_usage_error(value: str) -> None:
    result = CliRunner().invoke(app, ["up", "-c", str(SPEC), "--timeout-s", value])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--timeout-s'" in result.output and "must be > 0" in result.output
    assert "master" not in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("content", [None, "this is = not [toml", '[tenants.acme]\napi_keys = "sk-1"\n'])
def test_a_tenants_file_the_router_would_refuse_stops_up_before_anything_starts(
    tmp_path: Path, content: str | None
) -> None:
    """Found by a new-user pass: a missing or malformed `[router] tenants` file started the whole cluster,
    then the router failed at every restart until `kvpool up` gave up (about 45 s)."""
    tenants = tmp_path / "tenants.toml"
    if content is not None:
        write_private(tenants, content)  # 0600: refused for its content, not its mode
    spec = tmp_path / "cluster.toml"
    spec.write_text(f'[master]\nport = 0\n[router]\nport = 0\ntenants = "{tenants}"\n')
    # --timeout-s 0.001: were the check missing, the cluster would end at its master's start at once
    result = CliRunner().invoke(app, ["up", "-c", str(spec), "--timeout-s", "0.001", "--quiet"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"kvpool up: {spec}: router.tenants: {tenants}"), lines
