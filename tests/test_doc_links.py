"""The documentation's links between its own files land: every relative link in README.md, FORMAT.md, docs/ and
benchmarks/LOG.md names a file of the repository, and a #section of it names one of its headings (GitHub's anchors:
the heading in lower case, its punctuation dropped, its spaces as hyphens). Pages split or moved keep their readers."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "FORMAT.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "LOG.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return frozenset(anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line))


def local_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def test_the_anchors_are_githubs():
    assert anchor("Start-up without torch (issue 26)") == "start-up-without-torch-issue-26"
    assert anchor("`manas serve`") == "manas-serve"
    assert anchor("An Intel host, ninth round: a decode step's panel asked for twice") == (
        "an-intel-host-ninth-round-a-decode-steps-panel-asked-for-twice"
    )


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_link_between_the_pages_lands(page):
    broken = []
    for link in local_links(page):
        path, _, section = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(link)
        elif section and target.suffix == ".md" and section not in anchors(target):
            broken.append(link)
    assert broken == [], f"{page.relative_to(ROOT)} links to what is not there: {broken}"
