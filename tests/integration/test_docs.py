"""Every public name is documented, and every docstring example runs."""

from __future__ import annotations

import doctest
import inspect
import re

import pytest

import toolkit
import toolkit.plugins

PUBLIC = [(toolkit, name) for name in toolkit.__all__] + [
    (toolkit.plugins, name) for name in toolkit.plugins.__all__
]
NEEDS = {"wandb": "wandb", "tensorboard": "tensorboard", "png_dir": "PIL"}


def _kind(obj: object) -> str:
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        return "exception"
    if inspect.isclass(obj):
        return "class"
    return "function"


REQUIRED = {
    "function": ("Args:", "Returns:", "Raises:", "Example:"),
    "class": ("Example:",),
    "exception": ("Example:",),
}


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[n for _, n in PUBLIC])
def test_public_name_has_a_complete_docstring(module: object, name: str) -> None:
    obj = getattr(module, name)
    doc = inspect.getdoc(obj) or ""
    kind = _kind(obj)
    missing = [section for section in REQUIRED[kind] if section not in doc]
    assert not missing, f"{module.__name__}.{name} ({kind}) lacks {missing} in its docstring"
    if kind == "class":
        assert "Attributes:" in doc or "Args:" in doc, f"{name}: document the fields"


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[n for _, n in PUBLIC])
def test_docstring_examples_run(module: object, name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    obj = getattr(module, name)
    finder = doctest.DocTestFinder(recurse=True)
    tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
    assert tests, f"{name} has no runnable example"
    for example in (example for test in tests for example in test.examples):
        imported = re.match(r"(?:from|import) (\w+)", example.source)  # an optional extra's
        if imported:
            pytest.importorskip(imported[1], reason=f"{name}'s example imports {imported[1]}")
    if name in NEEDS:  # the example builds what imports the package
        pytest.importorskip(NEEDS[name], reason=f"{name}'s example needs {NEEDS[name]}")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"
