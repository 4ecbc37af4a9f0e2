"""Argument checks shared by the public functions, so their errors read alike:
``"{who}: {name} must be {expected}; got {value!r}."``, then the fix when there is one."""

import math
import os
import pathlib
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import torch


def check(
    ok: bool, who: str, name: str, expected: str, got: Any, fix: str = "", error: type = ValueError
) -> None:
    """Raise ``error`` unless ``ok``, with the one sentence: expected, got, then the fix.

    Example:
        >>> check(False, "plot", "out", "a folder", 3, "pass a path.", TypeError)
        Traceback (most recent call last):
        ...
        TypeError: plot: out must be a folder; got 3. pass a path.
    """
    if not ok:
        raise error(f"{who}: {name} must be {expected}; got {got!r}." + (f" {fix}" if fix else ""))


def check_type(ok: bool, who: str, name: str, expected: str, value: Any, fix: str = "") -> None:
    """Raise TypeError unless ``ok``, naming ``value``'s type, not its repr (a model, a batch).

    Example:
        >>> check_type(False, "unwrap", "model", "a torch.nn.Module", [], "Pass state.model.")
        Traceback (most recent call last):
        ...
        TypeError: unwrap: model must be a torch.nn.Module; got a list. Pass state.model.
    """
    if not ok:
        said = f"{who}: {name} must be {expected}; got a {type(value).__name__}."
        raise TypeError(said + (f" {fix}" if fix else ""))


def refuse(who: str, name: str, got: str, expected: str, error: type = ValueError) -> NoReturn:
    """Raise ``error`` saying what ``name`` is (``got``: a description) and what was expected.

    For values a repr would not show well (a tensor, a key path, a mix of two records).

    Example:
        >>> refuse("key_average", "records[1]", "a list", "a mapping", TypeError)
        Traceback (most recent call last):
        ...
        TypeError: key_average: records[1] is a list; expected a mapping.
    """
    raise error(f"{who}: {name} is {got}; expected {expected}.")


def describe(value: Any) -> str:
    """``value`` in a few words for a message: a tensor's dtype and shape, else type and repr.

    Example:
        >>> import torch
        >>> describe(torch.ones(2)), describe("fast")
        ('a torch.float32 tensor of shape (2,)', "a str ('fast')")
    """
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__} ({value!r:.40})"


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside toolkit: the user's call, at any
    depth (a plugin's warning at the ``run(...)`` line, not at the plugin's own line)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_PACKAGE = str(pathlib.Path(__file__).parent) + os.sep


def check_bool(who: str, name: str, value: Any) -> None:
    """Raise TypeError unless ``value`` is True or False (not 0, 1 or None)."""
    check(isinstance(value, bool), who, name, "True or False", value, error=TypeError)


def check_count(who: str, name: str, value: Any, least: int, meaning: str = "") -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``least``.

    Example:
        >>> check_count("progress", "every", 0, 1, "updates between refreshes")
        Traceback (most recent call last):
        ...
        ValueError: progress: every must be an int >= 1 (updates between refreshes); got 0.
    """
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    check(ok, who, name, f"an int >= {least}" + (f" ({meaning})" if meaning else ""), value)


def check_key(who: str, key: Any) -> None:
    """Raise ValueError unless ``key`` (a plugin's ``state.extras`` key) is a non-empty str.

    Example:
        >>> check_key("ema", "")
        Traceback (most recent call last):
        ...
        ValueError: ema: key must be a non-empty string (the state.extras key); got ''.
    """
    ok = isinstance(key, str) and bool(key)
    check(ok, who, "key", "a non-empty string (the state.extras key)", key)


def check_one_of(who: str, name: str, value: Any, choices: Sequence[Any], meaning: str = "") -> Any:
    """``value``, or ValueError naming the ``choices`` when it is none of them."""
    check(value in choices, who, name, f"one of {list(choices)}{meaning}", value)
    return value


def check_positive(who: str, name: str, value: Any, example: str) -> float:
    """``value`` as a float, or ValueError unless it is a finite number > 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and value > 0
    check(ok, who, name, f"a number > 0, e.g. {example}", value)
    return float(value)


def check_names(who: str, name: str, value: Any) -> list[str]:
    """``value`` as a list of str, or TypeError unless it is an iterable of str (not a str)."""
    names = list(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    ok = names is not None and all(isinstance(n, str) for n in names)
    check(ok, who, name, "a list of record names, e.g. ['ntokens']", value, error=TypeError)
    return names  # type: ignore[return-value]


def check_path(who: str, name: str, value: Any) -> pathlib.Path:
    """``value`` as a Path, or TypeError unless it is a str or os.PathLike."""
    ok = isinstance(value, (str, os.PathLike))
    check(ok, who, name, "a path (str or os.PathLike)", value, error=TypeError)
    return pathlib.Path(value)
