"""tqdm and matplotlib come with the `bench` extra: without them `kvpool bench` still answers --help, and a
benchmark that needs one names the extra before it starts (no traceback after a long run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvpool

TRACE = Path(kvpool.__file__).parent / "data" / "traces" / "conversation_small.jsonl"

# `None` in sys.modules makes `import tqdm` raise ImportError, as on an install without the extra
_WITHOUT_EXTRA = (
    "import sys; sys.modules['tqdm'] = None; sys.modules['matplotlib'] = None; "
    "from kvpool.cli.main import main; sys.argv = ['kvpool', *sys.argv[1:]]; main()"
)


def _kvpool_without_extra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_EXTRA, *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("args", [("bench", "--help"), ("bench", "trace", "--help")])
def test_help_needs_no_extra(args: tuple[str, ...]) -> None:
    r = _kvpool_without_extra(*args)
    assert r.returncode == 0, r.stderr
    assert "Usage" in r.stdout


@pytest.mark.parametrize(
    ("args", "missing"),
    [
        (("--no-progress",), "tqdm"),  # the trace replay imports tqdm even without a bar
        (("--plot", "out.png"), "tqdm and matplotlib"),
    ],
)
def test_missing_extra_is_named_before_the_run(args: tuple[str, ...], missing: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    r = _kvpool_without_extra("bench", "trace", "--trace", str(TRACE), "--json", str(report), *args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip() == (
        f"kvpool bench trace: needs {missing} from the 'bench' extra: pip install 'kvpool[bench]'"
    )
    assert not report.exists() and "prefix-hit rate" not in r.stdout
