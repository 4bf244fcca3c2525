"""scripts/check_quickstart.py (`make quickstart-check`, run by CI against a real cluster) finds the README's
quickstart: a README edit that breaks what it runs fails here, in the fast suite, first."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_quickstart", ROOT / "scripts" / "check_quickstart.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_quickstart_starts_a_cluster_then_asks_it_with_openai() -> None:
    check = _check()
    up, *clients = check.quickstart_blocks((ROOT / "README.md").read_text())
    assert "kvpool up -c examples/cluster.toml" in up and (ROOT / "examples" / "cluster.toml").is_file()
    snippet = next(block for block in clients if "OpenAI(" in block)
    assert "cached_tokens" in snippet and "print(" in snippet


def test_the_checks_parsing() -> None:
    check = _check()
    assert check.USAGE_RE.findall("1636 0\nnoise\n1636 1600\n") == [("1636", "0"), ("1636", "1600")]
    text = "for the admin CLI: export KVPOOL_JOIN_TOKEN_FILE=/tmp/kvpool-up-x/join_token\nlogs in /tmp"
    assert (
        check.EXPORT_RE.search(text).group(0) == "export KVPOOL_JOIN_TOKEN_FILE=/tmp/kvpool-up-x/join_token"
    )
    tls = "gRPC TLS (mutual) ...: export KVPOOL_TLS_CA_FILE=/t/ca.pem KVPOOL_TLS_CLIENT_AUTH=true\n"
    assert [m.group(0) for m in check.EXPORTS_RE.finditer(text + "\n" + tls)] == [
        "export KVPOOL_JOIN_TOKEN_FILE=/tmp/kvpool-up-x/join_token",
        "export KVPOOL_TLS_CA_FILE=/t/ca.pem KVPOOL_TLS_CLIENT_AUTH=true",
    ]
    with pytest.raises(ValueError, match='no "## Quickstart"'):
        check.quickstart_blocks("# kvpool\n## Other\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="1 bash block"):
        check.quickstart_blocks("## Quickstart\n```bash\nkvpool up\n```\n## Next\n```bash\nls\n```\n")
