"""Where a pass over the data stands, and how a resumed pass skips what was seen unread.

run() takes a :func:`snapshot` of the randomness just before it starts each fresh pass
(``iter(data)``): the global RNG states (``checkpoints._rng``) and the states of the loader's
own generators. A pass resumed ``seen`` batches in (:func:`unseen`) puts that
randomness back, creates the iterator as the original pass did (so the DataLoader draws its
base seed and the sampler its permutation from the same states, in the same order), skips
the seen *index* batches without loading their samples, and then restores the RNG states
the training had, so dropout and augmentation continue their own streams. After a change
of the batch size (:func:`seen_after_change`), ``data_state["split"]`` names the batch the
change split and how many of its samples were trained: the resume leaves them out.
"""

import copy
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from toolkit._rng import capture_rng, restore_rng
from toolkit._tree import map_nested_tensor
from toolkit.step._step import _leading_dim

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
    """What a pass over ``data`` is made of: samples per batch, samples, batches (or None).

    The batch size is known for torch's own ``BatchSampler`` (a DataLoader's ``batch_size=``,
    or one passed as ``batch_sampler=``) and for a list or tuple of batches whose leading
    dimensions are all equal but the last one's.
    """
    samples = batches_per_epoch(getattr(data, "dataset", None))  # None has no length either
    sampler = getattr(data, "batch_sampler", None)  # torch's own, or one of batch_sampler=
    given = sampler.batch_size if type(sampler) is BatchSampler else None
    size = (data.batch_size or given) if isinstance(data, DataLoader) else None
    if isinstance(data, (list, tuple)):  # batches in memory: count their rows
        rows = [_leading_dim(batch) for batch in data]
        even = rows and None not in rows and len(set(rows[:-1])) <= 1
        size, samples = (rows[0], sum(rows)) if even else (None, None)  # type: ignore[arg-type]
    return {"batch_size": size, "samples": samples, "batches": batches_per_epoch(data)}


