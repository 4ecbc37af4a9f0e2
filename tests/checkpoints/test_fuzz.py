"""Fuzz: a real checkpoint folder corrupted in hundreds of ways is refused cleanly or loads exactly.

One checkpoint (a model with buffers, AdamW state in two parameter
groups, a SequentialLR, the RNG states, an extra object, an EMA of the ema plugin) is
written once; each case copies it and corrupts the copy in one way (bit flips anywhere,
also in manifest.json and safetensors headers; truncation; appended bytes; two files
swapped; a file deleted or emptied; a JSON value replaced; and, always re-signed, what a
checkpoint says about itself made to disagree: optimizer state of another shape or dtype
than its parameter, a tensor reference to bytes of another dtype and shape, a parameter
the model lacks, a step that state.json or the folder's name contradicts, model weights
re-typed or not finite, an EMA of another shape or name: these must be refused), or leaves
it untouched (the control, which must load exactly). About half the other cases are then
"re-signed": the manifest's sizes and checksums (and its own checksum) are recomputed, as
a buggy writer or a hostile hand would, so that the content checks behind the checksums
are exercised, not only the checksums. Each case must end in one of:

- refused with :class:`DamagedCheckpointError`, or a ``ValueError`` naming the folder
  (another format, does not fit the template), with the template bitwise unchanged:
  parameters, buffers, optimizer and scheduler state, the extra object, every RNG state;
- loaded: exactly the saved values when the bytes were not re-signed; when they were,
  values that a run can use (finite hyperparameters, counters that are non-negative ints,
  and run() resumes the state for one more update without an error).

No case may hang (each has a deadline) or raise another exception type, and
:func:`verify_checkpoint` must agree with the load: damage it reports is refused by the
load, and damage the load reports (DamagedCheckpointError) is reported by it; so must
``python -m toolkit.checkpoints CASE --verify`` (exit 1 with the same line, else 0).

Pointers and links in the folder of checkpoints (a ``latest`` that is a FIFO, a sparse
gigabyte, a name or a link leading outside, a newer ``step_*`` linked outside) are said by
the listing and ``--verify`` and skipped by load_latest, which loads the intact checkpoint
exactly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn
from torch.optim import lr_scheduler as lrs
from torch.utils.data import DataLoader, TensorDataset

from toolkit import TrainState, load_checkpoint, make_step, run, save_checkpoint
from toolkit.checkpoints import DamagedCheckpointError, load_latest, main, verify_checkpoint
from toolkit.plugins import ema

CASES = 600
SEED = 17
DEADLINE_S = 10  # per case: a load that takes longer is a hang
MANIFEST = "manifest.json"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6)  # buffers: running statistics, an int64 counter
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


class Meter:
    """An extra object saved through ``objects=``: numbers, a string, a tensor."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).square().mean()


def _data() -> DataLoader[Any]:
    """Four shuffled batches: a resumed pass redraws its order from the saved RNG states."""
    return DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=5, shuffle=True)


def _build(seed: int, updates: int) -> tuple[TrainState, Meter]:
    """A state ``updates`` into its first pass (AdamW state, an EMA) and an extra object."""
    torch.manual_seed(seed)
    model = Net()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW(
        [{"params": weights}, {"params": others, "weight_decay": 0.0, "lr": 2e-2}], lr=1e-2
    )
    warm = lrs.LinearLR(optimizer, start_factor=0.1, total_iters=2)
    scheduler = lrs.SequentialLR(
        optimizer, [warm, lrs.ExponentialLR(optimizer, gamma=0.9)], milestones=[2]
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler)
    plugins = [ema(0.9, buffers=True)]
    state = run(make_step(_loss), state, _data(), max_steps=updates, plugins=plugins)
    meter = Meter({"count": seed + 3, "name": f"meter{seed}", "sum": torch.full((3,), seed + 0.5)})
    return state, meter


# ----------------------------------------------------------------------------------------
# Bitwise snapshots of everything a load may touch.


def _rng() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
    }


def _snapshot(state: TrainState, meter: Meter) -> dict[str, Any]:
    fields = {
        f.name: getattr(state, f.name)
        for f in dataclasses.fields(state)
        if f.name not in ("model", "optimizer", "scheduler", "scaler")
    }
    return copy.deepcopy(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "objects": meter.state,
            "rng": _rng(),
            "fields": fields,
        }
    )


