"""Argument checks shared by the public functions, so their errors read alike."""

from __future__ import annotations

from typing import Any

__all__ = ["check_count", "check_key"]


def check_count(who: str, name: str, value: Any, least: int, meaning: str = "") -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``least``.

    The message reads ``"{who}: {name} must be an int >= {least} ({meaning}); got {value!r}."``,
    the part in parentheses only when given.

    Example:
        >>> check_count("progress", "every", 0, 1, "updates between refreshes")
        Traceback (most recent call last):
        ...
        ValueError: progress: every must be an int >= 1 (updates between refreshes); got 0.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{who}: {name} must be an int >= {least}{what}; got {value!r}.")


def check_key(who: str, key: Any) -> None:
    """Raise ValueError unless ``key`` (a plugin's ``state.extras`` key) is a non-empty str.

    Example:
        >>> check_key("ema", "")
        Traceback (most recent call last):
        ...
        ValueError: ema: key must be a non-empty string (the state.extras key); got ''.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(
            f"{who}: key must be a non-empty string (the state.extras key); got {key!r}."
        )
