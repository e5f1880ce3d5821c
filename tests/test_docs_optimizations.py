"""docs/optimizations.md and docs/long-context.md against the repo: every patch of the series has its own section,
and every results file the two documents cite exists (issue #18 item 7, issue #20 item 5)."""

from __future__ import annotations

import re
from pathlib import Path

from qwen_serving.patchset import read_series

REPO = Path(__file__).resolve().parents[1]
OPTIMIZATIONS = REPO / "docs" / "optimizations.md"
LONG_CONTEXT = REPO / "docs" / "long-context.md"
HEADING = re.compile(r"^#{2,6} +(.*)$", re.M)
RESULTS_PATH = re.compile(r"bench/results/[A-Za-z0-9_.\-/]+?\.json")


def sections(text: str) -> dict[str, str]:
    """Each heading's text -> the body up to the next heading."""
    marks = list(HEADING.finditer(text))
    return {m.group(1): text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)]
            for i, m in enumerate(marks)}


def patches_without_a_section(text: str, patch_names: list[str]) -> list[str]:
    """Patches that no heading names (as `name.patch`), or whose only heading has an empty body."""
    found = sections(text)
    missing = []
    for name in patch_names:
        bodies = [body for heading, body in found.items() if f"`{name}`" in heading]
        if len(bodies) != 1 or not bodies[0].strip():
            missing.append(name)
    return missing


def cited_results(text: str) -> set[str]:
    return set(RESULTS_PATH.findall(text))


def test_every_patch_in_the_series_has_its_own_section():
    names = [p.name for p in read_series(REPO / "patches" / "series")]
    assert names, "patches/series lists no patch"
    assert patches_without_a_section(OPTIMIZATIONS.read_text(), names) == []


def test_a_patch_without_a_section_is_caught():
    doc = "## Patches\n### `a.patch`: one\ntext\n### `b.patch`\n\n## Other\nmentions `c.patch` in prose\n"
    assert patches_without_a_section(doc, ["a.patch", "b.patch", "c.patch"]) == ["b.patch", "c.patch"]
    doc_twice = "### `a.patch`\nx\n### `a.patch` again\ny\n"
    assert patches_without_a_section(doc_twice, ["a.patch"]) == ["a.patch"]


def test_every_cited_results_file_exists():
    for doc in (OPTIMIZATIONS, LONG_CONTEXT):
        cited = cited_results(doc.read_text())
        assert cited, f"{doc.name} cites no bench/results file"
        absent = sorted(path for path in cited if not (REPO / path).is_file())
        assert absent == [], f"{doc.name} cites results files that do not exist: {absent}"


def test_a_missing_results_file_is_caught():
    text = "see `bench/results/kernels-h200.json` and bench/results/no-such-run-h200.json."
    cited = cited_results(text)
    assert cited == {"bench/results/kernels-h200.json", "bench/results/no-such-run-h200.json"}
    assert [p for p in sorted(cited) if not (REPO / p).is_file()] == ["bench/results/no-such-run-h200.json"]


def test_the_readme_links_both_documents():
    readme = (REPO / "README.md").read_text()
    for doc in (OPTIMIZATIONS, LONG_CONTEXT):
        assert doc.name in readme, f"README.md does not link docs/{doc.name}"
