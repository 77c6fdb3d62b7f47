"""The docs as reference pages (issue 60): a size budget for the two pages a newcomer reads first,
a caption on every figure and table of the measurement pages, and no image that no page shows.

README + DESIGN stay ≤ 40 KB together so they stay readable end to end; performance, decisions
and the lab pages have no byte budget, but every table and figure there is followed by one
``*Source: …*`` line (command, machine, commit, quiet or not, or "not recorded" where it was not),
so a number can be traced to the run that made it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CAPTIONED = ("performance.md", "decisions.md", "collapse_fixes.md")
BUDGET_BYTES = 40_000


def test_readme_and_design_fit_the_budget():
    size = (REPO / "README.md").stat().st_size + (DOCS / "DESIGN.md").stat().st_size
    assert size <= BUDGET_BYTES, f"README.md + docs/DESIGN.md = {size} bytes > {BUDGET_BYTES}: move detail to a reference page"


def uncaptioned(text: str) -> list[str]:
    """The first line of each table or run of image lines not followed by a ``*Source:`` line."""
    lines, missing, i = text.split("\n"), [], 0
    while i < len(lines):
        kind = "table" if lines[i].startswith("|") else "figure" if lines[i].startswith("![") else None
        if kind is None:
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|" if kind == "table" else "!["):
            i += 1
        after = next((line for line in lines[i:] if line.strip()), "")
        if not after.startswith("*Source:"):
            missing.append(f"{kind} at line {start + 1}: {lines[start][:60]}")
    return missing


@pytest.mark.parametrize("page", CAPTIONED)
def test_every_table_and_figure_has_a_source_line(page):
    assert not uncaptioned((DOCS / page).read_text(encoding="utf-8")), uncaptioned((DOCS / page).read_text())


def test_the_caption_check_is_not_vacuous():
    assert uncaptioned("| a |\n|---|\n| 1 |\n\ntext\n![x](x.png)\n*Source: y*\n") == ["table at line 1: | a |"]


def test_every_image_under_docs_is_shown_by_a_page():
    pages = [p for p in REPO.rglob("*.md") if ".git" not in p.parts]
    shown = set()
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+\.(?:png|jpg|jpeg|gif|svg))\)", page.read_text(encoding="utf-8")):
            shown.add((page.parent / target).resolve())
    images = [p for p in DOCS.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".gif", ".svg")]
    unshown = sorted(str(p.relative_to(REPO)) for p in images if p.resolve() not in shown)
    assert not unshown, f"images no page shows (delete them or show them): {unshown}"
