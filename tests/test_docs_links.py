"""The documentation holds together: every relative link in README.md and docs/*.md names a file of the
repository (and, into a Markdown page, a heading that exists), and every field-case id the code cites
(`B17` in a comment) has its section in docs/failure-classes.md, which links the tests that prove it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
ID_RE = re.compile(r"\bB[0-9]{1,2}\b")
CODE_DIRS = ("kvpool", "prefill_node", "decode_node", "transfer")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE_RE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = _slug(match.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def relative_links(page: Path) -> list[str]:
    """Link targets outside fenced code blocks that are not URLs."""
    text = FENCE_RE.sub("", page.read_text())
    return [t for t in LINK_RE.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_link_checker_sees_links_anchors_and_skips_code(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "# A `code` title: B17\n## Twice\n## Twice\n[x](other.md#a-code-title-b17) ![i](pic.png) [u](https://e.org)\n"
        "```\n[not](a-link.md)\n# not a heading\n```\n"
    )
    assert relative_links(page) == ["other.md#a-code-title-b17", "pic.png"]
    assert anchors(page) == {"a-code-title-b17", "twice", "twice-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def cited_ids() -> dict[str, list[str]]:
    """Field-case ids cited in the code, each with the files citing it."""
    cited: dict[str, list[str]] = {}
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and "third_party" not in path.parts:
                for case in set(ID_RE.findall(path.read_text(errors="replace"))):
                    cited.setdefault(f"B{int(case[1:]):02d}", []).append(str(path.relative_to(ROOT)))
    return cited


def failure_class_sections() -> dict[str, str]:
    """docs/failure-classes.md's sections by id: `### B17: ...` up to the next heading."""
    text = (DOCS / "failure-classes.md").read_text()
    parts = re.split(r"^#{2,3} ", text, flags=re.M)
    return {m.group(1): part for part in parts if (m := re.match(r"(B[0-9]{2}): ", part))}


def test_every_field_case_the_code_cites_has_a_section() -> None:
    cited = cited_ids()
    assert len(cited) >= 20  # the scan works: the code cites many
    sections = failure_class_sections()
    missing = {case: files[:3] for case, files in cited.items() if case not in sections}
    assert not missing, (
        f"field cases cited in the code without a section in docs/failure-classes.md: {missing}"
    )


def test_every_failure_class_names_a_test_that_exists() -> None:
    for case, section in failure_class_sections().items():
        tests = re.findall(r"\(\.\./(tests/[\w/]+\.py)\)", section)
        assert tests, f"{case}: its section links no test file"
        for test in tests:
            assert (ROOT / test).is_file(), f"{case}: {test} does not exist"
        for name in re.findall(r"`(test_\w+)`", section):
            assert any(f"def {name}(" in (ROOT / t).read_text() for t in tests), (
                f"{case}: no test named {name}"
            )
        # each linked test file is followed by the names of the tests in it that prove the guarantee
        links = list(re.finditer(r"\(\.\./(tests/[\w/]+\.py)\)", section))
        for link, after in zip(links, [*links[1:], None], strict=True):
            cited = section[link.end() : after.start() if after else len(section)]
            names = re.findall(r"`((?:test_|Test)\w+)`", cited)
            assert names, f"{case}: {link.group(1)} is cited without the name of a test in it"
            text = (ROOT / link.group(1)).read_text()
            for name in names:
                assert f"def {name}(" in text or f"{name} = " in text, f"{case}: no {name} in {link.group(1)}"
