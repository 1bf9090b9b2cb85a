"""Every relative link in README.md and docs/*.md resolves (issue 40).

A link ``[text](target)`` or image ``![alt](target)`` outside code (fenced blocks and inline
code spans are not markdown links) whose target is not a URL (http, https, mailto) must name
a file or folder that exists relative to the page holding it; a ``#anchor`` (alone, or after a
``.md`` target) must be the GitHub slug of a heading of the page it points into. The README is
the front door and stays short.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 260

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).+?\1")
# [text](target) and ![alt](target); the target may carry a "title" after a space
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def links(page):
    """(line number, target) of every markdown link and image of a page."""
    found = []
    for number, line in _prose_lines(page.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def slug(heading):
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation other than '-'
    and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page):
    """Every heading anchor of a page, repeated headings numbered as GitHub numbers them."""
    seen, result = {}, set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def check(page, root=ROOT):
    """The broken links of a page, one message each (paths shown relative to root)."""
    problems = []
    for number, target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: ({target})"
        dest = (page.parent / path) if path else page
        if not dest.exists():
            problems.append(f"{where}: {path} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = check(page)
    assert not problems, "\n".join(problems)


def test_the_pages_have_links_to_check():
    # the parser still finds links: the README links to every page of docs/
    targets = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in targets]
    assert missing == []


def test_readme_is_the_short_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < README_MAX_LINES


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `--flag` (issue 1)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#the---flag-issue-1) [gone](docs/b.md) [bad](docs/a.md#nope)\n"
        "[self](#top) `[code](docs/c.md)`\n\n```\n[fenced](docs/d.md)\n```\n# Top\n"
        "![img](docs/e.png) [web](https://example.org/x.md)\n")
    found = [t for _, t in links(page)]
    assert found == ["docs/a.md#the---flag-issue-1", "docs/b.md", "docs/a.md#nope", "#top",
                     "docs/e.png", "https://example.org/x.md"]
    problems = check(page, root=tmp_path)
    assert len(problems) == 3
    assert "docs/b.md does not exist" in problems[0]
    assert "no heading #nope" in problems[1]
    assert "docs/e.png does not exist" in problems[2]