def _differ(a: Any, b: Any, path: str = "") -> Iterator[str]:
    """The paths where ``a`` and ``b`` differ: type, keys, tensor dtype/shape/bytes, value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(_bytes(a), _bytes(b))
        )
        yield from () if same else [path]
    elif isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray):
        yield from () if numpy.array_equal(a, b) else [path]
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            yield f"{path} (keys)"
        for key in a.keys() & b.keys():
            yield from _differ(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _differ(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a) and type(a) is type(b):
        yield from _differ(dataclasses.asdict(a), dataclasses.asdict(b), path)  # type: ignore[arg-type]
    elif type(a) is not type(b) or (a != b and not (a != a and b != b)):  # NaN == NaN here
        yield path


def _part(path: str) -> str:
    """The component of a path of _differ ("optimizer", "rng", "model", ...)."""
    return re.findall(r"\['([^']*)'\]", path)[0]


def _bytes(value: torch.Tensor) -> torch.Tensor:
    return value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------------
# Corruptions: each changes the copy in one way and says how.


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _header_end(path: Path) -> int:
    """Where a safetensors file's JSON header ends (8 bytes of length, then the header)."""
    data = path.read_bytes()
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


def untouched(folder: Path, rng: random.Random) -> str:
    return "untouched (the control: must load exactly)"


def flip(folder: Path, rng: random.Random) -> str:
    path = rng.choice(_files(folder))
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip: {path.name} is empty"
    # Half the flips hit a header: a safetensors file's length and JSON, a JSON file's start.
    head = _header_end(path) if path.suffix == ".safetensors" else 200
    end = min(len(data), head) if rng.random() < 0.5 else len(data)
    offset = rng.randrange(end)
    bits = rng.randrange(1, 256)
    data[offset] ^= bits
    path.write_bytes(bytes(data))
    return f"flip: {path.name} byte {offset} ^= {bits:#04x}"


def truncate(folder: Path, rng: random.Random) -> str:
    path = rng.choice(_files(folder))
    size = path.stat().st_size
    keep = rng.randrange(size) if size else 0
    os.truncate(path, keep)
    return f"truncate: {path.name} {size} -> {keep} bytes"


def append(folder: Path, rng: random.Random) -> str:
    path = rng.choice(_files(folder))
    extra = rng.choice([b"\n", b" ", b"{}", b"\0" * 8, rng.randbytes(rng.randrange(1, 64))])
    with open(path, "ab") as file:
        file.write(extra)
    return f"append: {len(extra)} bytes to {path.name}"


def swap(folder: Path, rng: random.Random) -> str:
    first, second = rng.sample(_files(folder), 2)
    temp = folder / ".swap"
    os.rename(first, temp)
    os.rename(second, first)
    os.rename(temp, second)
    return f"swap: {first.name} <-> {second.name}"


def delete(folder: Path, rng: random.Random) -> str:
    path = rng.choice(_files(folder))
    path.unlink()
    return f"delete: {path.name}"


def empty(folder: Path, rng: random.Random) -> str:
    path = rng.choice(_files(folder))
    path.write_bytes(b"")
    return f"empty: {path.name}"


# JSON values put in place of a value of a JSON file; strings in <> are written as raw
# text that json.dumps cannot produce (NaN, an overflowing number, deep nesting).
VALUES: list[Any] = [
    -1, 0, 1, 7, 2**70, -0.5, 1e308, "<1e400>", "<-1e400>", "<NaN>", "<Infinity>", "<deep>",
    "", "x", None, True, False, [], {}, [1, 2], {"a": 1},
    {"$float": "nan"}, {"$float": "inf"}, {"$float": "bogus"}, {"$tensor": "nope"},
    {"$tuple": [1]}, {"$items": [[1, 2]]}, {"$items": 5}, {"$dict": 3}, {"$what": 1},
]  # fmt: skip
RAW = {
    '"<1e400>"': "1e400",
    '"<-1e400>"': "-1e400",
    '"<NaN>"': "NaN",
    '"<Infinity>"': "Infinity",
    '"<deep>"': "[" * 20000 + "]" * 20000,
}


def _children(node: Any) -> list[Any]:
    return list(node) if isinstance(node, dict) else list(range(len(node)))


