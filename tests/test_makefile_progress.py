"""`make demo`'s install says what it does: the Makefile's install recipe run by real `make` in a copy of
the repository's Makefile, with a stand-in `pip` that records its arguments (nothing is installed): every
quiet pip install is preceded by one `kvpool: ...` line naming its phase, and pip stays quiet."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_each_install_phase_prints_one_line_before_its_quiet_pip(tmp_path: Path) -> None:
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for dep in ("pyproject.toml", "setup.py", "transfer/_kernels.c", "transfer/_xxh3_avx2.h"):
        (tmp_path / dep).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / dep).touch()
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()  # the venv exists: only the install phases run
    pip = bin_dir / "pip"
    pip.write_text('#!/bin/sh\necho "PIP $*"\n')
    pip.chmod(0o755)
    out = subprocess.run(
        ["make", "-s", ".venv/.installed"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out == [
        "kvpool: installing torch 2.13.0 (CPU)...",
        "PIP install -q torch==2.13.0",
        "kvpool: installing kvpool and its dependencies (.[dev,bench,ha]), building its C kernels...",
        "PIP install -q -e .[dev,bench,ha]",
        "kvpool: installed in .venv",
    ]
