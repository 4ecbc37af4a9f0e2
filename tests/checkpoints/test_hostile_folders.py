"""Hostile or damaged checkpoint folders: refused, never a hang.

Each test does the bad thing: a FIFO or a link to /dev/zero in place of a file, a 1 GiB
sparse manifest, 100,000 nested brackets, NaN in a manifest, links leading out of the
folder, and content no save writes (re-signed, so that the checksums hold and the checks
behind them are what refuses it), and a checkpoint that disagrees with itself (optimizer
state and its parameters, steps, an EMA and the model, re-typed or non-finite weights). A
refused load leaves the template bitwise unchanged.
Calls that could hang run in a thread or a subprocess with a deadline.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn
from torch.optim import lr_scheduler as lrs

from toolkit import TrainState, export_model, load_checkpoint, save_checkpoint
from toolkit.checkpoints import (
    DamagedCheckpointError,
    Retention,
    list_checkpoints,
    load_latest,
    main,
    prune_checkpoints,
    read_pointer,
    verify_checkpoint,
    write_pointer,
)

DEADLINE_S = 30


def _within(call: Callable[[], Any], seconds: float = DEADLINE_S) -> Any:
    """``call()``'s result or error; a failure when it has not returned after ``seconds``."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)  # a hung one dies with pytest
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no result after {seconds} s: a hang"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _build(seed: int, updates: int = 3) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = lrs.StepLR(optimizer, step_size=2)
    for _ in range(updates):
        model(torch.randn(4, 3)).square().mean().backward()
        optimizer.step(), optimizer.zero_grad(), scheduler.step()
    extras = {"ema": {"weight": model.weight.detach() * 0.5, "count": updates}}
    return TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, step=updates, extras=extras
    )


def _snapshot(state: TrainState) -> dict[str, Any]:
    """Everything a load may touch, copied: handles' state dicts and the global RNG states."""
    return copy.deepcopy(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "rng": (random.getstate(), numpy.random.get_state(), torch.get_rng_state()),
        }
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        bits = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(*bits)
    if isinstance(a, numpy.ndarray):
        return numpy.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _resign(folder: Path) -> None:
    """Make the manifest agree with the files again, as a buggy or hostile writer would."""
    document = json.loads((folder / "manifest.json").read_bytes())
    for name, entry in document["files"].items():
        data = (folder / name).read_bytes()
        entry.update(size=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    body = {k: v for k, v in document.items() if k != "manifest_xxh3_128"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    document["manifest_xxh3_128"] = xxhash.xxh3_128_hexdigest(canonical)
    (folder / "manifest.json").write_text(json.dumps(document))


def _two_checkpoints(root: Path) -> tuple[Path, Path]:
    older = save_checkpoint(_build(0, updates=2), root / "step_000002")
    newer = save_checkpoint(_build(0, updates=3), root / "step_000003")
    write_pointer(root, newer)
    return older, newer


# ----------------------------------------------------------------------------------------
# 1. Reads that cannot hang or blow up.


def test_a_fifo_in_place_of_the_manifest_is_damage_not_a_hang(tmp_path: Path) -> None:
    # Before: read_bytes() on the FIFO blocked forever (every call below hung).
    older, newer = _two_checkpoints(tmp_path)
    (newer / "manifest.json").unlink()
    os.mkfifo(newer / "manifest.json")
    with pytest.raises(DamagedCheckpointError, match="manifest.json: unreadable"):
        _within(lambda: load_checkpoint(newer, like=_build(1)))
    with pytest.warns(UserWarning, match="step_000003 is damaged and skipped"):
        loaded, path = _within(lambda: load_latest(tmp_path, like=_build(1)))
    assert path == older and loaded.step == 2
    assert _within(lambda: main([str(tmp_path), "--verify"])) == 1
    assert _within(lambda: prune_checkpoints(tmp_path, Retention(keep_last=1))) == []


def test_a_fifo_as_the_latest_pointer_reads_as_no_pointer(tmp_path: Path) -> None:
    # Before: read_pointer blocked on the FIFO forever.
    _two_checkpoints(tmp_path)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    assert _within(lambda: read_pointer(tmp_path)) is None


_UNBOUNDED = """
import os, sys
from pathlib import Path
import torch
from toolkit import TrainState, load_checkpoint, save_checkpoint
from toolkit.checkpoints import read_pointer, verify_checkpoint, write_pointer

root = Path(sys.argv[1])
state = TrainState(model=torch.nn.Linear(1, 1))
for kind in ("zero_link", "sparse", "listed_zero_link"):
    path = save_checkpoint(state, root / kind)
    target = path / ("model.safetensors" if kind.startswith("listed") else "manifest.json")
    target.unlink()
    if kind == "sparse":
        with open(target, "wb") as file:
            file.truncate(1 << 30)
    else:
        target.symlink_to("/dev/zero")
    try:
        load_checkpoint(path, like=state)
        print(kind, "loaded")
    except Exception as error:
        print(kind, type(error).__name__, target.name in str(error), bool(verify_checkpoint(path)))
write_pointer(root, root / "sparse")
(root / "latest").unlink()
(root / "latest").symlink_to("/dev/zero")
print("pointer", read_pointer(root))
"""


def _limited() -> None:  # a read without bound ends in MemoryError, not the machine's memory
    resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))


