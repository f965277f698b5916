"""Every link between the repository's markdown pages leads to a page that exists, and to a
heading of it when it names one (the pages link into docs/BENCHMARKS.md's sections, which is
rendered, so a renamed section would otherwise break them silently)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"\]\(([^)\s]*)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to
    hyphens, and ``-1``, ``-2`` ... after repeats."""
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", CODE_BLOCK.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return found


def test_anchors_follow_githubs_rule() -> None:
    text = "# Top\n## `merge`: merging, fast\n## High resolution: 196, 576 tokens\n## Top\n"
    assert anchors(text) == {"top", "merge-merging-fast", "high-resolution-196-576-tokens", "top-1"}
    assert anchors("```bash\n# a comment, not a heading\n```\n") == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_to_a_page_leads_to_it_and_its_section(page: Path) -> None:
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", page.read_text())):
        path, _, anchor = target.partition("#")
        if "://" in path or path.startswith("mailto:") or not (path.endswith(".md") or not path):
            continue
        linked = page if not path else (page.parent / path).resolve()
        if not linked.is_file():
            broken.append(f"{target}: no such page")
        elif anchor and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: no such section")
    assert not broken, f"{page.name}: " + "; ".join(broken)