def _slot(document: Any, rng: random.Random) -> tuple[Any, ...]:
    """A path into ``document`` drawn by walking down from the root: structure is hit as
    often as leaves (a uniform pick would mostly hit the 624 numbers of an RNG state)."""
    path: tuple[Any, ...] = ()
    node = document
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(_children(node))
        path, node = (*path, key), node[key]
    return path


def replace_value(folder: Path, rng: random.Random) -> str:
    candidates = [p for p in _files(folder) if p.suffix == ".json"]
    path = rng.choice(candidates)
    document = json.loads(path.read_bytes())
    where = _slot(document, rng)
    if not where:
        return f"replace: {path.name} has no values"
    parent = document
    for key in where[:-1]:
        parent = parent[key]
    value = rng.choice(VALUES)
    if rng.random() < 0.15 and isinstance(parent, dict):
        del parent[where[-1]]
        what = "deleted"
    else:
        parent[where[-1]] = value
        what = f"= {value!r}"
    text = json.dumps(document)
    for sentinel, raw in RAW.items():
        text = text.replace(sentinel, raw)
    path.write_text(text)
    shown = "".join(f"[{k!r}]" for k in where)
    return f"replace: {path.name}{shown[:120]} {what}"


def _edit_json(path: Path, change: Callable[[Any], None]) -> None:
    document = json.loads(path.read_bytes())
    change(document)
    path.write_text(json.dumps(document))


