"""The documentation points only at files a clone has (issue 27, 9: docs/architecture.md
named a file outside the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", *REPO.glob("docs/*.md"),
                *REPO.glob("adapters/*/README.md")])
# A markdown link's target, or a path in backticks that climbs out of its folder.
LINK = re.compile(r"\]\(([^)\s#]+)[^)]*\)")
CLIMB = re.compile(r"`((?:\.\./)+[^`\s]*)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_reference_resolves_inside_the_repository(page):
    text = page.read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(REPO), f"{page.name} links outside: {target}"
        assert resolved.exists(), f"{page.name} links a missing file: {target}"
    for target in CLIMB.findall(text):  # read from the page's folder or the repository's root
        for base in {page.parent, REPO}:
            assert (base / target).resolve().is_relative_to(REPO), \
                f"{page.name} names a path outside the repository: {target}"
