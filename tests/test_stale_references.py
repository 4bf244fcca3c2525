"""Code and comments cite documents that are in the repository: `docs/design.md` (never the old
`DESIGN.md`) and no file outside it (`../shared/...`, `/work/shared/...`). The files still listed in
`_PENDING` carry such a reference today and must lose it (the list only shrinks: a file that no longer
has one fails until it leaves the list)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_STALE = re.compile(r"(?<![\w/])DESIGN\.md|\.\./shared/|/work/shared/")
_PENDING = {
    "kvpool/router/service.py",
    "kvpool/bench/ttft_sweep.py",
}


def _sources() -> list[Path]:
    roots = ("kvpool", "prefill_node", "decode_node", "transfer", "tests", "scripts")
    files = [
        p for r in roots for p in (ROOT / r).rglob("*") if p.suffix in {".py", ".sh", ".toml", ".c", ".h"}
    ]
    return [*files, ROOT / "pyproject.toml", ROOT / "Makefile"]


def test_no_reference_to_a_document_outside_the_repository() -> None:
    this = Path(__file__).resolve()
    stale = {
        str(p.relative_to(ROOT))
        for p in _sources()
        if p.resolve() != this and p.is_file() and _STALE.search(p.read_text(errors="replace"))
    }
    assert stale - _PENDING == set(), "cite docs/ (docs/design.md ...) instead"
    assert _PENDING - stale == set(), "fixed: remove them from _PENDING"