def _edit_tensor(path: Path, rng: random.Random, new: Callable[[torch.Tensor], Any]) -> str:
    tensors = load_file(path)
    name = rng.choice(sorted(tensors))
    tensors[name] = new(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    return name


def optimizer_state(folder: Path, rng: random.Random) -> str:
    """State of another shape or dtype than its parameter, a reference to bytes of another
    dtype and shape, or a parameter the model lacks."""
    how = rng.choice(["shape [3]", "int32", "float64", "complex128 [99999]", "a ghost"])
    path, document = folder / "optimizer.json", json.loads((folder / "optimizer.json").read_text())
    param = rng.choice(sorted(document["state"]))
    if how == "a ghost":
        group = next(g for g in document["param_groups"] if param in g["params"])
        group["params"][group["params"].index(param)] = "ghost"
        document["state"]["ghost"] = document["state"].pop(param)
    elif how.startswith("complex"):
        document["state"][param]["exp_avg"].update(dtype="complex128", shape=[99999])
    else:
        new = lambda t: torch.zeros(3) if how.startswith("shape") else t.to(getattr(torch, how))  # noqa: E731
        tensors = load_file(folder / "optimizer.safetensors")
        tensors[f"optimizer/state/{param}/exp_avg"] = new(
            tensors[f"optimizer/state/{param}/exp_avg"]
        )
        save_file(tensors, folder / "optimizer.safetensors")
    path.write_text(json.dumps(document))
    return f"optimizer state: {param} {how}"


def step_claim(folder: Path, rng: random.Random) -> str:
    """A step that state.json (or the manifest) and the folder's name contradict."""
    file, step = rng.choice([("manifest.json", 10**30), ("manifest.json", 4), ("state.json", 2)])
    _edit_json(folder / file, lambda document: document.update(step=step))
    return f"step: {file} says {step}"


def model_dtype(folder: Path, rng: random.Random) -> str:
    """A model tensor re-typed (float64, int8, bool) or made all NaN or inf."""
    how = rng.choice(["float64", "int8", "bool", "nan", "inf"])
    kind = {"float64": torch.float64, "int8": torch.int8, "bool": torch.bool}.get(how)
    new = (lambda t: t.to(kind)) if kind else (lambda t: torch.full(t.shape, float(how)))
    name = _edit_tensor(folder / "model.safetensors", rng, new)
    return f"model tensor: {name} {how}"


def ema_state(folder: Path, rng: random.Random) -> str:
    """An EMA tensor of another shape, or named after a tensor the model lacks."""
    if rng.random() < 0.5:
        name = _edit_tensor(folder / "extras.safetensors", rng, lambda t: torch.zeros(7))
        return f"ema: {name} of shape [7]"
    _edit_json(
        folder / "extras.json",
        lambda d: d["ema"]["params"].update(ghost=d["ema"]["params"].popitem()[1]),
    )
    return "ema: a tensor named ghost"


KINDS: list[Callable[[Path, random.Random], str]] = [
    untouched,
    flip,
    flip,
    truncate,
    append,
    swap,
    delete,
    empty,
    replace_value,
    replace_value,
    replace_value,
    optimizer_state,
    optimizer_state,
    step_claim,
    model_dtype,
    ema_state,
]
SIGNED = (optimizer_state, step_claim, model_dtype, ema_state)  # always re-signed


def resign(folder: Path) -> bool:
    """Make the manifest agree with the files again (sizes, checksums, its own checksum).

    A listed file that is gone is dropped from the list. False when the manifest is not a
    JSON object with a file list (nothing to re-sign).
    """
    try:
        document = json.loads((folder / MANIFEST).read_bytes())
        files = document["files"]
        assert isinstance(files, dict)
    except Exception:
        return False
    for name in list(files):
        path = folder / name
        if not (isinstance(files[name], dict) and path.is_file()):
            del files[name]
            continue
        data = path.read_bytes()
        files[name].update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    body = {k: v for k, v in document.items() if k != "manifest_xxh3_128"}
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN in it: the manifest's checksum cannot be made
        return False
    document["manifest_xxh3_128"] = xxhash.xxh3_128_hexdigest(canonical.encode())
    (folder / MANIFEST).write_text(json.dumps(document))
    return True


# ----------------------------------------------------------------------------------------
# One case.


class Hang(BaseException):
    """A case past its deadline (a BaseException: load's ``except Exception`` lets it by)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang


def _hyperparameters(state: TrainState, when: str) -> list[str]:
    """The optimizer's non-finite hyperparameters (a NaN learning rate must not load)."""
    return [
        f"optimizer group {key}={value!r} {when}"
        for group in state.optimizer.param_groups
        for key, value in group.items()
        if key != "params"
        for number in (value if isinstance(value, (tuple, list)) else (value,))
        if isinstance(number, float) and not math.isfinite(number)
    ]


def _usable(state: TrainState) -> list[str]:
    """Why a loaded state cannot be resumed by run() for one more update, if it cannot."""
    problems = _hyperparameters(state, "loaded")
    for name in ("step", "epoch", "batches_seen"):
        value = getattr(state, name)
        if type(value) is not int or value < 0:
            problems.append(f"state.{name}={value!r} loaded")
    if problems:
        return problems
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plugins = [ema(0.9, buffers=True)]  # checks the saved average against the model
            after = run(make_step(_loss), state, _data(), max_steps=state.step + 1, plugins=plugins)
    except Hang:
        return [f"resuming a run: no result after {DEADLINE_S} s"]
    except Exception as error:
        return [f"resuming a run raised {type(error).__name__}: {str(error)[:300]}"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return _hyperparameters(after, "after one more update")


def _case(
    folder: Path, expected: dict[str, Any], resigned: bool, number: int
) -> tuple[str, list[str]]:
    """``(outcome, problems)`` of loading ``folder`` into a fresh template."""
    template, meter = _build(seed=100 + number, updates=1)
    torch.manual_seed(number), random.seed(number), numpy.random.seed(number)
    before = _snapshot(template, meter)
    problems: list[str] = []
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loaded = load_checkpoint(folder, like=template, objects={"meter": meter})
                error: BaseException | None = None
            except Exception as raised:
                loaded, error = None, raised
            try:  # damage is returned, never raised
                reported = verify_checkpoint(folder)
            except Exception as raised:
                problems.append(f"verify_checkpoint raised {type(raised).__name__}: {raised}")
                reported = [f"raised {type(raised).__name__}"]
            with contextlib.redirect_stdout(io.StringIO()) as shown:
                status = main([str(folder), "--verify"])  # the shell tool agrees with it
            if status != (1 if reported else 0) or not all(p in shown.getvalue() for p in reported):
                problems.append(f"--verify exited {status}: {shown.getvalue()[-300:]!r}")
    except Hang:
        return "hang", [f"no result after {DEADLINE_S} s"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    problems += [f"warning {w.category.__name__}: {str(w.message)[:150]}" for w in caught]
    if error is not None:
        named = isinstance(error, ValueError) and str(folder) in str(error)
        clear = isinstance(error, DamagedCheckpointError) or named
        if not clear:
            problems.append(f"raised {type(error).__name__}: {str(error)[:300]}")
        changed = sorted({_part(p) for p in _differ(before, _snapshot(template, meter))})
        if changed:
            problems.append(f"template changed by the refused load: {', '.join(changed)}")
        if isinstance(error, DamagedCheckpointError) and not reported:
            problems.append("verify_checkpoint found nothing, load said damaged")
        return f"refused:{type(error).__name__}", problems
    if reported:
        problems.append(f"verify_checkpoint reported {reported[0][:200]}, but it loaded")
    assert loaded is not None
    changed = list(_differ(expected, _snapshot(loaded, meter)))
    if changed and not resigned:
        problems.append(f"loaded other values: {', '.join(changed[:6])}")
    problems += _usable(loaded)
    return ("loaded:exact" if not changed else "loaded:changed"), problems


@pytest.mark.slow
def test_corrupted_checkpoints_are_refused_cleanly_or_load_exactly(tmp_path: Path) -> None:
    state, meter = _build(seed=0, updates=3)  # mid-pass: the data position matters
    assert state.optimizer.state and state.extras["ema"]["params"] and state.batches_seen == 3
    original = tmp_path / "original" / "step_000003"  # as the checkpoints plugin names it
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    expected = _snapshot(state, meter)
    save_checkpoint(state, original, objects={"meter": meter}, metrics={"loss": 0.5})
    assert verify_checkpoint(original) == []
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for number in range(CASES):
            folder = tmp_path / f"case_{number:03d}" / original.name
            shutil.copytree(original, folder)
            corruption = KINDS[number % len(KINDS)]
            how = corruption(folder, rng)
            resigned = (corruption in SIGNED or rng.random() < 0.5) and resign(folder)
            how += " (re-signed)" if resigned else ""
            outcome, problems = _case(folder, expected, resigned, number)
            if corruption in SIGNED and outcome.startswith("loaded"):
                problems.append("loaded, although it disagrees with itself")
            outcomes[f"{corruption.__name__}{'+resign' if resigned else ''} -> {outcome}"] += 1
            failures += [f"case {number}: {how}: {p}" for p in problems]
            shutil.rmtree(folder.parent)
    finally:
        signal.signal(signal.SIGALRM, previous)
    summary = "\n".join(f"{count:4d}  {kind}" for kind, count in sorted(outcomes.items()))
    print(f"\n{CASES} cases:\n{summary}")
    assert not failures, f"{len(failures)} problem(s):\n" + "\n".join(failures) + "\n" + summary


def _sparse(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(1 << 30)


POINTERS: dict[str, Callable[[Path, Path], None]] = {
    "latest is a FIFO": lambda root, outside: os.mkfifo(root / "latest"),
    "latest is a sparse gigabyte": lambda root, outside: _sparse(root / "latest"),
    "latest names a folder outside": lambda root, outside: (root / "latest").write_text(
        f"../{outside.parent.name}/{outside.name}\n"
    ),
    "latest links outside": lambda root, outside: (root / "latest").symlink_to(outside),
    "a newer step_* links outside": lambda root, outside: (root / "step_000099").symlink_to(
        outside
    ),
}


@pytest.mark.parametrize("kind", list(POINTERS))
def test_hostile_pointers_and_links_are_said_skipped_and_the_checkpoint_loads_exactly(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the listing and --verify said nothing of them (a newer linked step_* was
    # dropped silently); load_latest skipped them, as it still must.
    state, meter = _build(seed=0, updates=3)
    root, outside = tmp_path / "ckpt", tmp_path / "elsewhere" / "step_000099"
    torch.manual_seed(5), random.seed(5), numpy.random.seed(5)
    expected = _snapshot(state, meter)
    save_checkpoint(state, root / "step_000003", objects={"meter": meter})
    save_checkpoint(state.replace(step=99), outside, objects={"meter": meter})
    POINTERS[kind](root, outside)
    name = "step_000099" if kind.startswith("a newer") else "latest"
    for verify in ([], ["--verify"]):
        assert main([str(root), *verify]) == 0
        assert f"{root / name}: ignored" in capsys.readouterr().out
    template, other = _build(seed=1, updates=1)
    loaded = load_latest(root, like=template, objects={"meter": other})
    assert loaded is not None and loaded[1] == root / "step_000003"
    assert list(_differ(expected, _snapshot(loaded[0], other))) == []
