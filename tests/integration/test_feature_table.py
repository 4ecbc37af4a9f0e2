"""The README's feature table and the coming-from guides cite only tests that exist (issue
12, item 14: no cell claims what no test shows)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("coming-from-*.md"))]


def _feature_table() -> str:
    """The README's "Feature table" section, up to the next top-level heading."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Feature table\n")
    return text[start : text.index("\n## ", start + 1)]


CITATION = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _citations(text: str) -> list[tuple[str, str]]:
    return CITATION.findall(text)


def _missing(text: str) -> list[str]:
    """The tests ``text`` cites that no test file defines."""
    missing = []
    for path, name in _citations(text):
        source = ROOT / path
        if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_cited_test_exists(doc: pathlib.Path) -> None:
    missing = _missing(doc.read_text())
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


def test_the_table_cites_tests_in_each_section() -> None:
    sections = _feature_table().split("\n### ")[1:-1]  # the last: what toolkit does not do
    assert len(sections) >= 5
    for section in sections:
        rows = [
            line for line in section.splitlines() if line.startswith("| ") and "---" not in line
        ]
        uncited = [row.split("|")[1].strip() for row in rows[1:] if not _citations(row)]
        assert not uncited, f"rows without a test: {uncited}"


COLUMNS = ["capability", "MT", "AH", "PA", "F2", "VO", "LF", "HA", "HT", "toolkit: function, test"]


def test_every_row_has_a_cell_for_each_of_the_eight_trainers() -> None:
    sections = _feature_table().split("\n### ")[1:-2]  # the last two: quick starts, not done
    assert len(sections) >= 5
    for section in sections:
        rows = [line for line in section.splitlines() if line.startswith("| ")]
        header = [cell.strip() for cell in rows[0].strip("|").split(" | ")]
        assert header == COLUMNS, section.splitlines()[0]
        for row in rows[2:]:
            cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
            assert len(cells) == len(COLUMNS) and all(cells), row


@pytest.mark.parametrize("library", ["hf-trainer", "accelerate", "fabric"])
def test_each_new_guide_names_its_comparison_script_and_test(library: str) -> None:
    guide = (ROOT / "docs" / f"coming-from-{library}.md").read_text()
    script = f"examples/compare_{library.replace('-', '_')}.py"
    assert script in guide and (ROOT / script).is_file()
    assert "tests/integration/test_coming_from.py" in {path for path, _ in _citations(guide)}
    table = _feature_table()
    assert f"`{script}`" in table, f"the quick-start table lacks {script}"


def test_a_cell_citing_a_test_that_does_not_exist_is_reported() -> None:
    real = "tests/integration/test_layers.py::test_the_import_graph_has_no_circle"
    cell = f"`tests/loop/test_loop.py::test_nope`, `{real}`"
    assert _missing(cell) == ["tests/loop/test_loop.py::test_nope"]
    assert _missing("`tests/no_such_file.py::test_x`") == ["tests/no_such_file.py::test_x"]
