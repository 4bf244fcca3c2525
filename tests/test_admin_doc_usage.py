"""docs/operations.md's admin command table matches the CLI: every option it shows exists on that command,
one written bare is required, one in `[...]` or `(... | ...)` is not (the CLI checks alternatives itself)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from kvpool.cli.main import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def _usages() -> list[str]:
    """Each backticked usage in the first cell of the admin command table (`adapter a\\|b ...` split)."""
    text = DOC.read_text()
    table = text[text.index("| command | what it does |") :].split("\n\n", 1)[0]
    usages: list[str] = []
    for row in table.splitlines()[2:]:
        cell = re.split(r"(?<!\\)\|", row)[1]
        for usage in re.findall(r"`([^`]+)`", cell):
            words = usage.replace("\\|", "|").split()
            if words[0] == "adapter":  # adapter register|reload ...: one usage per subcommand
                usages += [" ".join(["adapter", sub, *words[2:]]) for sub in words[1].split("|")]
            else:
                usages.append(" ".join(words))
    return usages


def _command(words: list[str]) -> tuple[Any, list[str]]:
    """The CLI command a usage names (typer's click groups, vendored or not: anything with `commands`)."""
    cmd: Any = typer.main.get_command(app).commands["admin"]  # type: ignore[attr-defined]
    while hasattr(cmd, "commands"):
        cmd, words = cmd.commands[words[0]], words[1:]
    return cmd, words


def _options(usage_rest: str) -> tuple[set[str], set[str]]:
    """(bare options, options inside [...] or (...))."""
    optional: set[str] = set()
    for group in re.findall(r"\[[^\]]*\]|\([^)]*\)", usage_rest):
        optional |= set(re.findall(r"--[a-z-]+", group))
    bare = set(re.findall(r"--[a-z-]+", re.sub(r"\[[^\]]*\]|\([^)]*\)", "", usage_rest)))
    return bare, optional


def test_the_table_lists_every_admin_command() -> None:
    usages = _usages()
    assert len(usages) >= 14, usages
    admin = typer.main.get_command(app).commands["admin"]  # type: ignore[attr-defined]
    documented = {u.split()[0] for u in usages}
    assert documented == set(admin.commands), (documented, set(admin.commands))


def test_each_usage_matches_the_cli() -> None:
    for usage in _usages():
        words = usage.split()
        cmd, rest = _command(words)
        bare, optional = _options(" ".join(rest))
        params = {opt: p for p in cmd.params for opt in p.opts}
        for opt in bare | optional:
            assert opt in params, f"{usage}: {opt} is not an option of the command"
        for opt in bare:
            assert params[opt].required, f"{usage}: {opt} is shown as required but the CLI defaults it"
        for opt in optional:
            assert not params[opt].required, f"{usage}: {opt} is shown as optional but the CLI requires it"
