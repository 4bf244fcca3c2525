"""The one-way dependencies of docs/design.md ("Roles") as import-linter contracts (`[tool.importlinter]` in pyproject.toml): they
hold on this tree, every package has a layer, and an import that runs back up breaks them."""

from __future__ import annotations

import pkgutil
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kvpool

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvpool", "prefill_node", "decode_node", "transfer")
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the packages under `tree`, with the contracts of its pyproject.toml."""
    return subprocess.run(
        [sys.executable, "-c", _LINT, "--no-cache", "--no-logo"],
        cwd=tree,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _contracts() -> list[dict[str, object]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_contracts_hold() -> None:
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in r.stdout


def test_every_package_has_a_layer() -> None:
    """A new module of kvpool (or a new top-level package) must be placed in the layers contract."""
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    assert isinstance(layers, list)
    placed = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    modules = {f"kvpool.{m.name}" for m in pkgutil.iter_modules(kvpool.__path__)}
    assert modules | set(PACKAGES) - {"kvpool"} == placed


def test_an_import_back_up_breaks_a_contract(tmp_path: Path) -> None:
    """One import against each contract, in a copy of the sources: each contract reports itself broken."""
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package,
            tmp_path / package,
            ignore=lambda d, names: [n for n in names if not n.endswith(".py") and not Path(d, n).is_dir()],
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    injected = {
        "kvpool/index/__init__.py": "import kvpool.hashing",  # the index sees only types and errors
        "kvpool/router/__init__.py": "import kvpool.vllm.settings",  # only the CLI imports the connector
        "kvpool/demo/__init__.py": "import kvpool.bench.trace",  # only `kvpool bench` imports benchmarks
        "kvpool/cli/admin_common.py": "import kvpool.cli.bench",  # admin loads no benchmark
        "transfer/__init__.py": "import kvpool.errors",  # the transport imports nothing of the project
    }
    for path, line in injected.items():
        with (tmp_path / path).open("a") as fh:
            fh.write(f"\n{line}  # noqa\n")
    r = _lint_imports(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    for contract in _contracts():
        assert f"{contract['name']} BROKEN" in r.stdout, r.stdout
    assert f"Contracts: 0 kept, {len(_contracts())} broken." in r.stdout
