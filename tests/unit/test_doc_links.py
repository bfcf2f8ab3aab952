"""The README stays short and its pages are reachable: every relative link of README.md and of
docs/*.md names a file of the repository, and the README links each topic page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); a target with a scheme (https:, mailto:) or only an anchor
# is not a file of the repository
LINK = re.compile(r"\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^#")


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not EXTERNAL.match(t)]


def test_every_relative_link_names_a_file() -> None:
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES
              for target in relative_links(page)
              if not (page.parent / target.split("#", 1)[0]).exists()]
    assert not broken, broken


def test_the_link_rule_reads_what_a_page_writes() -> None:
    """Links to files count, images too; web addresses and anchors do not."""
    text = ("see [cli](docs/cli.md#python-api), ![plot](images/a.png), [web](https://x.org/a), "
            "[mail](mailto:a@b.c), [here](#top)")
    found = [t for t in LINK.findall(text) if not EXTERNAL.match(t)]
    assert found == ["docs/cli.md#python-api", "images/a.png"]


def test_the_readme_is_short_and_links_each_topic_page() -> None:
    """At most 12 KB (12 * 1024 = 12,288 bytes of UTF-8), a few minutes' read; the rest is in
    docs/, each topic page linked from it."""
    assert len(README.read_bytes()) <= 12 * 1024
    links = {t.split("#", 1)[0] for t in relative_links(README)}
    topics = {"cli", "frameworks", "accuracy", "planning", "profiling", "diagnosis",
              "calibration", "speed", "contributing"}
    assert {f"docs/{name}.md" for name in topics} <= links
