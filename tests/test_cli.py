"""The `kvpool` command line: help is fast (no torch, grpc or ucxx imported) and every role is listed."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from kvpool.cli.main import app


def test_help_imports_no_heavy_module() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from kvpool.cli.main import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "heavy = [m for m in ('torch', 'grpc', 'ucxx', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_role_is_a_command() -> None:
    out = CliRunner().invoke(app, ["--help"]).output
    for command in ("demo", "master", "store", "prefill", "decode", "router", "up", "admin", "bench"):
        assert command in out


def test_bad_flag_is_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["demo", "--no-such-flag"])
    assert result.exit_code == 2
    assert "No such option" in result.output


def test_bad_setting_is_one_line_not_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--segment-size", "12XB"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "invalid setting segment_size" in out.stderr and "malformed size" in out.stderr
    assert "Traceback" not in out.stderr
