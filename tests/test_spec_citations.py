"""Every "SPEC §N" the code cites names a section of the vendored docs/SPEC.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]


def test_every_spec_section_cited_in_the_code_exists_in_docs_spec():
    sections = {int(n) for n in re.findall(r"^## (\d+)\.", (REPO / "docs" / "SPEC.md").read_text(), re.M)}
    cited: dict[int, list[str]] = {}
    for path in list((REPO / "llds_jax").rglob("*.py")) + list((REPO / "configs").glob("*.py")):
        for match in re.finditer(r"SPEC §\s*(\d+)(?:\s*[-–,]\s*§?\s*(\d+))?", path.read_text(encoding="utf-8")):
            for number in filter(None, match.groups()):
                cited.setdefault(int(number), []).append(str(path.relative_to(REPO)))
    assert cited, "no SPEC citation found: the pattern is wrong"
    missing = {n: files for n, files in cited.items() if n not in sections}
    assert not missing, f"SPEC sections cited but not in docs/SPEC.md: {missing}"
