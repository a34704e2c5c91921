"""The documentation stays true to its sources: the generated benchmarks page, the links."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Markdown files people read: the front page, the guides and design notes, the changelog,
# the examples' stories.
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md"),
     *(ROOT / "examples").rglob("*.md")]
)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _render_docs() -> Any:
    spec = importlib.util.spec_from_file_location(
        "render_docs", ROOT / "benchmarks" / "render_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_what_render_docs_writes(tmp_path: Path) -> None:
    render = _render_docs()
    page = render.render(ROOT / "benchmarks" / "results", tmp_path, plots=False)
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert page.read_text() == committed, (
        "docs/benchmarks.md is not what benchmarks/render_docs.py writes from "
        "benchmarks/results/*.json: run `python3 benchmarks/render_docs.py` and commit the page"
    )
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", committed):
        assert (ROOT / "docs" / image).is_file(), f"docs/benchmarks.md shows missing {image}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = _FENCE.sub("", page.read_text())
    anchors = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        anchors.add("".join(c for c in heading.lower() if c.isalnum() or c in " -_")
                    .replace(" ", "-"))
    return anchors


def test_relative_links_point_to_files_and_headings_that_exist() -> None:
    broken = []
    for page in PAGES:
        text = _FENCE.sub("", page.read_text())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
