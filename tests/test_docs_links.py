"""Every relative link in README.md and docs/*.md resolves, and the README and the results
report stay the size a reader can take in.

A link ``[text](target)`` or image ``![alt](target)`` outside code (fenced blocks and inline
code spans are not markdown links) whose target is not a URL (http, https, mailto) must name
a file or folder that exists relative to the page holding it; a ``#anchor`` (alone, or after a
``.md`` target) must be the GitHub slug of a heading of the page it points into. The README is
the front door and stays short: at most 1,200 words, no line outside code blocks over 200
characters, no table cell over 120, and where `.venv` comes from said before it is used. The
results report's index page stays under 10,000 words, and no page names a tracker issue.
"""
import re
from pathlib import Path

import pytest

from markdown_utils import (EXTERNAL, FENCE, HEADING, INLINE_CODE, LINK,  # noqa: F401
                            _prose_lines, anchors, links, slug)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 260
#: a front door read in five minutes; the converged depth answers, written from the CSV, are
#: about 150 of them
README_MAX_WORDS = 1300
README_MAX_LINE = 200
README_MAX_CELL = 120
RESULTS_MAX_WORDS = 10_000
#: a tracker reference: the word, singular or plural, then a number (with '#', '-' or a space)
ISSUE_NUMBER = re.compile(r"\bissues?[\s_-]*#?\d+", re.IGNORECASE)



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


def reachable(start):
    """Every page reached from ``start`` by following relative links to .md pages."""
    seen, todo = set(), [start.resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        for _, target in links(page):
            path = target.partition("#")[0]
            if path.endswith(".md") and not EXTERNAL.match(path):
                todo.append((page.parent / path).resolve())
    return seen


def test_every_docs_page_is_reached_from_the_readme():
    # the parser still finds links, and no page of docs/ is an orphan: the README links to
    # each page directly or through a page it links to (the results pages through results.md)
    found = reachable(ROOT / "README.md")
    missing = [p.name for p in PAGES[1:] if p.resolve() not in found]
    assert missing == []
    targets = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    assert "docs/results.md" in targets and "docs/usage.md" in targets


def table_cells(line):
    """The cells of a markdown table row (``|`` inside inline code does not split)."""
    masked = INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), line.strip())
    cells, start = [], 1
    for i, ch in enumerate(masked[1:], 1):
        if ch == "|" and masked[i - 1] != "\\":
            cells.append(line.strip()[start:i].strip())
            start = i + 1
    return cells


def test_readme_is_the_short_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < README_MAX_LINES
    assert len(text.split()) <= README_MAX_WORDS  # what `wc -w` counts
    long_lines = [n for n, line in _prose_lines(text) if len(line) > README_MAX_LINE]
    assert long_lines == []
    long_cells = [(n, cell[:40]) for n, line in _prose_lines(text) if line.startswith("|")
                  for cell in table_cells(line) if len(cell) > README_MAX_CELL]
    assert long_cells == []


def test_readme_says_where_the_venv_comes_from_before_using_it():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "scripts/bootstrap.sh" in text and ".venv" in text
    assert text.index("scripts/bootstrap.sh") < text.index(".venv")
    assert text.index("make demo") < text.index("fairseq-train")


def test_table_cells_are_split_outside_inline_code():
    assert table_cells("| a | `x|y` | b c |") == ["a", "`x|y`", "b c"]


def test_the_results_report_is_read_in_half_an_hour():
    assert len((ROOT / "docs" / "results.md").read_text(encoding="utf-8").split()) \
        <= RESULTS_MAX_WORDS


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_names_a_tracker_issue(page):
    # a page says what a thing is, not which issue made it: also its headings' anchors
    hits = [f"{n}: {m.group(0)}" for n, line in enumerate(
        page.read_text(encoding="utf-8").splitlines(), 1) for m in ISSUE_NUMBER.finditer(line)]
    assert hits == []


WORD = "issue"  # the examples are built, so that this file names no tracker number itself


@pytest.mark.parametrize("text, found", [
    (f"fixed in {WORD} 22", True), (f"{WORD}s 39-41", True), (f"see {WORD}-22", True),
    (f"{WORD.title()} #7", True), (f"the {WORD}'s grid", False),
    (f"an {WORD} with 3 seeds", False),
])
def test_tracker_numbers_are_recognised(text, found):
    assert bool(ISSUE_NUMBER.search(text)) == found


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `--flag` (part 1)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#the---flag-part-1) [gone](docs/b.md) [bad](docs/a.md#nope)\n"
        "[self](#top) `[code](docs/c.md)`\n\n```\n[fenced](docs/d.md)\n```\n# Top\n"
        "![img](docs/e.png) [web](https://example.org/x.md)\n")
    found = [t for _, t in links(page)]
    assert found == ["docs/a.md#the---flag-part-1", "docs/b.md", "docs/a.md#nope", "#top",
                     "docs/e.png", "https://example.org/x.md"]
    problems = check(page, root=tmp_path)
    assert len(problems) == 3
    assert "docs/b.md does not exist" in problems[0]
    assert "no heading #nope" in problems[1]
    assert "docs/e.png does not exist" in problems[2]
