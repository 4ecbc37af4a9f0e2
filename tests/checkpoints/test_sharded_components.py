"""A sharded (FSDP2) checkpoint's components read on their own (commit 2a5e7e0).

Two gloo ranks write one FSDP2 checkpoint whose ``extras`` hold DTensors (an EMA, and one
of its tensors held a second time); this process then reads it without a process group:
a template of another EMA shape is refused with each sharded difference listed once, and
exporting the EMA allocates the model and the EMA, not the optimizer's state.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from spawning import gloo_group, spawn

from toolkit import TrainState, export_model, load_checkpoint, make_step, save_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built"),
    pytest.mark.skipif(sys.platform != "linux", reason="gloo over FileStore tested on Linux"),
]

WORLD = 2
EMA_KEY = "extras/ema/params/0.weight"  # the sharded key of the EMA's first weight


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _worker(rank: int, store: str, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    with gloo_group(rank, WORLD, store):
        mesh = init_device_mesh("cpu", (WORLD,))
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = TrainState(model=model, optimizer=optimizer)
        g = torch.Generator().manual_seed(rank)
        state, _ = make_step(_loss)(
            state, (torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g))
        )
        # An EMA of DTensors (distinct values from the model's), one of them held twice.
        params = {n: p.detach() * 0.5 + 1.0 for n, p in model.named_parameters()}
        ema = {"decay": 0.9, "num_updates": 1, "params": params}
        extras = {"ema": ema, "pinned": params["0.weight"]}
        save_checkpoint(state.replace(extras=extras), Path(folder))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sharded_components")

    def attempt_args(attempt: int) -> tuple[str, str]:
        return str(tmp / f"store{attempt}"), str(tmp / f"attempt{attempt}" / "step_000001")

    spawn(_worker, attempt_args, nprocs=WORLD, timeout=120)
    return max(tmp.glob("attempt*")) / "step_000001"


def test_a_sharded_difference_of_a_tensor_held_twice_is_listed_once(checkpoint: Path) -> None:
    # Bug caught: the EMA's weight, held twice in extras (stored once, under one key), was
    # listed twice among the differences: each reference reported the same sharded key.
    model = _model()
    wrong = torch.zeros(3, 3)  # the EMA of another model: this weight's shape differs
    params = {n: torch.zeros_like(p) for n, p in model.named_parameters()} | {"0.weight": wrong}
    like = TrainState(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
        extras={"ema": {"decay": 0.9, "num_updates": 0, "params": params}, "pinned": wrong},
    )
    with pytest.raises(ValueError, match="does not fit the template") as error:
        load_checkpoint(checkpoint, like=like)
    message = str(error.value)
    line = f"{EMA_KEY!r}: shape [6, 4] in the checkpoint, shape [3, 3] in the template"
    assert f"sharded tensors: {line}" in message
    assert message.count(repr(EMA_KEY)) == 1, message
    assert "extras/ema/params/0.bias" not in message  # only the tensor that differs
    # The extras' own comparison quotes the saved shape, not the load's stand-in's ([0]).
    assert "['0.weight']: shape [6, 4] torch.float32 in the checkpoint" in message, message
    assert "shape [0]" not in message, message


def test_exporting_the_ema_allocates_the_model_and_the_ema_not_the_optimizer_state(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bug caught: reading extras out of a sharded checkpoint allocated every key of
    # sharded/ (the model once more, and AdamW's two moments and step per parameter) to
    # fill the EMA's four tensors. Seen as the elements asked of torch.empty during the
    # export: at most the model's (its weights) and the EMA's (as many), not 3x that.
    model_weights = load_file(export_model(checkpoint, tmp_path / "model.safetensors"))
    elements = sum(t.numel() for t in model_weights.values())
    requested: list[tuple[int, ...]] = []
    empty = torch.empty

    def recording(*size: Any, **kwargs: Any) -> torch.Tensor:
        out = empty(*size, **kwargs)
        if out.device.type != "meta":  # the checks' stand-ins of saved shapes hold no memory
            requested.append(tuple(out.shape))
        return out

    monkeypatch.setattr(torch, "empty", recording)
    path = export_model(checkpoint, tmp_path / "ema.safetensors", weights="ema")
    monkeypatch.undo()
    allocated = sum(math.prod(shape) for shape in requested)
    assert 0 < allocated <= 2 * elements, requested
    # The EMA's values were put together from both ranks' shards (p * 0.5 + 1, see _worker).
    exported = load_file(path)
    assert exported.keys() == model_weights.keys()
    for name, weight in model_weights.items():
        torch.testing.assert_close(exported[name], weight * 0.5 + 1.0, rtol=0, atol=1e-6)
