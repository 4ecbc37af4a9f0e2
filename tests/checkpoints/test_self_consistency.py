"""What one checkpoint says about itself is checked against itself, with or without a template.

Each case edits a saved checkpoint as a buggy writer or a hostile hand would and re-signs
it (sizes and checksums agree again, so the checks behind them are what refuses it): the
optimizer's state of another shape or dtype than its parameter, or naming a tensor the
model lacks; model weights re-typed or not finite; a manifest step that the folder's name
or state.json contradicts; an EMA of other names or shapes. Each is refused as damage
naming the file and the tensor, with the template bitwise unchanged; load_latest falls
back to the checkpoint before it; verify_checkpoint and ``python -m toolkit.checkpoints
--verify`` report the same line.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from torch import nn

from toolkit import TrainState, export_model, load_checkpoint, save_checkpoint
from toolkit.checkpoints import DamagedCheckpointError, load_latest, main, verify_checkpoint


def _build(seed: int, updates: int = 2) -> TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(updates):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step(), optimizer.zero_grad()
    params = {n: p.detach() * 0.5 for n, p in model.named_parameters()}
    ema = {"step": updates, "num_updates": updates, "params": params, "buffers": {}}
    return TrainState(model=model, optimizer=optimizer, step=updates, extras={"ema": ema})


def _snapshot(state: TrainState) -> dict[str, Any]:
    return copy.deepcopy(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict() if state.optimizer else None,
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
        "optimizer.json: state['weight']['exp_avg']: shape [3] torch.float32, of shape [3, 4]",
    ),
    "exp_avg stored as int32": (
        _tensors("optimizer.safetensors", EXP_AVG, lambda t: t.to(torch.int32)),
        "state['weight']['exp_avg']: shape [3, 4] torch.int32, of shape [3, 4] torch.float32",
    ),
    "state of a tensor the model lacks": (
        _json("optimizer.json", _ghost_parameter),
        "optimizer.json: parameter 'ghost', in the model absent",
    ),
    "weight re-typed as int8": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.int8)),
        "optimizer.json: parameter 'weight', in the model shape [3, 4] torch.int8",
    ),
    "weight re-typed as bool": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.bool)),
        "optimizer.json: parameter 'weight', in the model shape [3, 4] torch.bool",
    ),
    "weight re-typed as float64": (
        _tensors("model.safetensors", "weight", lambda t: t.to(torch.float64)),
        "state['weight']['exp_avg_sq']: shape [3, 4] torch.float32, of shape [3, 4] torch.float64",
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
        "extras.json: ['ema']['weight']: shape [4, 3] torch.float32, in the model shape [3, 4]",
    ),
    "an EMA of a tensor the model lacks": (
        _json("extras.json", _ghost_average),
        "extras.json: ['ema']['ghost']: shape [3] torch.float32, in the model absent",
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
    older = save_checkpoint(_build(1, updates=1), root / "step_000001")
    newer = save_checkpoint(_build(2), root / "step_000002")
    edit(newer)
    _resign(newer)
    template = _build(0, updates=0)  # fresh: no optimizer state to compare with
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
    before = _snapshot(template)
    with pytest.raises(ValueError, match="does not fit the template") as error:
        load_checkpoint(path, like=template)
    assert (
        "model: 'weight': torch.float64 in the checkpoint, torch.float32 in the template; "
        "cast the model first, e.g. model.to(torch.float64)"
    ) in str(error.value)
    assert _same(before, _snapshot(template))
    cast = TrainState(model=nn.Linear(4, 3).to(torch.float64))
    assert load_checkpoint(path, like=cast).model.weight.dtype == torch.float64


def test_non_finite_weights_load_only_when_the_caller_expects_them(tmp_path: Path) -> None:
    # Before: NaN weights loaded (and resumed) silently; there was no way to say they are
    # expected.
    state = _build(1)
    with torch.no_grad():
        state.model.bias[1] = float("inf")
    path = save_checkpoint(state, tmp_path / "ckpt" / "step_000002")
    line = f"{path}/model.safetensors: 'bias' holds NaN or inf"
    with pytest.raises(DamagedCheckpointError, match="'bias' holds NaN or inf"):
        load_checkpoint(path, like=_build(0, updates=0))
    assert verify_checkpoint(path)[0].startswith(line)
    with pytest.raises(DamagedCheckpointError), pytest.warns(UserWarning, match="skipped"):
        load_latest(tmp_path / "ckpt", like=_build(0, updates=0))
    loaded = load_checkpoint(path, like=_build(0, updates=0), allow_nonfinite=True)
    assert _same(loaded.model.state_dict(), state.model.state_dict())
    found = load_latest(tmp_path / "ckpt", like=_build(0, updates=0), allow_nonfinite=True)
    assert found is not None and found[1] == path


def test_export_refuses_an_ema_whose_shapes_are_not_the_models(tmp_path: Path) -> None:
    # Before: export_model wrote the wrong-shaped EMA weight (live or from the folder).
    state = _build(1)
    ema = state.extras["ema"]
    wrong = {**ema, "params": {**ema["params"], "weight": torch.zeros(4, 3)}}
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
        save_checkpoint(_build(1), tmp_path / "step_000005")
    assert not (tmp_path / "step_000005").exists()
    assert save_checkpoint(_build(1), tmp_path / "step_5").name == "step_5"  # other names
