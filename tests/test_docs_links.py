"""Every relative link of the README, docs/ and bench/RESULTS.md points at a file (and heading) that exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "RESULTS.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
README_MAX_LINES = 130


def _links(doc: Path) -> list[str]:
    """Markdown link targets outside code fences, external ones left out."""
    text = FENCE.sub("", doc.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.*)$", FENCE.sub("", doc.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _broken(doc: Path) -> list[str]:
    broken = []
    for target in _links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no such heading in {dest.name})")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    assert doc.exists()
    assert not _broken(doc), f"{doc.relative_to(ROOT)}: broken links {_broken(doc)}"


def test_the_docs_folder_has_the_four_guides():
    names = {p.name for p in DOCS}
    assert {"architecture.md", "operations.md", "api.md", "benchmarks.md"} <= names


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "make serve" in text and "make test" in text
    assert all(f"docs/{name}" in text for name in ("architecture.md", "operations.md", "api.md", "benchmarks.md"))


def test_a_broken_link_is_found(tmp_path):
    doc = tmp_path / "x.md"
    (tmp_path / "y.md").write_text("# A heading\n")
    doc.write_text("[ok](y.md#a-heading) [bad](missing.md) [bad anchor](y.md#nope) [web](https://example.com)\n"
                   "```\n[in a fence](nowhere.md)\n```\n")
    assert _broken(doc) == ["missing.md (no such file)", "y.md#nope (no such heading in y.md)"]
