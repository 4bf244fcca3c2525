"""Only `kvpool/vllm/` imports vllm, and importing `kvpool.vllm` or its vLLM-free modules loads none.

vllm is absent from `.venv` and takes seconds to import where it is installed, so the rest of kvpool must
never need it. Marked `vllm`: `make test-vllm` also runs this module in `.venv-vllm`, where vllm *is*
importable and the no-eager-import checks are the real thing.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvpool", "prefill_node", "decode_node", "transfer")
VLLM_PACKAGE = ROOT / "kvpool" / "vllm"  # the only place allowed to import vllm

# The connector's halves, layout conversion and publisher: tested (and importable) without vllm.
VLLM_FREE = (
    "kvpool.vllm.layout",
    "kvpool.vllm.publisher",
    "kvpool.vllm.settings",
    "kvpool.vllm.meta",
    "kvpool.vllm.scheduler",
    "kvpool.vllm.worker",
    "kvpool.vllm.identity",
)
# Of those, the ones that must not import vllm even where it is installed (`meta` subclasses vLLM's metadata
# base classes when it can, and `scheduler`/`worker` import `meta`).
NEVER_LOAD_VLLM = ("kvpool.vllm", "kvpool.vllm.layout", "kvpool.vllm.publisher", "kvpool.vllm.settings")


def _is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def vllm_imports(source: str, filename: str = "<src>") -> Iterator[tuple[int, str]]:
    """(line, statement) of every import of vllm in `source`: `import vllm[.x]`, `from vllm[.x] import ...`
    (module level or inside a function, class or try), and `importlib.import_module("vllm...")` /
    `__import__("vllm...")` with a literal name. Relative imports (`from . import vllm`) are kvpool's own."""
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_vllm(alias.name):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _is_vllm(node.module):
                yield node.lineno, f"from {node.module} import ..."
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(arg, ast.Constant)
                and isinstance(arg.value, str)
                and _is_vllm(arg.value)
            ):
                yield node.lineno, f"{name}({arg.value!r})"


def python_files() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50, f"found only {len(files)} .py files under {PACKAGES} in {ROOT}"
    return files


def test_the_scanner_finds_every_form_of_import() -> None:
    src = """
import os, vllm
import vllm.config as cfg
from vllm import LLM
from vllm.distributed.kv_transfer import base
try:
    from vllm.platforms import current_platform
except ImportError:
    pass
def f():
    import vllm.v1
    class C:
        def g(self):
            from vllm.config import KVTransferConfig
    return importlib.import_module("vllm.platforms"), __import__("vllm")
import vllmx
from vllmx import y
from kvpool import vllm
from kvpool.vllm import layout
from . import vllm
from .vllm import layout
import kvpool.vllm.connector
importlib.import_module("kvpool.vllm")
"""
    found = sorted(stmt for _, stmt in vllm_imports(src))
    assert found == sorted(
        [
            "import vllm",
            "import vllm.config",
            "from vllm import ...",
            "from vllm.distributed.kv_transfer import ...",
            "from vllm.platforms import ...",
            "import vllm.v1",
            "from vllm.config import ...",
            "import_module('vllm.platforms')",
            "__import__('vllm')",
        ]
    )


def test_only_kvpool_vllm_imports_vllm() -> None:
    offenders: list[str] = []
    inside: list[str] = []
    for path in python_files():
        for line, stmt in vllm_imports(path.read_text(), str(path)):
            rel = f"{path.relative_to(ROOT)}:{line}: {stmt}"
            (inside if path.is_relative_to(VLLM_PACKAGE) else offenders).append(rel)
    assert not offenders, "only kvpool/vllm/ may import vllm:\n" + "\n".join(offenders)
    # the scan sees the connector's own imports (it would pass vacuously if it read nothing)
    assert any(r.startswith("kvpool/vllm/connector.py:") for r in inside), inside


def _run(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=str(ROOT)
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


_LOADED = "sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))"


def test_importing_kvpool_vllm_loads_no_vllm() -> None:
    """`import kvpool.vllm` (the package: `KVPoolConnector` resolves on use) and the modules the connector
    halves are built from load no vllm, in whichever venv runs this (vllm installed or not)."""
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        f"for name in {NEVER_LOAD_VLLM!r}:\n"
        "    importlib.import_module(name)\n"
        f"    out[name] = {_LOADED}\n"
        "print(json.dumps(out))\n"
    )
    loaded = _run(code)
    assert loaded == {name: [] for name in NEVER_LOAD_VLLM}, f"vllm modules loaded on import: {loaded}"


def test_vllm_free_modules_import_without_vllm() -> None:
    """With vllm made unimportable (`sys.modules['vllm'] = None`), every vLLM-free module imports."""
    code = (
        "import importlib, json, sys, traceback\n"
        "sys.modules['vllm'] = None  # import vllm (and vllm.x) raises ModuleNotFoundError\n"
        "out = {}\n"
        f"for name in {VLLM_FREE!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        out[name] = 'ok'\n"
        "    except BaseException:\n"
        "        out[name] = traceback.format_exc(limit=-3)\n"
        "print(json.dumps(out))\n"
    )
    results = _run(code)
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
    assert sorted(results) == sorted(VLLM_FREE)


def test_kvpool_vllm_names_the_connector_lazily() -> None:
    import kvpool.vllm

    assert kvpool.vllm.__all__ == ["KVPoolConnector"]
    with pytest.raises(AttributeError):
        _ = kvpool.vllm.NoSuchThing  # type: ignore[attr-defined]
