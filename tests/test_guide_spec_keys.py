"""docs/guide.md's list of the cluster spec's sections names every section and every key `kvpool up`
accepts, so a key the spec gains is documented (a key not in the spec is refused with its line)."""

from __future__ import annotations

import re
from pathlib import Path

from kvpool.cluster.spec import ClusterSpec

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def _documented() -> dict[str, set[str]]:
    text = GUIDE.read_text()
    para = text[text.index("Sections: `[cluster]`") :].split("\n\n", 1)[0]
    para = re.sub(r"\[[^\]]*\]\([^)]*\)", "", para)  # markdown links
    keys: dict[str, set[str]] = {}
    for names, body in re.findall(r"((?:`\[\w+\]`/?)+) \(((?:[^()]|\([^()]*\))*)\)", para):
        words = set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*\b", body))
        for name in re.findall(r"`\[(\w+)\]`", names):
            keys[name] = words
    return keys


def test_every_section_and_key_is_named() -> None:
    documented = _documented()
    assert set(documented) == set(ClusterSpec.model_fields), documented
    for section, field in ClusterSpec.model_fields.items():
        model = field.annotation
        accepted = set(model.model_fields)  # type: ignore[union-attr]
        missing = accepted - documented[section]
        assert not missing, f"[{section}] keys missing from docs/guide.md: {sorted(missing)}"
