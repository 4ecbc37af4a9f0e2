"""Where a pass over the data stands, and how a resumed pass skips what was seen unread.

run() takes a :func:`snapshot` of the randomness just before it starts each fresh pass
(``iter(data)``): the global RNG states (``checkpoints._rng``) and the states of the loader's
own generators. A pass resumed ``seen`` batches in (:func:`unseen`) puts that
randomness back, creates the iterator as the original pass did (so the DataLoader draws its
base seed and the sampler its permutation from the same states, in the same order), skips
the seen *index* batches without loading their samples, and then restores the RNG states
the training had, so dropout and augmentation continue their own streams.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from toolkit._rng import capture_rng, restore_rng

__all__ = ["batches_per_epoch", "is_stateful", "pass_settings", "position",
           "restore_generators", "seen_after_change", "snapshot", "unseen"]  # fmt: skip

# Where a DataLoader keeps the generators its passes draw from.
_ROLES = ("generator", "sampler.generator", "batch_sampler.sampler.generator")


def batches_per_epoch(data: Any) -> int | None:
    """``len(data)``, or None when it has no length (a DataLoader over an IterableDataset)."""
    try:
        return len(data)
    except (TypeError, NotImplementedError):  # no __len__, or one that refuses
        return None


def is_stateful(data: Any) -> bool:
    """A source that saves its own position (torchdata's StatefulDataLoader)."""
    return all(callable(getattr(data, name, None)) for name in ("state_dict", "load_state_dict"))


def position(data: Any, data_state: Any, between_passes: bool = False) -> dict[str, Any]:
    """``data_state`` with a stateful source's own position (its ``state_dict()``) added.

    Taken when a checkpoint is written: the source's position moves with every batch, so
    run() does not record it per batch. ``between_passes`` (no batch of the next pass
    drawn yet): the randomness that pass will draw from is taken now instead, since the
    loader's own generator moved on during the pass before (see :func:`restore_generators`).
    """
    if between_passes and not isinstance(data, Iterator):
        data_state = snapshot(data)
    return {**data_state, "loader": data.state_dict()} if is_stateful(data) else dict(data_state)


def restore_generators(data: Any, data_state: Mapping[str, Any]) -> None:
    """Put back the states of ``data``'s own generators that ``data_state`` recorded."""
    for role in _ROLES:
        generator = _attr(data, role)
        if role in data_state and isinstance(generator, torch.Generator):
            generator.set_state(data_state[role])


def pass_settings(data: Any) -> dict[str, Any]:
    """What a pass over ``data`` is made of: samples per batch, samples, batches (or None)."""
    samples = batches_per_epoch(getattr(data, "dataset", None))  # None has no length either
    size = data.batch_size if isinstance(data, DataLoader) else None
    return {"batch_size": size, "samples": samples, "batches": batches_per_epoch(data)}


def seen_after_change(data: Any, seen: int, saved: Mapping, now: Mapping) -> int:
    """The batches of ``now``'s pass over ``data`` that hold ``seen`` batches of ``saved``'s.

    A changed batch size of a DataLoader that is not stateful is mapped by samples (rounded
    down: a partly seen batch is read again, no unseen sample skipped); any other change of
    a started pass cannot be mapped.

    Raises:
        ValueError: the saved position cannot be mapped onto the pass as it is now.
    """
    old, new = saved.get("batch_size") or 0, now.get("batch_size") or 0
    by_samples = bool(old and new) and not is_stateful(data)
    keys = ("samples", "world_size") + (() if by_samples else ("batch_size", "batches"))
    changed = [f"{k} {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]
    if changed:
        raise ValueError(
            f"checkpoints: the checkpoint stopped {seen} batches into a pass over data with "
            f"other {', '.join(changed)}; that position cannot be mapped onto the data now "
            "without skipping or repeating samples. Resume with the saved settings until an "
            "epoch ends, or start fresh in another folder."
        )
    return seen * old // new if by_samples else seen


def snapshot(data: Any) -> dict[str, Any]:
    """The randomness a fresh pass over ``data`` draws from, taken just before ``iter(data)``.

    A tree of tensors and JSON values (it goes into checkpoints with the state).
    """
    generators = {role: _attr(data, role) for role in _ROLES}
    kept = {r: g.get_state() for r, g in generators.items() if isinstance(g, torch.Generator)}
    return {"rng": capture_rng(), **kept}


def unseen(data: Any, seen: int, snap: Any) -> tuple[Iterator[Any], str | None]:
    """An iterator over the current pass of ``data`` after its first ``seen`` batches.

    Returns it with a warning text when the resume is not exact or must read the seen
    batches again (None when it is exact and reads nothing twice).
    """
    if isinstance(data, Sequence):  # in memory already: skipping reads nothing
        return itertools.islice(iter(data), seen, None), _unless_snapshot(snap)
    training_state = capture_rng()
    if snap:
        restore_rng(snap["rng"])
        restore_generators(data, snap)
    try:
        if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
            loader, skipper = _skipping_copy(data, seen)
            iterator = iter(loader)  # draws the base seed, as the original pass did
            skipper.rest  # noqa: B018 (then the sampler's permutation; skips `seen` batches)
            return iterator, _persistent(data) or _unless_snapshot(snap)
        # Nothing to skip with: the seen batches are read again and dropped, under the
        # pass's own starting randomness.
        iterator = iter(data)
        next(itertools.islice(iterator, seen, seen), None)  # reads `seen` batches
        return iterator, _reads_again(data, seen)
    finally:
        restore_rng(training_state)


class _SkipFirst:
    """A batch sampler yielding ``inner``'s index batches after the first ``n``.

    Lazy, as samplers are (a RandomSampler draws its permutation at the first ``next``);
    :attr:`rest` draws and skips now, under the randomness of the pass, and only once (with
    worker processes the DataLoader starts iterating inside ``iter()``).
    """

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    @functools.cached_property
    def rest(self) -> list[Any]:
        return list(itertools.islice(self.inner, self.n, None))

    def __iter__(self) -> Iterator[Any]:  # lazy: iter(loader) draws the base seed first
        yield from self.rest

    def __len__(self) -> int:
        return max(len(self.inner) - self.n, 0)


def _skipping_copy(loader: DataLoader, seen: int) -> tuple[DataLoader, _SkipFirst]:
    """A shallow copy of ``loader`` whose index sampler skips the first ``seen`` batches.

    DataLoader refuses to change its sampler once built; the copy is the resumed pass's
    loader only, and the original stays as it was for the passes after it.
    """
    clone = copy.copy(loader)
    clone._iterator = None  # not the original's persistent workers
    batched = loader.batch_sampler is not None
    skipper = _SkipFirst(loader.batch_sampler if batched else loader.sampler, seen)
    object.__setattr__(clone, "batch_sampler" if batched else "sampler", skipper)
    return clone, skipper


def _persistent(data: Any) -> str | None:
    # Its workers draw from the generator when they start, at another epoch on a resume.
    if getattr(data, "persistent_workers", False) and getattr(data, "num_workers", 0) > 0:
        return "persistent_workers=True draws from its generator as workers start: order differs"
    return None


def _unless_snapshot(snap: Any) -> str | None:
    why = "the state carries no record of the randomness this pass started from"
    return None if snap else f"{why} (empty state.data_state), so the order may differ"


def _reads_again(data: Any, seen: int) -> str:
    said = {Iterator: "a one-shot iterator", DataLoader: "a DataLoader over an IterableDataset"}
    what = next((w for k, w in said.items() if isinstance(data, k)), f"a {type(data).__name__}")
    return (
        f"resuming {what}: its first {seen} batches of this pass were read again and dropped; "
        "a DataLoader over a map-style dataset, a list or a StatefulDataLoader skips them unread"
    )


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj
