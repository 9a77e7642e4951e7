"""The README and docs/: every relative link reaches a file of the checkout, and every #anchor into a Markdown file
names one of its headings (GitHub's slugs), so moving a section cannot leave a dead link behind."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped except - and _, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_slug_follows_github():
    assert slug(" Does 4-bit RL cost accuracy? Seeds (issue 42)") == "does-4-bit-rl-cost-accuracy-seeds-issue-42"
    assert slug("A real pretrained model: Qwen2.5-Coder-1.5B-Instruct") == (
        "a-real-pretrained-model-qwen25-coder-15b-instruct"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_reach_files_and_headings(page):
    dead = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target}: no such heading in {file.relative_to(REPO)}")
    assert not dead, f"{page.relative_to(REPO)}: " + "; ".join(dead)