@pytest.mark.slow  # a gigabyte sparse file and a memory limit: about 4 s
def test_links_to_dev_zero_and_a_sparse_gigabyte_are_refused_without_reading_them(
    tmp_path: Path,
) -> None:
    # Before: the /dev/zero manifest and pointer grew memory until MemoryError (the
    # subprocess's limit), the 1 GiB sparse manifest was read whole.
    result = subprocess.run(
        [sys.executable, "-c", _UNBOUNDED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [
        "zero_link DamagedCheckpointError True True",
        "sparse DamagedCheckpointError True True",
        "listed_zero_link DamagedCheckpointError True True",
        "pointer None",
    ]


# ----------------------------------------------------------------------------------------
# 2. Bounded parsing: every parse error is damage naming the file.


@pytest.mark.parametrize(
    "edit",
    [
        lambda text: "[" * 100_000 + "]" * 100_000,
        lambda text: text.replace('"time": ', '"time": NaN, "was": ', 1),
        lambda text: text.replace('"time": ', '"time": Infinity, "was": ', 1),
        lambda text: text.replace('"time": ', '"time": 1e400, "was": ', 1),
    ],
    ids=["100k nested brackets", "NaN", "Infinity", "1e400"],
)
def test_a_manifest_that_cannot_be_parsed_is_damage_naming_it(
    edit: Callable[[str], str], tmp_path: Path
) -> None:
    # Before: RecursionError (brackets) or a ValueError without the path (NaN, 1e400).
    older, newer = _two_checkpoints(tmp_path)
    manifest = newer / "manifest.json"
    manifest.write_text(edit(manifest.read_text()))
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(newer, like=_build(1))
    assert f"{manifest}: unreadable" in str(error.value)
    with pytest.warns(UserWarning, match="damaged and skipped"):
        assert load_latest(tmp_path, like=_build(1))[1] == older
    assert verify_checkpoint(newer) and main([str(newer), "--verify"]) == 1


def test_deep_nesting_in_a_component_is_damage_naming_it(tmp_path: Path) -> None:
    # Before: RecursionError from the load, and --verify said OK.
    path = save_checkpoint(_build(0), tmp_path / "c")
    (path / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    _resign(path)
    template = _build(1)
    before = _snapshot(template)
    with pytest.raises(DamagedCheckpointError, match="state.json: not JSON"):
        load_checkpoint(path, like=template)
    assert _same(before, _snapshot(template))
    assert any("state.json" in line for line in verify_checkpoint(path))


# ----------------------------------------------------------------------------------------
# 3. Nothing outside the folder.


def test_a_sharded_folder_linked_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    # Before: the files were checked through the link and --verify said OK.
    path = save_checkpoint(_build(0), tmp_path / "c")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"x": torch.zeros(2)}, outside / "shard-00001-model-00001-of-00001.safetensors")
    (path / "sharded").symlink_to(outside)
    document = json.loads((path / "manifest.json").read_text())
    document["files"]["sharded/shard-00001-model-00001-of-00001.safetensors"] = {}
    (path / "manifest.json").write_text(json.dumps(document))
    _resign(path)
    with pytest.raises(DamagedCheckpointError, match="leads outside the checkpoint folder"):
        load_checkpoint(path, like=_build(1))
    assert main([str(path), "--verify"]) == 1


def test_a_listed_file_linked_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(_build(0), tmp_path / "c")
    outside = tmp_path / "model.safetensors"
    (path / "model.safetensors").rename(outside)
    (path / "model.safetensors").symlink_to(outside)
    with pytest.raises(DamagedCheckpointError, match="model.safetensors: leads outside"):
        load_checkpoint(path, like=_build(1))
    assert main([str(path), "--verify"]) == 1


# ----------------------------------------------------------------------------------------
# 4. A refused load changes nothing: each kind of content no save writes, re-signed.


def _json_edit(name: str, change: Callable[[Any], None]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        document = json.loads((path / name).read_text())
        change(document)
        (path / name).write_text(json.dumps(document))

    return edit


def _tensor_edit(name: str, key: str, value: torch.Tensor) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = load_file(path / name)
        assert key in tensors, sorted(tensors)
        save_file({**tensors, key: value}, path / name)

    return edit


def _raw_edit(name: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        text = (path / name).read_text()
        assert old in text
        (path / name).write_text(text.replace(old, new, 1))

    return edit


def _set(keys: tuple[Any, ...], value: Any) -> Callable[[Any], None]:
    def change(document: Any) -> None:
        for key in keys[:-1]:
            document = document[key]
        document[keys[-1]] = value

    return change


CORRUPTIONS = {
    "step -1": _json_edit("state.json", _set(("step",), -1)),
    "step 1e400": _raw_edit("state.json", '"step": 3', '"step": 1e400'),
    "step a bool": _json_edit("state.json", _set(("step",), True)),
    "epoch a float": _json_edit("state.json", _set(("epoch",), 2.5)),
    "an open window": _json_edit("state.json", _set(("window", "micro_step"), 2)),
    "a negative guard counter": _json_edit("state.json", _set(("guard", "total_overflow"), -4)),
    "python RNG state malformed": _json_edit("rng.json", _set(("python", "$tuple", 1), [1, 2])),
    "numpy RNG position out of range": _json_edit("rng.json", _set(("numpy", "pos"), 10**6)),
    "a 10-byte torch RNG state": _tensor_edit(
        "rng.safetensors", "rng/torch", torch.zeros(10, dtype=torch.uint8)
    ),
    "optimizer state of another shape": _tensor_edit(
        "optimizer.safetensors", "optimizer/state/weight/exp_avg", torch.zeros(3, 2)
    ),
    "optimizer state of another dtype": _tensor_edit(
        "optimizer.safetensors", "optimizer/state/weight/exp_avg", torch.zeros(2, 3).double()
    ),
    "a NaN learning rate": _json_edit(
        "optimizer.json", _set(("param_groups", 0, "lr"), {"$float": "nan"})
    ),
    "beta1 = 1 (AdamW divides by 1 - beta1**step)": _json_edit(
        "optimizer.json", _set(("param_groups", 0, "betas", "$tuple", 0), 1)
    ),
    "optimizer state lacking exp_avg_sq": _json_edit(
        "optimizer.json", lambda d: d["state"]["weight"].pop("exp_avg_sq")
    ),
    "param_groups not a list": _json_edit("optimizer.json", _set(("param_groups",), 7)),
    "step_size 0": _json_edit("scheduler.json", _set(("step_size",), 0)),
    "gamma a string": _json_edit("scheduler.json", _set(("gamma",), "x")),
    "EMA of another shape": _tensor_edit(
        "extras.safetensors", "extras/ema/weight", torch.zeros(3, 3)
    ),
    # An extras entry holding tensors (an EMA's) is compared whole; other entries are not.
    "EMA count a list": _json_edit("extras.json", _set(("ema", "count"), [])),
    "EMA count missing": _json_edit("extras.json", lambda d: d["ema"].pop("count")),
    "aliases naming no tensor": _json_edit("manifest.json", _set(("aliases",), {"w": "nope"})),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_content_no_save_writes_is_refused_and_the_template_is_unchanged(
    kind: str, tmp_path: Path
) -> None:
    # Before: counters and RNG states were checked after the model, optimizer and
    # scheduler were restored (template changed), and NaN lr, step_size 0, a missing
    # exp_avg_sq, wrong optimizer/EMA shapes loaded (or failed half-way).
    path = save_checkpoint(_build(0), tmp_path / "c")
    CORRUPTIONS[kind](path)
    _resign(path)
    template = _build(1)
    random.seed(5), numpy.random.seed(5), torch.manual_seed(5)
    before = _snapshot(template)
    with pytest.raises((DamagedCheckpointError, ValueError)) as error:
        load_checkpoint(path, like=template)
    assert str(path) in str(error.value)
    assert _same(before, _snapshot(template)), "the refused load changed the template"
    if isinstance(error.value, DamagedCheckpointError):  # found without a template too
        assert verify_checkpoint(path), "verify_checkpoint found nothing, the load did"


FORGED_REFERENCES = [
    {"dtype": "complex128", "shape": [99999]},  # another dtype and shape than the bytes
    {"dtype": "float32", "shape": [5]},  # 6 floats stored
    {"dtype": "Tensor", "shape": [6]},  # not a dtype
    {"device": "warp:3"},  # not a device
    {"$tensor": ["a", "list"]},  # not a name
]


@pytest.mark.parametrize("forged", FORGED_REFERENCES, ids=str)
def test_a_tensor_reference_no_save_writes_is_damage_named_by_file_and_path(
    forged: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a bare RuntimeError from _codec.py (shape '[99999]' is invalid ...), no
    # path, no fallback; --verify died with a traceback.
    older, newer = _two_checkpoints(tmp_path)
    _json_edit("optimizer.json", lambda d: d["state"]["weight"]["exp_avg"].update(forged))(newer)
    _resign(newer)
    template = _build(1)
    before = _snapshot(template)
    where = f"{newer / 'optimizer.json'}: .*optimizer\\['state'\\]\\['weight'\\]\\['exp_avg'\\]"
    with pytest.raises(DamagedCheckpointError, match=where):
        load_checkpoint(newer, like=template)
    assert _same(before, _snapshot(template)), "the refused load changed the template"
    with pytest.warns(UserWarning, match="step_000003 is damaged and skipped"):
        loaded, path = load_latest(tmp_path, like=template)
    assert path == older and loaded.step == 2
    capsys.readouterr()
    assert main([str(tmp_path), "--verify"]) == 1
    assert re.search(where, capsys.readouterr().out)


def test_an_intact_checkpoint_still_loads_exactly(tmp_path: Path) -> None:
    state = _build(0)
    path = save_checkpoint(state, tmp_path / "c")
    expected = _snapshot(state)
    loaded = load_checkpoint(path, like=_build(1))
    assert loaded.step == 3 and _same(expected, _snapshot(loaded))
    assert verify_checkpoint(path) == []


def _plateau_run(extras: dict[str, Any]) -> TrainState:
    """A ReduceLROnPlateau and a GradScaler that count (bad epochs, good steps) as it trains."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lrs.ReduceLROnPlateau(optimizer, patience=5)
    scaler = torch.amp.GradScaler("cpu")
    return TrainState(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extras=extras
    )


def _train_plateau(state: TrainState, updates: int) -> TrainState:
    for _ in range(updates):
        loss = state.model(torch.ones(2, 2)).square().mean()
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer), state.scaler.update(), state.optimizer.zero_grad()
        state.scheduler.step(1.0)  # a plateau: num_bad_epochs grows
    return state.replace(step=state.step + updates)


def test_an_earlier_checkpoint_loads_into_the_live_state_that_went_on_training(
    tmp_path: Path,
) -> None:
    # Before: refused, its counters compared with the template's as if they were settings
    # (num_bad_epochs 0 vs 2, _growth_tracker 0 vs 3) and the user's extras by value
    # (a list of 2 items vs 0, an int 0 where the template's is 3, None for a float).
    saved_extras = {"history": [0.5, 0.4], "user": {"patience_left": 0, "best": None}}
    path = save_checkpoint(_plateau_run(saved_extras), tmp_path / "step_000000")
    live = {"history": [], "user": {"patience_left": 3, "best": 0.3}}
    state = _train_plateau(_plateau_run(live), 3)
    assert state.scheduler.num_bad_epochs == 2 and state.scaler.state_dict()["_growth_tracker"]
    loaded = load_checkpoint(path, like=state)
    assert loaded.step == 0 and loaded.extras == saved_extras
    assert loaded.scheduler.num_bad_epochs == 0
    assert loaded.scaler.state_dict()["_growth_tracker"] == 0


def test_a_muon_checkpoint_loads(tmp_path: Path) -> None:
    # Before: refused: the hyperparameters were checked on a new Muon over a 1-D tensor
    # ("Muon only supports 2D parameters").
    def build() -> TrainState:
        torch.manual_seed(0)
        model = nn.Linear(3, 2, bias=False)
        return TrainState(model=model, optimizer=torch.optim.Muon(model.parameters(), lr=0.02))

    state = build()
    state.model(torch.ones(4, 3)).sum().backward()
    state.optimizer.step()
    path = save_checkpoint(state.replace(step=1), tmp_path / "c")
    loaded = load_checkpoint(path, like=build())
    assert _same(loaded.optimizer.state_dict(), state.optimizer.state_dict())
    assert torch.equal(loaded.model.weight, state.model.weight)


# ----------------------------------------------------------------------------------------
# 5. --verify checks what a load checks.


def test_verify_reads_every_safetensors_header_and_tree(tmp_path: Path) -> None:
    # Before: re-signed, a garbled header or a step -1 passed --verify (exit 0).
    path = save_checkpoint(_build(0), tmp_path / "c")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:12] = b"@@@@"  # the header's first bytes: not JSON any more
    (path / "model.safetensors").write_bytes(bytes(data))
    _resign(path)
    assert main([str(path), "--verify"]) == 1
    assert "model.safetensors: not a safetensors file" in verify_checkpoint(path)[0]
    other = save_checkpoint(_build(0), tmp_path / "d")
    CORRUPTIONS["step -1"](other)
    _resign(other)
    assert "state.json" in verify_checkpoint(other)[0]
    assert main([str(other), "--verify"]) == 1


# ----------------------------------------------------------------------------------------
# 11. Model-only retention (keep_full).


def test_keep_full_reduces_older_kept_checkpoints_to_the_model(tmp_path: Path) -> None:
    # Before: Retention had no keep_full (TypeError).
    for updates in (1, 2, 3, 4):
        save_checkpoint(_build(0, updates), tmp_path / f"step_{updates:06d}")
    assert prune_checkpoints(tmp_path, Retention(keep_last=3, keep_full=2)) == [
        tmp_path / "step_000001"
    ]
    infos = list_checkpoints(tmp_path, checksums=True)
    assert [(c.name, c.model_only, c.intact) for c in infos] == [
        ("step_000002", True, True),
        ("step_000003", False, True),
        ("step_000004", False, True),
    ]
    reduced = tmp_path / "step_000002"
    assert sorted(p.name for p in reduced.iterdir()) == [
        "extras.json", "extras.safetensors", "manifest.json", "model.safetensors", "state.json"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="is model-only"):
        load_checkpoint(reduced, like=_build(1))
    weights = load_checkpoint(reduced, like=TrainState(model=nn.Linear(3, 2)))
    assert torch.equal(weights.model.weight, _build(0, 2).model.weight)
    assert weights.extras["ema"]["count"] == 2
    assert load_file(export_model(reduced, tmp_path / "w.safetensors")).keys() == {
        "weight", "bias"
    }  # fmt: skip
    for newer in ("step_000003", "step_000004"):  # resume never picks a model-only one
        (tmp_path / newer / "manifest.json").write_text("{}")
    with (
        pytest.warns(UserWarning, match="damaged and skipped"),
        pytest.raises(DamagedCheckpointError),
    ):
        load_latest(tmp_path, like=_build(1))


def test_the_listing_says_which_checkpoints_are_model_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for updates in (1, 2):
        save_checkpoint(_build(0, updates), tmp_path / f"step_{updates:06d}")
    prune_checkpoints(tmp_path, Retention(keep_last=2, keep_full=1))
    assert main([str(tmp_path), "--verify"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[-2:] for row in rows if "step_00000" in row] == [
        ["ok,", "model-only"],
        ["newest", "ok"],
    ]


def test_a_folder_of_model_only_checkpoints_is_no_resume_and_says_why(tmp_path: Path) -> None:
    # Before: DamagedCheckpointError with 0 problems (an intact model-only checkpoint
    # reported as the damaged one).
    for updates in (1, 2, 3):
        save_checkpoint(_build(0, updates), tmp_path / f"step_{updates:06d}")
    prune_checkpoints(tmp_path, Retention(keep_last=3, keep_full=1))
    data = bytearray((tmp_path / "step_000003" / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the only full checkpoint: a flipped bit only its checksum shows
    (tmp_path / "step_000003" / "model.safetensors").write_bytes(bytes(data))
    with pytest.warns(UserWarning), pytest.raises(DamagedCheckpointError) as error:
        load_latest(tmp_path, like=_build(1))
    assert error.value.path.name == "step_000003" and "checksum" in error.value.problems[0]
    shutil.rmtree(tmp_path / "step_000003")
    with pytest.raises(ValueError, match=r"a folder of full checkpoints; .* are model-only"):
        load_latest(tmp_path, like=_build(1))


# ----------------------------------------------------------------------------------------
# 6. What a checkpoint says about itself is checked against itself, with or without a
# template: each edit below is re-signed, refused as damage naming the file and the tensor
# (the template bitwise unchanged), skipped by load_latest, reported by --verify.


def _self_build(seed: int, updates: int = 2) -> TrainState:
    """``_build`` with an EMA as the ema plugin keeps it (params and buffers by name)."""
    state = _build(seed, updates)
    params = {n: p.detach() * 0.5 for n, p in state.model.named_parameters()}
    ema = {"step": updates, "num_updates": updates, "params": params, "buffers": {}}
    return state.replace(step=updates, extras={"ema": ema})


def _tensors(file: str, name: str, new: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def edit(folder: Path) -> None:
        tensors = load_file(folder / file)
        tensors[name] = new(tensors[name])
        save_file(tensors, folder / file)

    return edit


def _json(file: str, change: Callable[[dict[str, Any]], None]) -> Callable:
    def edit(folder: Path) -> None:
        document = json.loads((folder / file).read_text())
        change(document)
        (folder / file).write_text(json.dumps(document))

    return edit


def _ghost_parameter(optimizer: dict[str, Any]) -> None:
    optimizer["state"]["ghost"] = optimizer["state"].pop("bias")
    optimizer["param_groups"][0]["params"][1] = "ghost"


def _ghost_average(extras: dict[str, Any]) -> None:
    extras["ema"]["params"]["ghost"] = extras["ema"]["params"].pop("bias")


EXP_AVG = "optimizer/state/weight/exp_avg"
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "exp_avg of another shape": (
        _tensors("optimizer.safetensors", EXP_AVG, lambda t: torch.zeros(3)),
        "optimizer.json: state['weight']['exp_avg']: shape [3] torch.float32, of shape [2, 3]",
    ),
    "exp_avg stored as int32": (
        _tensors("optimizer.safetensors", EXP_AVG, lambda t: t.to(torch.int32)),
        "state['weight']['exp_avg']: shape [2, 3] torch.int32, of shape [2, 3] torch.float32",
    ),
    "state of a tensor the model lacks": (
        _json("optimizer.json", _ghost_parameter),
        "optimizer.json: parameter 'ghost', in the model absent",
    ),
    "weight re-typed as int8": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.int8)),
        "optimizer.json: parameter 'weight', in the model shape [2, 3] torch.int8",
    ),
    "weight re-typed as bool": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.bool)),
        "optimizer.json: parameter 'weight', in the model shape [2, 3] torch.bool",
    ),
    "weight re-typed as float64": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.float64)),
        "state['weight']['exp_avg_sq']: shape [2, 3] torch.float32, of shape [2, 3] torch.float64",
    ),
    "all-NaN weight": (
        _tensors("model.safetensors", "weight", lambda t: torch.full_like(t, float("nan"))),
        "model.safetensors: 'weight' holds NaN or inf",
    ),
    "manifest step of 10**30": (
        _json("manifest.json", lambda manifest: manifest.update(step=10**30)),
        "manifest.json: step 1000000000000000000000000000000, the folder's name 'step_000002'",
    ),
    "state.json of another step": (
        _json("state.json", lambda state: state.update(step=7)),
        "state.json: not what a save writes (step 7, the manifest's is 2)",
    ),
    "an EMA weight of another shape": (
        _tensors("extras.safetensors", "extras/ema/params/weight", lambda t: t.T.contiguous()),
        "extras.json: ['ema']['weight']: shape [3, 2] torch.float32, in the model shape [2, 3]",
    ),
    "an EMA of a tensor the model lacks": (
        _json("extras.json", _ghost_average),
        "extras.json: ['ema']['ghost']: shape [2] torch.float32, in the model absent",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_that_disagrees_with_itself_is_damage_for_load_verify_and_the_shell(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: each loaded into a fresh template without a word (the next update crashed, or
    # trained on a cast or NaN weight); verify and --verify found nothing.
    edit, expected = CASES[case]
    root = tmp_path / "ckpt"
    older = save_checkpoint(_self_build(1, updates=1), root / "step_000001")
    newer = save_checkpoint(_self_build(2), root / "step_000002")
    edit(newer)
    _resign(newer)
    template = _self_build(0, updates=0)  # fresh: no optimizer state to compare with
    before = _snapshot(template)
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(newer, like=template)
    (line,) = [p for p in error.value.problems if expected in p]
    assert line.startswith(str(newer)), line
    assert _same(before, _snapshot(template))
    assert line in verify_checkpoint(newer)
    assert main([str(root), "--verify"]) == 1
    assert f"    {line}\n" in capsys.readouterr().out
    with pytest.warns(UserWarning, match="step_000002 is damaged and skipped"):
        loaded, path = load_latest(root, like=template)
    assert path == older and loaded.step == 1


def test_a_model_of_another_dtype_than_the_template_is_refused_with_the_cast(
    tmp_path: Path,
) -> None:
    # Before: the float64 weights were cast into the float32 template without a word.
    torch.manual_seed(0)
    path = save_checkpoint(TrainState(model=nn.Linear(4, 3).double()), tmp_path / "c")
    template = TrainState(model=nn.Linear(4, 3))
    before = copy.deepcopy(template.model.state_dict())
    with pytest.raises(ValueError, match="does not fit the template") as error:
        load_checkpoint(path, like=template)
    assert (
        "model: 'weight': torch.float64 in the checkpoint, torch.float32 in the template; "
        "cast the model first, e.g. model.to(torch.float64)"
    ) in str(error.value)
    assert _same(before, template.model.state_dict())
    cast = TrainState(model=nn.Linear(4, 3).to(torch.float64))
    assert load_checkpoint(path, like=cast).model.weight.dtype == torch.float64


def test_non_finite_weights_load_only_when_the_caller_expects_them(tmp_path: Path) -> None:
    # Before: NaN weights loaded (and resumed) silently; there was no way to say they are
    # expected.
    state = _self_build(1)
    with torch.no_grad():
        state.model.bias[1] = float("inf")
    path = save_checkpoint(state, tmp_path / "ckpt" / "step_000002")
    line = f"{path}/model.safetensors: 'bias' holds NaN or inf"
    with pytest.raises(DamagedCheckpointError, match="'bias' holds NaN or inf"):
        load_checkpoint(path, like=_self_build(0, updates=0))
    assert verify_checkpoint(path)[0].startswith(line)
    with pytest.raises(DamagedCheckpointError), pytest.warns(UserWarning, match="skipped"):
        load_latest(tmp_path / "ckpt", like=_self_build(0, updates=0))
    loaded = load_checkpoint(path, like=_self_build(0, updates=0), allow_nonfinite=True)
    assert _same(loaded.model.state_dict(), state.model.state_dict())
    found = load_latest(tmp_path / "ckpt", like=_self_build(0, updates=0), allow_nonfinite=True)
    assert found is not None and found[1] == path


def test_export_refuses_an_ema_whose_shapes_are_not_the_models(tmp_path: Path) -> None:
    # Before: export_model wrote the wrong-shaped EMA weight (live or from the folder).
    state = _self_build(1)
    ema = state.extras["ema"]
    wrong = {**ema, "params": {**ema["params"], "weight": torch.zeros(3, 2)}}
    with pytest.raises(ValueError, match=r"shapes of the EMA's tensors must be .*\['weight'\]"):
        export_model(
            state.replace(extras={"ema": wrong}), tmp_path / "a.safetensors", weights="ema"
        )
    path = save_checkpoint(state, tmp_path / "step_000002")
    CASES["an EMA weight of another shape"][0](path)
    _resign(path)
    with pytest.raises(DamagedCheckpointError, match=r"extras.json: \['ema'\]\['weight'\]"):
        export_model(path, tmp_path / "b.safetensors", weights="ema")
    assert not (tmp_path / "a.safetensors").exists() and not (tmp_path / "b.safetensors").exists()


def test_a_save_into_a_folder_named_after_another_step_is_refused(tmp_path: Path) -> None:
    # The load refuses a step_NNNNNN folder holding another step: the save refuses first.
    with pytest.raises(ValueError, match=r"named after the state's step \(step_000002\)"):
        save_checkpoint(_self_build(1), tmp_path / "step_000005")
    assert not (tmp_path / "step_000005").exists()
    assert save_checkpoint(_self_build(1), tmp_path / "step_5").name == "step_5"  # other names