def seen_after_change(
    data: Any, seen: int, saved: Mapping, now: Mapping, data_state: Mapping
) -> tuple[int, int, str]:
    """Where ``seen`` batches of ``saved``'s pass over ``data`` are in ``now``'s: the batches
    seen whole, the samples seen of the next one (:func:`unseen` leaves them out), and that
    position in words.

    A changed batch size of a source that is not stateful is mapped by samples; with
    ``drop_last=True`` (full batches only) a batch the change split is left out of the pass
    instead. Any other change of a started pass cannot be mapped.

    Raises:
        ValueError: the saved position cannot be mapped onto the pass as it is now.
    """
    old, new = saved.get("batch_size") or 0, now.get("batch_size") or 0
    by_samples = bool(old and new) and not is_stateful(data)
    keys = ("samples", "world_size") + (() if by_samples else ("batch_size", "batches"))
    changed = [f"{k} {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]
    if changed and seen:
        raise ValueError(
            f"checkpoints: the checkpoint stopped {seen} batches into a pass over data with "
            f"other {', '.join(changed)}; that position cannot be mapped onto the data now "
            "without skipping or repeating samples. Resume with the saved settings until an "
            "epoch ends, or start fresh in another folder."
        )
    whole, part = divmod(seen * old + split_at(data_state, seen), new) if by_samples else (seen, 0)
    where = f"after {whole} batch{'es' * (whole != 1)}" + f" and {part} samples" * bool(part)
    if part and getattr(getattr(data, "batch_sampler", None), "drop_last", False):
        where += f"; drop_last=True leaves out the {new - part} unseen samples of batch {whole + 1}"
        whole, part = whole + 1, 0
    return whole, part, where


def snapshot(data: Any) -> dict[str, Any]:
    """The randomness a fresh pass over ``data`` draws from, taken just before ``iter(data)``.

    A tree of tensors and JSON values (it goes into checkpoints with the state).
    """
    generators = {role: _attr(data, role) for role in _ROLES}
    kept = {r: g.get_state() for r, g in generators.items() if isinstance(g, torch.Generator)}
    return {"rng": capture_rng(), **kept}


def unseen(data: Any, seen: int, snap: Mapping) -> tuple[Iterator[Any], str | None]:
    """An iterator over the current pass of ``data`` after its first ``seen`` batches (and
    the samples of the next one seen before a change of the batch size: ``snap["split"]``).

    Returns it with a warning text when the resume is not exact or must read the seen
    batches again (None when it is exact and reads nothing twice).
    """
    part = split_at(snap, seen)
    if isinstance(data, Sequence):  # in memory already: skipping reads nothing
        rest = itertools.islice(iter(data), seen, None)
        first = [_rows_after(batch, part) for batch in itertools.islice(rest, 1 if part else 0)]
        return itertools.chain(first, rest), _unless_snapshot(snap)
    training_state = capture_rng()
    if "rng" in snap:
        restore_rng(snap["rng"])
        restore_generators(data, snap)
    try:
        if isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
            loader, skipper = _skipping_copy(data, seen, part)
            iterator = iter(loader)  # draws the base seed, as the original pass did
            skipper.rest  # noqa: B018 (then the sampler's permutation; skips `seen` batches)
            return iterator, _persistent(data) or _unless_snapshot(snap)
        # Nothing to skip with: the seen batches are read again and dropped, under the
        # pass's own starting randomness.
        iterator = iter(data)
        next(itertools.islice(iterator, seen, seen), None)  # reads `seen` batches
        return iterator, _reads_again(data, seen, part)
    finally:
        restore_rng(training_state)


def split_at(snap: Mapping, seen: int) -> int:
    """The samples of batch ``seen`` trained before the batch size changed (0: none)."""
    at, part = snap.get("split", (-1, 0))
    return int(part) if at == seen else 0


def _rows_after(batch: Any, part: int) -> Any:
    """``batch`` without its first ``part`` rows (the tensors of its leading dimension)."""
    rows = _leading_dim(batch)
    return map_nested_tensor(lambda t: t[part:] if t.ndim and len(t) == rows else t, batch)


class _SkipFirst:
    """A batch sampler yielding ``inner``'s index batches after the first ``n``.

    Lazy, as samplers are (a RandomSampler draws its permutation at the first ``next``);
    :attr:`rest` draws and skips now, under the randomness of the pass, and only once (with
    worker processes the DataLoader starts iterating inside ``iter()``).
    """

    def __init__(self, inner: Any, n: int, part: int = 0) -> None:
        self.inner, self.n, self.part = inner, n, part

    @functools.cached_property
    def rest(self) -> list[Any]:
        rest = list(itertools.islice(self.inner, self.n, None))
        return [rest[0][self.part :], *rest[1:]] if rest and self.part else rest

    def __iter__(self) -> Iterator[Any]:  # lazy: iter(loader) draws the base seed first
        yield from self.rest

    def __len__(self) -> int:
        return max(len(self.inner) - self.n, 0)


def _skipping_copy(loader: DataLoader, seen: int, part: int) -> tuple[DataLoader, _SkipFirst]:
    """A shallow copy of ``loader`` whose index sampler skips the first ``seen`` batches
    (and ``part`` samples).

    DataLoader refuses to change its sampler once built; the copy is the resumed pass's
    loader only, and the original stays as it was for the passes after it.
    """
    clone = copy.copy(loader)
    clone._iterator = None  # not the original's persistent workers
    batched = loader.batch_sampler is not None
    skipper = _SkipFirst(loader.batch_sampler if batched else loader.sampler, seen, part)
    object.__setattr__(clone, "batch_sampler" if batched else "sampler", skipper)
    return clone, skipper


def _persistent(data: Any) -> str | None:
    # Its workers draw from the generator when they start, at another epoch on a resume.
    if getattr(data, "persistent_workers", False) and getattr(data, "num_workers", 0) > 0:
        return "persistent_workers=True draws from its generator as workers start: order differs"
    return None


def _unless_snapshot(snap: Mapping) -> str | None:
    why = "the state carries no record of the randomness this pass started from"
    return None if "rng" in snap else f"{why} (empty state.data_state), so the order may differ"


def _reads_again(data: Any, seen: int, part: int) -> str:
    said = {Iterator: "a one-shot iterator", DataLoader: "a DataLoader over an IterableDataset"}
    what = next((w for k, w in said.items() if isinstance(data, k)), f"a {type(data).__name__}")
    again = f"; {part} samples trained before the batch size changed are trained again"
    return (
        f"resuming {what}: its first {seen} batches of this pass were read again and dropped"
        f"{again * bool(part)}; a DataLoader over a map-style dataset, a list or a "
        "StatefulDataLoader skips them unread"
    )


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name, None)
    return obj
