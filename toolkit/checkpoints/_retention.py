"""Retention: which checkpoints to keep, as a pure function of what is on disk.

The kept set is the union of the rules (keep the last N, every M-th step, explicit steps,
the best K by a metric); the newest checkpoint is always kept. The input is each
checkpoint's name, step and manifest metrics, read from disk, so the decision is the same
after a restart as before it; the rules go into every manifest so that the shell tool can
say which rule keeps which checkpoint.
"""

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from toolkit._checks import check, check_count, check_one_of

RULE_NAMES = ("newest", "keep_last", "keep_every", "keep_steps", "keep_best")


@dataclasses.dataclass(frozen=True)
class Retention:
    """Retention rules; a checkpoint is kept when any rule keeps it.

    Attributes:
        keep_last: keep the ``keep_last`` checkpoints with the highest steps (0: none by
            this rule; the newest is kept anyway).
        keep_every: keep every checkpoint whose step is a multiple of it (``None``: off).
        keep_steps: keep the checkpoints of these steps.
        keep_best: keep the ``keep_best`` checkpoints with the best ``metric`` (0: off);
            checkpoints whose manifest lacks the metric, or holds NaN, never count as best.
        metric: the manifest metric ``keep_best`` ranks by (a key of ``metrics=`` given to
            ``save_checkpoint``).
        mode: ``"min"`` (lower is better) or ``"max"``.
        keep_full: keep the optimizer, scheduler, scaler, RNG states, ``objects`` and
            other ranks' files only in the ``keep_full`` newest full checkpoints (``None``:
            in all); older intact ones that a rule keeps are reduced to model-only (weights,
            TrainState's fields, ``extras`` such as EMA) when pruning, as fairseq2's
            ``keep_last_n_models``; sharded (FSDP2) ones stay full. Resume skips model-only
            checkpoints; :func:`toolkit.checkpoints.export_model` still reads them.

    Example:
        >>> from toolkit.checkpoints import Retention
        >>> Retention(keep_last=2, keep_best=1, metric="val/loss").describe()
        'keep_last=2, keep_best=1 by val/loss (min)'
    """

    keep_last: int = 1
    keep_every: int | None = None
    keep_steps: tuple[int, ...] = ()
    keep_best: int = 0
    metric: str | None = None
    mode: str = "min"
    keep_full: int | None = None

    def __post_init__(self) -> None:
        who, steps = "Retention", self.keep_steps
        check_count(who, "keep_last", self.keep_last, 0)
        check_count(who, "keep_best", self.keep_best, 0)
        for name in ("keep_every", "keep_full"):  # None: off
            if getattr(self, name) is not None:
                check_count(who, name, getattr(self, name), 1, "or None")
        ints = all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
        check(ints and not isinstance(steps, str), who, "keep_steps", "a sequence of ints", steps)
        object.__setattr__(self, "keep_steps", tuple(sorted(set(steps))))
        check_one_of(who, "mode", self.mode, ("min", "max"))
        named = not self.keep_best or (isinstance(self.metric, str) and bool(self.metric))
        what = f"the manifest metric to rank by (e.g. 'val/loss') with keep_best={self.keep_best}"
        check(named, who, "metric", what, self.metric)

    def to_document(self) -> dict[str, Any]:
        """The rules as a JSON object (as recorded in each manifest)."""
        return {**dataclasses.asdict(self), "keep_steps": list(self.keep_steps)}

    def describe(self) -> str:
        """The active rules in one line, e.g. ``keep_last=2, keep_every=1000``."""
        values = self.to_document()
        values["keep_best"] = self.keep_best and f"{self.keep_best} by {self.metric} ({self.mode})"
        names = ("keep_last", "keep_every", "keep_steps", "keep_full", "keep_best")
        return ", ".join(f"{n}={values[n]}" for n in names if values[n] or n == "keep_last")


def retention_from_document(document: Mapping[str, Any]) -> Retention:
    """The :class:`Retention` a manifest recorded (unknown keys are an error)."""
    return Retention(**{**document, "keep_steps": tuple(document.get("keep_steps", ()))})


def retain(
    checkpoints: Iterable[tuple[str, int, Mapping[str, float]]], rules: Retention
) -> dict[str, tuple[str, ...]]:
    """Which checkpoints the rules keep, and why.

    Args:
        checkpoints: ``(name, step, metrics)`` of each checkpoint on disk, in any order.
        rules: the retention rules.

    Returns:
        ``{name: reasons}`` for every checkpoint, where ``reasons`` are the names of the
        rules that keep it (from ``"newest"``, ``"keep_last"``, ``"keep_every"``,
        ``"keep_steps"``, ``"keep_best"``, in that order); an empty tuple means the
        checkpoint may be deleted. Ties in step are broken by name, ties in the metric by
        the higher step (the later checkpoint of equal score is preferred).

    Raises:
        Nothing: the rules were checked when the :class:`Retention` was made.

    Example:
        >>> from toolkit.checkpoints import Retention, retain
        >>> on_disk = [("a", 100, {"loss": 0.2}), ("b", 200, {"loss": 0.5}), ("c", 300, {})]
        >>> retain(on_disk, Retention(keep_last=1, keep_best=1, metric="loss"))
        {'a': ('keep_best',), 'b': (), 'c': ('newest', 'keep_last')}
    """
    items = list(checkpoints)
    if not items:
        return {}
    by_step = sorted(items, key=lambda item: (item[1], item[0]), reverse=True)
    metric = rules.metric if rules.keep_best and rules.metric else ""  # none is read when off
    every, sign = rules.keep_every, 1 if rules.mode == "min" else -1
    scored = [(sign * float(m[metric]), -step, name) for name, step, m in items if metric in m]
    best = sorted(s for s in scored if not math.isnan(s[0]))  # better, then later, then by name
    kept = {
        "newest": {name for name, step, _ in items if step == by_step[0][1]},
        "keep_last": {name for name, _, _ in by_step[: rules.keep_last]},
        "keep_every": {name for name, step, _ in items if every and step % every == 0},
        "keep_steps": {name for name, step, _ in items if step in rules.keep_steps},
        "keep_best": {name for _, _, name in best[: rules.keep_best]},
    }
    return {name: tuple(rule for rule in RULE_NAMES if name in kept[rule]) for name, _, _ in items}
