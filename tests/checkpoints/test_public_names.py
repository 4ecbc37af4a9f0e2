"""toolkit.checkpoints: every public name documented, every docstring example run."""

from __future__ import annotations

import doctest
import inspect
from pathlib import Path

import pytest

import toolkit.checkpoints

NAMES = [n for n in toolkit.checkpoints.__all__ if not n.isupper()]  # constants have no docs


@pytest.mark.parametrize("name", NAMES)
def test_public_name_is_documented_with_an_example_that_runs(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # examples write their checkpoints here
    obj = getattr(toolkit.checkpoints, name)
    doc = inspect.getdoc(obj) or ""
    sections = (
        ("Example:",) if inspect.isclass(obj) else ("Args:", "Returns:", "Raises:", "Example:")
    )
    assert [s for s in sections if s not in doc] == [], name
    tests = [t for t in doctest.DocTestFinder().find(obj, name, globs={}) if t.examples]
    assert tests, f"{name} has no runnable example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
