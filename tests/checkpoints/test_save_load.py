"""save_checkpoint / load_checkpoint: complete state, exact resume, safe loading, clear refusals."""

from __future__ import annotations

import errno
import inspect
import io
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.optim import lr_scheduler as lrs

import toolkit.checkpoints._components as components_module
import toolkit.checkpoints._load as load_module
import toolkit.checkpoints._manifest as manifest_module
import toolkit.checkpoints._save as save_module
from toolkit import (
    TrainState,
    accumulate,
    amp_wrap,
    export_model,
    load_checkpoint,
    make_step,
    run,
    save_checkpoint,
)
from toolkit.checkpoints import DamagedCheckpointError, verify_checkpoint
from toolkit.checkpoints._components import COMPONENTS, Component
from toolkit.checkpoints._files import checksum
from toolkit.checkpoints._manifest import manifest_document, read_manifest
from toolkit.plugins import ema, ema_model

# ----------------------------------------------------------------------------------------
# A small training setup: a model with dropout (so the RNG matters), two parameter groups.


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(width, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.out(torch.relu(self.drop(self.inp(x))))


def groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": 0.01},
        {"params": biases, "weight_decay": 0.0, "lr": lr * 2},
    ]


def _sequential(opt: torch.optim.Optimizer) -> Any:
    warm = lrs.LinearLR(opt, start_factor=0.1, total_iters=3)
    return lrs.SequentialLR(opt, [warm, lrs.ExponentialLR(opt, gamma=0.8)], milestones=[3])


CASES: dict[str, dict[str, Callable[..., Any]]] = {
    "sgd_momentum_lambdalr": {
        "optimizer": lambda m: torch.optim.SGD(groups(m, 0.05), lr=0.05, momentum=0.9),
        "scheduler": lambda o: lrs.LambdaLR(o, lambda s: 0.9**s),
    },
    "adam_sequentiallr": {
        "optimizer": lambda m: torch.optim.Adam(groups(m, 1e-2), lr=1e-2, betas=(0.8, 0.95)),
        "scheduler": _sequential,
    },
    "adamw_fused_onecyclelr": {
        "optimizer": lambda m: torch.optim.AdamW(groups(m, 1e-2), lr=1e-2, fused=True),
        "scheduler": lambda o: lrs.OneCycleLR(o, max_lr=[0.02, 0.04], total_steps=20),
    },
    "adamw_foreach_amsgrad": {
        "optimizer": lambda m: torch.optim.AdamW(
            groups(m, 1e-2), lr=1e-2, foreach=True, amsgrad=True
        ),
        "scheduler": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    },
    "sgd_fp16_scaler": {
        "optimizer": lambda m: torch.optim.SGD(groups(m, 0.05), lr=0.05, momentum=0.9),
        "scheduler": lambda o: None,
        # growth every update: the scale at the save differs from a fresh scaler's
        "fp16": lambda: torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1),
    },
    "adam_ema": {
        "optimizer": lambda m: torch.optim.Adam(groups(m, 1e-2), lr=1e-2),
        "scheduler": lambda o: lrs.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        "plugins": lambda: [ema(0.8)],
    },
}


def build(case: str, seed: int) -> tuple[TrainState, Any, list[Any]]:
    """A fresh state for ``case`` (weights from ``seed``), its step and plugins."""
    spec = CASES[case]
    torch.manual_seed(seed)
    model = Net()
    optimizer = spec["optimizer"](model)
    state = TrainState(model=model, optimizer=optimizer, scheduler=spec["scheduler"](optimizer))
    step = make_step(lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]))
    if "fp16" in spec:
        step = amp_wrap(step, dtype="fp16", scaler=spec["fp16"]())
    plugins = spec["plugins"]() if "plugins" in spec else []
    return state, step, plugins


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def assert_same_state(a: TrainState, b: TrainState) -> None:
    assert_same_tree(dict(a.model.state_dict()), dict(b.model.state_dict()), "model")
    assert_same_tree(a.optimizer.state_dict(), b.optimizer.state_dict(), "optimizer")
    if a.scheduler is not None:
        assert_same_tree(a.scheduler.state_dict(), b.scheduler.state_dict(), "scheduler")
    if a.scaler is not None:
        assert_same_tree(a.scaler.state_dict(), b.scaler.state_dict(), "scaler")
    assert_same_tree(dict(a.extras), dict(b.extras), "extras")
    assert (a.step, a.window.micro_step, a.guard) == (b.step, b.window.micro_step, b.guard)


# ----------------------------------------------------------------------------------------
# Complete state: a resumed run continues bitwise like an uninterrupted one.


@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_continues_bitwise_like_an_uninterrupted_one(case: str, tmp_path: Path) -> None:
    # Bugs caught: any part of the state not saved or not restored (optimizer moments,
    # momentum buffers, the fused step counters, scheduler position, OneCycle's momentum
    # in the param groups, the loss scale and growth tracker, EMA weights, the dropout RNG).
    data = batches(8)
    reference, step, plugins = build(case, seed=0)
    reference = run(step, reference, data[:4], epochs=1, plugins=plugins)
    reference = run(step, reference, data[4:], epochs=2, plugins=plugins)
    reference_rng = torch.get_rng_state()

    first, step, plugins = build(case, seed=0)
    first = run(step, first, data[:4], epochs=1, plugins=plugins)
    path = save_checkpoint(first, tmp_path / "step_000004")
    torch.manual_seed(123)  # the resumed process's RNG has moved on
    template, step, plugins = build(case, seed=99)  # other initial weights: the load must set them
    resumed = load_checkpoint(path, like=template)
    resumed = run(step, resumed, data[4:], epochs=2, plugins=plugins)

    assert resumed.step == reference.step > 5  # fp16: the scaler may skip an update
    assert_same_state(reference, resumed)
    assert torch.equal(torch.get_rng_state(), reference_rng)
    if case == "sgd_fp16_scaler":
        assert resumed.scaler is not None and template.scaler is None  # built from the file
        assert first.scaler is not None and first.scaler.get_scale() > 256.0


def test_the_rng_restore_is_what_makes_dropout_resume_exactly(tmp_path: Path) -> None:
    # Shows the resume test above depends on the RNG states: without them the dropout masks
    # after the resume differ (bug caught: RNG states not saved or not restored).
    data = batches(6)
    results = []
    for rng in (True, False):
        state, step, _ = build("adam_sequentiallr", seed=0)
        state = run(step, state, data[:3], epochs=1)
        path = save_checkpoint(state, tmp_path / f"rng_{rng}")
        torch.manual_seed(5)
        template, step, _ = build("adam_sequentiallr", seed=0)
        state = run(step, load_checkpoint(path, like=template, rng=rng), data[3:], epochs=2)
        results.append(state.model.inp.weight.detach().clone())
    reference, step, _ = build("adam_sequentiallr", seed=0)
    reference = run(step, run(step, reference, data[:3], epochs=1), data[3:], epochs=2)
    assert torch.equal(results[0], reference.model.inp.weight)
    assert not torch.equal(results[1], reference.model.inp.weight)


def test_rng_states_of_python_numpy_and_torch_are_restored(tmp_path: Path) -> None:
    import random

    numpy = pytest.importorskip("numpy")
    state, _, _ = build("adam_ema", seed=0)
    random.seed(1), numpy.random.seed(2), torch.manual_seed(3)
    numpy.random.randn()  # a cached Gaussian is part of numpy's state
    path = save_checkpoint(state, tmp_path / "c")
    expected = (random.random(), numpy.random.randn(), torch.rand(1))
    random.seed(9), numpy.random.seed(9), torch.manual_seed(9)
    load_checkpoint(path, like=build("adam_ema", seed=0)[0])
    got = (random.random(), numpy.random.randn(), torch.rand(1))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


class LrWriter:
    """A scheduler whose loading writes the optimizer's learning rates, as SequentialLR's
    construction does (pytorch#119168): a restore that loads the optimizer first and the
    scheduler after loses the optimizer's saved rates."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.last = 0

    def step(self) -> None:
        self.last += 1
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 * 0.5**self.last

    def state_dict(self) -> dict[str, Any]:
        return {"last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = state["last"]
        for group in self.optimizer.param_groups:  # back to the schedule's start value
            group["lr"] = 0.1


def test_the_optimizer_is_restored_after_the_scheduler_so_its_saved_rates_win(
    tmp_path: Path,
) -> None:
    # Bug caught: restoring the optimizer before the scheduler (the scheduler's load then
    # overwrites the saved learning rates).
    def fresh() -> TrainState:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return TrainState(model=model, optimizer=optimizer, scheduler=LrWriter(optimizer))

    state = fresh()
    for _ in range(3):
        state.scheduler.step()
    state.optimizer.param_groups[0]["lr"] = 0.0125  # the saved rate (e.g. set by hand)
    path = save_checkpoint(state, tmp_path / "c")

    wrong = fresh()  # the wrong order, by hand: optimizer first, scheduler second
    wrong.optimizer.load_state_dict(state.optimizer.state_dict())
    wrong.scheduler.load_state_dict(state.scheduler.state_dict())
    assert wrong.optimizer.param_groups[0]["lr"] == 0.1

    loaded = load_checkpoint(path, like=fresh())
    assert loaded.optimizer.param_groups[0]["lr"] == 0.0125
    assert loaded.scheduler.last == 3


def test_sequentiallr_resumes_with_the_saved_learning_rates(tmp_path: Path) -> None:
    # The built-in case of the ordering: SequentialLR's constructor resets the rates; the
    # loaded optimizer and scheduler must both end at the saved ones.
    state, _, _ = build("adam_sequentiallr", seed=0)
    for _ in range(5):
        state.optimizer.step()
        state.scheduler.step()
    path = save_checkpoint(state, tmp_path / "c")
    template, _, _ = build("adam_sequentiallr", seed=0)
    assert template.optimizer.param_groups[0]["lr"] != state.optimizer.param_groups[0]["lr"]
    loaded = load_checkpoint(path, like=template)
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [
        g["lr"] for g in state.optimizer.param_groups
    ]
    assert loaded.scheduler.get_last_lr() == state.scheduler.get_last_lr()


# ----------------------------------------------------------------------------------------
# The model file: plain names, tied weights.


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory):
    """A single-process gloo group, enough for DistributedDataParallel on CPU."""
    if dist.is_initialized():
        yield None
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrapping", ["compile", "ddp", "compile_ddp", "dataparallel"])
def test_model_file_of_a_wrapped_model_loads_strictly_into_the_plain_model(
    wrapping: str, tmp_path: Path, process_group: None
) -> None:
    # Bug caught: "_orig_mod." or "module." prefixes in the saved keys.
    net = Net()
    wrapped: nn.Module = net
    if "ddp" in wrapping:
        wrapped = nn.parallel.DistributedDataParallel(wrapped)
    if wrapping == "dataparallel":
        wrapped = nn.DataParallel(wrapped)
    if "compile" in wrapping:
        wrapped = torch.compile(wrapped, backend="eager")
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    state = TrainState(model=wrapped, optimizer=optimizer)
    step = make_step(lambda m, b: m(b).square().mean())
    state, _ = step(state, torch.randn(3, 4))  # runs the wrapper (compiles with "eager")
    path = save_checkpoint(state, tmp_path / "c")

    tensors = load_file(path / "model.safetensors")
    assert sorted(tensors) == ["calls", "inp.bias", "inp.weight", "out.bias", "out.weight"]
    plain = Net()
    plain.load_state_dict(tensors, strict=True)
    assert torch.equal(plain.inp.weight, net.inp.weight)
    # The whole checkpoint also loads into a plain template, optimizer state included.
    template = TrainState(model=Net(), optimizer=None)
    template = template.replace(optimizer=torch.optim.AdamW(template.model.parameters(), lr=1e-2))
    loaded = load_checkpoint(path, like=template)
    assert_same_tree(loaded.optimizer.state_dict()["state"], state.optimizer.state_dict()["state"])


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path: Path) -> None:
    # Bugs caught: safetensors refusing the shared tensor; the tie stored twice (two
    # tensors on load, so training unties them); the alias not restored (strict load fails).
    model = Tied()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=optimizer)
    step = make_step(lambda m, b: m(b).logsumexp(-1).mean())
    state, _ = step(state, torch.tensor([[1, 2, 3]]))
    path = save_checkpoint(state, tmp_path / "c")

    assert sorted(load_file(path / "model.safetensors")) == [
        "body.bias",
        "body.weight",
        "embed.weight",
    ]
    manifest = read_manifest(path)
    assert manifest.aliases == {"head.weight": "embed.weight"}

    fresh = Tied()
    template = TrainState(model=fresh, optimizer=torch.optim.Adam(fresh.parameters(), lr=0.1))
    loaded = load_checkpoint(path, like=template)
    assert loaded.model.head.weight is loaded.model.embed.weight
    assert torch.equal(loaded.model.embed.weight, model.embed.weight)
    assert_same_tree(loaded.optimizer.state_dict(), state.optimizer.state_dict())
    # and the tie survives training: one update moves both names
    loaded, _ = step(loaded, torch.tensor([[4, 5]]))
    assert loaded.model.head.weight is loaded.model.embed.weight


def test_a_tie_in_the_checkpoint_but_not_in_the_template_is_refused(tmp_path: Path) -> None:
    # Bug caught: loading tied values into an untied model silently (they would drift apart).
    path = save_checkpoint(TrainState(model=Tied()), tmp_path / "c")
    untied = Tied()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, like=TrainState(model=untied))
    assert (
        "model: tied weights differ: the checkpoint shares one tensor among ['embed.weight', "
        "'head.weight'], the model among ['embed.weight'] (tie the weights as in the saved model)"
    ) in str(error.value)


# ----------------------------------------------------------------------------------------
# What is on disk.


def test_folder_holds_json_and_safetensors_listed_in_the_manifest(tmp_path: Path) -> None:
    # The format: every file listed with size and checksum, classes, version.
    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(2), epochs=1, plugins=plugins)
    path = save_checkpoint(state, tmp_path / "step_000002", metrics={"val/loss": 0.25})
    names = sorted(os.listdir(path))
    assert names == [
        "extras.json",
        "extras.safetensors",
        "manifest.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "rng.json",
        "rng.safetensors",
        "scheduler.json",
        "state.json",
        "state.safetensors",  # data_state: the RNG states the pass drew its order from
    ]
    document = json.loads((path / "manifest.json").read_text())
    assert document["format"] == "toolkit-checkpoint" and document["version"] == 2
    assert document["step"] == 2 and document["metrics"] == {"val/loss": 0.25}
    assert document["checksum"] == "xxh3_128"
    assert sorted(document["files"]) == sorted(n for n in names if n != "manifest.json")
    for name, entry in document["files"].items():
        assert entry == {"size": (path / name).stat().st_size, "xxh3_128": checksum(path / name)}
    assert document["classes"] == {"optimizer": "Adam", "scheduler": "LambdaLR"}
    assert document["aliases"] == {} and document["sharded"] is False
    # Optimizer state is keyed by parameter names, groups list names.
    optimizer = json.loads((path / "optimizer.json").read_text())
    assert sorted(optimizer["state"]) == ["inp.bias", "inp.weight", "out.bias", "out.weight"]
    assert optimizer["param_groups"][0]["params"] == ["inp.weight", "out.weight"]
    assert optimizer["param_groups"][0]["betas"] == {"$tuple": [0.9, 0.999]}
    assert (
        sorted(load_file(path / "optimizer.safetensors"))[0] == "optimizer/state/inp.bias/exp_avg"
    )
    fields = json.loads((path / "state.json").read_text())
    assert fields["step"] == 2 and fields["window"]["micro_step"] == 0
    assert fields["guard"] == {"notfinite_count": 0, "total_notfinite": 0, "total_overflow": 0}
    assert sorted(load_file(path / "extras.safetensors")) == [
        "extras/ema/params/inp.bias",
        "extras/ema/params/inp.weight",
        "extras/ema/params/out.bias",
        "extras/ema/params/out.weight",
    ]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fds through /proc")
def test_every_file_then_the_folder_then_its_parent_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bug caught: a rename published before the data (or the folder entry) reached the
    # disk, so a power cut could leave a complete-looking folder of empty files.
    synced: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(2), epochs=1, plugins=plugins)
    path = save_checkpoint(state, tmp_path / "c")
    (temp,) = {p for p in synced if Path(p).name.startswith(".tmp-c-")}  # the folder
    files = sorted(os.listdir(path))
    assert sorted(Path(p).name for p in synced if Path(p).parent == Path(temp)) == files
    last_file = max(i for i, p in enumerate(synced) if Path(p).parent == Path(temp))
    assert synced.index(temp) > last_file  # the folder after every file in it
    assert synced[-1] == str(tmp_path)  # the parent after the rename
    assert synced.index(temp) < len(synced) - 1


def test_an_open_accumulation_window_is_refused(tmp_path: Path) -> None:
    # Bug caught: saving mid-window, which loses the accumulated .grad.
    model = nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=2)
    state, _ = step(state, torch.ones(1, 2))
    with pytest.raises(ValueError) as error:
        save_checkpoint(state, tmp_path / "c")
    assert str(error.value) == (
        "save_checkpoint: the accumulation window is open (state.window.micro_step=1), and "
        "its gradients are in no state dict; save after the update that closes the window "
        "(when out.updated is true)."
    )
    assert not (tmp_path / "c").exists() and os.listdir(tmp_path) == []


def test_a_state_already_passed_to_a_step_is_refused_and_a_load_gives_a_fresh_one(
    tmp_path: Path,
) -> None:
    # Bugs caught: saving a stale state (its counters behind the model it holds); a loaded
    # state inheriting the template's "consumed" mark, so the next step refuses it.
    model = nn.Linear(2, 1)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step = make_step(lambda m, b: m(b).mean())
    newer, _ = step(state, torch.ones(1, 2))
    with pytest.raises(ValueError) as error:
        save_checkpoint(state, tmp_path / "c")
    assert str(error.value) == (
        "save_checkpoint: this TrainState (step 0) was passed to a train step, which returned "
        "its successor; its counters are behind the model. Save the state the step returned: "
        "state, out = step(state, batch)."
    )
    path = save_checkpoint(newer, tmp_path / "c")
    loaded = load_checkpoint(path, like=state)  # a consumed template
    loaded, out = step(loaded, torch.ones(1, 2))
    assert out.updated and loaded.step == 2


def test_extras_breaking_the_rule_are_refused_at_save_naming_the_path(tmp_path: Path) -> None:
    # Bug caught: a plugin's unstorable value pickled or dropped; or refused only after
    # files were written (leaving a temporary folder behind).
    state = TrainState(model=nn.Linear(1, 1), extras={"myplugin": {"count": 1, "fn": len}})
    with pytest.raises(TypeError) as error:
        save_checkpoint(state, tmp_path / "c")
    assert str(error.value) == (
        "extras['myplugin']['fn']: a function, which a checkpoint cannot store; keep only "
        "tensors, numbers, strings, bools, None, lists, tuples and dicts in checkpointed state."
    )
    assert os.listdir(tmp_path) == []


def test_metrics_must_be_numbers(tmp_path: Path) -> None:
    state = TrainState(model=nn.Linear(1, 1))
    with pytest.raises(ValueError) as error:
        save_checkpoint(state, tmp_path / "c", metrics={"val/loss": torch.tensor(0.5)})
    assert str(error.value) == (
        "save_checkpoint: metrics['val/loss'] must be a number under a str key; got 'Tensor'. "
        "Pass python floats, e.g. float(loss)."
    )


def test_settings_are_recorded_in_the_manifest_and_read_back(tmp_path: Path) -> None:
    from toolkit.checkpoints import save_in_background
    from toolkit.checkpoints._load import verified_manifest

    state = TrainState(model=nn.Linear(1, 1))
    settings = {"groups": [{"lr": 0.1, "betas": (0.9, 0.999)}], "clip": float("inf")}
    path = save_checkpoint(state, tmp_path / "a", settings=settings)
    assert verified_manifest(path).settings == settings  # the tuple stays a tuple
    background = save_in_background(state, tmp_path / "b", settings={"batch_size": 4}).result()
    assert verified_manifest(background).settings == {"batch_size": 4}
    assert verified_manifest(save_checkpoint(state, tmp_path / "c")).settings == {}
    with pytest.raises(ValueError, match="settings must be a tree of JSON values"):
        save_checkpoint(state, tmp_path / "d", settings={"w": torch.ones(1)})


def test_a_folder_that_is_not_a_checkpoint_is_not_replaced(tmp_path: Path) -> None:
    # Bug caught: save_checkpoint deleting an unrelated folder that happens to be at path.
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError) as error:
        save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "data")
    assert str(error.value) == (
        f"save_checkpoint: {tmp_path / 'data'} exists and is not a checkpoint folder (no "
        "manifest.json); refusing to replace it. Pick another path or remove it."
    )
    assert (tmp_path / "data" / "keep.txt").read_text() == "precious"


def test_saving_again_to_the_same_path_replaces_the_checkpoint(tmp_path: Path) -> None:
    state = TrainState(model=nn.Linear(1, 1))
    save_checkpoint(state.replace(step=1), tmp_path / "latest_ckpt")
    save_checkpoint(state.replace(step=2), tmp_path / "latest_ckpt")
    assert load_checkpoint(tmp_path / "latest_ckpt", like=state).step == 2
    assert os.listdir(tmp_path) == ["latest_ckpt"]  # no .old- or .tmp- left


def test_extra_objects_round_trip_and_must_match(tmp_path: Path) -> None:
    # Bug caught: objects= ignored on save or load; a missing object silently skipped.
    class Counter:
        def __init__(self) -> None:
            self.seen = 0
            self.history: list[float] = []

        def state_dict(self) -> dict[str, Any]:
            return {
                "seen": self.seen,
                "history": list(self.history),
                "t": torch.ones(2) * self.seen,
            }

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.seen, self.history = state["seen"], state["history"]
            assert torch.equal(state["t"], torch.ones(2) * self.seen)

    counter = Counter()
    counter.seen, counter.history = 7, [0.5, 0.25]
    state = TrainState(model=nn.Linear(1, 1))
    path = save_checkpoint(state, tmp_path / "c", objects={"counter": counter})
    fresh = Counter()
    load_checkpoint(path, like=state, objects={"counter": fresh})
    assert (fresh.seen, fresh.history) == (7, [0.5, 0.25])
    with pytest.raises(ValueError, match=r"\n  objects: .*'counter'\n"):
        load_checkpoint(path, like=state)
    with pytest.raises(TypeError, match=r"objects\['x'\] \(int\) has no state_dict\(\) and"):
        save_checkpoint(state, tmp_path / "d", objects={"x": 3})


# ----------------------------------------------------------------------------------------
# Template mismatches: every difference listed, nothing touched.


class Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)  # another width
        self.extra = nn.Linear(2, 2)  # not in the checkpoint
        # no "out": in the checkpoint, not here


def test_a_checkpoint_that_does_not_fit_the_template_lists_every_difference(
    tmp_path: Path,
) -> None:
    # Bug caught: a partial load (strict=False) or a first-difference-only error; the
    # template modified before the refusal.
    state, _, _ = build("adam_sequentiallr", seed=0)
    state.optimizer.step()
    state = state.replace(extras={"ema": {"params": {"inp.weight": torch.zeros(8, 4)}}})
    path = save_checkpoint(state, tmp_path / "c")

    model = Other()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    template = TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=lrs.StepLR(optimizer, 1),
        extras={
            "ema": {"params": {"inp.weight": torch.zeros(16, 4), "extra.bias": torch.zeros(2)}}
        },
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, like=template)
    message = str(error.value)
    assert message.startswith(f"load_checkpoint: {path} does not fit the template state (")
    lines = message.split("\n  ")[1:]
    # each difference once, on a line naming its component and the offending keys
    for component, keys in [
        ("model", ["'extra.bias'", "'extra.weight'"]),  # the template's, not saved
        ("model", ["'calls'", "'out.bias'", "'out.weight'"]),  # saved, not the template's
        ("model", ["'inp.bias'", "[8]", "[16]"]),
        ("model", ["'inp.weight'", "[8, 4]", "[16, 4]"]),
        ("optimizer", ["Adam", "SGD"]),
        ("optimizer", ["'out.weight'"]),  # in group 0 of the checkpoint, not the template
        ("optimizer", ["'extra.weight'", "'extra.bias'"]),
        ("scheduler", ["SequentialLR", "StepLR"]),
        ("extras", ["['ema']['params']['extra.bias']"]),
        ("extras", ["['ema']['params']['inp.weight']", "[8, 4]", "[16, 4]"]),
    ]:
        assert any(component in line and all(k in line for k in keys) for line in lines), keys
    assert f"({len(lines)} difference(s))" in message
    assert message.endswith(
        "\nBuild the template like the saved run (same model, optimizer, scheduler and "
        "plugins), or load the model alone with safetensors.torch.load_file."
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_missing_handles_and_parameter_groups_are_differences(tmp_path: Path) -> None:
    state, _, _ = build("sgd_momentum_lambdalr", seed=0)
    path = save_checkpoint(state, tmp_path / "c")
    model = Net()
    optimizer = torch.optim.SGD(
        [
            {"params": [model.inp.weight, model.out.weight, model.inp.bias]},
            {"params": [model.out.bias]},
        ],
        lr=0.1,
    )
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, like=TrainState(model=model, optimizer=optimizer))
    lines = str(error.value).split("\n  ")[1:]
    assert any("optimizer" in line and "'inp.bias'" in line for line in lines)  # its group
    assert any("scheduler" in line and "checkpoint, not the template" in line for line in lines)
    with pytest.raises(
        ValueError, match="\n  .*in the checkpoint, not the template: .*'optimizer'"
    ):
        load_checkpoint(path, like=TrainState(model=Net()))


def test_an_unknown_trainstate_field_is_refused_and_a_missing_one_keeps_the_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forward compatibility: a field added to TrainState later is missing from older
    # checkpoints (the template's value stays); a field this version lacks is refused.
    original = components_module.fields_of

    def saving_state(take: Any) -> None:  # the table, with another "state" entry
        table = [replace(c, take=take) if c.name == "state" else c for c in COMPONENTS]
        monkeypatch.setattr(save_module, "COMPONENTS", tuple(table))

    saving_state(lambda s, objects: {**original(s), "future": 1, "guard": {"x": 1}})
    path = save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    saving_state(lambda s, objects: {"step": original(s)["step"]})
    older = save_checkpoint(
        TrainState(model=nn.Linear(1, 1), epoch=0).replace(step=4), tmp_path / "old"
    )
    monkeypatch.undo()
    with pytest.raises(ValueError) as error:
        load_checkpoint(path, like=TrainState(model=nn.Linear(1, 1)))
    assert "\n  state fields: in the checkpoint, not the template: 'future', 'guard.x'\n" in str(
        error.value
    )
    loaded = load_checkpoint(older, like=TrainState(model=nn.Linear(1, 1), epoch=3))
    assert (loaded.step, loaded.epoch) == (4, 3)


def test_a_new_component_is_one_entry_of_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A part added to COMPONENTS is saved, listed, kept model-only and restored
    # with no other change (once it took six places in four files).
    box = {"n": 3}
    entry = Component(
        "box", lambda s, objects: dict(box), lambda s, tree, _: box.update(tree), model_only=True
    )
    for module in (save_module, load_module, manifest_module, components_module):
        monkeypatch.setattr(module, "COMPONENTS", (*COMPONENTS, entry))
    path = save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    assert {"box.json", "state.json"} <= read_manifest(path).files.keys()
    box["n"] = 0
    load_checkpoint(path, like=TrainState(model=nn.Linear(1, 1)))
    assert box == {"n": 3}
    assert manifest_module.reduce_to_model(path) and read_manifest(path).has("box")


# ----------------------------------------------------------------------------------------
# Loading never runs code.


class Payload:
    """Unpickling this creates ``marker``: proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling entry point fails the test loudly."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the load path unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    numpy = pytest.importorskip("numpy")
    monkeypatch.setattr(numpy, "load", refuse)


def test_pickle_payloads_under_extra_names_are_never_opened(
    tmp_path: Path, no_unpickling: None
) -> None:
    # Bug caught: a loader that globs *.pt/*.pkl files or falls back to torch.load.
    marker = tmp_path / "PWNED"
    path = saved(tmp_path)
    state = load_checkpoint(path, like=build("adam_ema", seed=0)[0])
    payload = pickle.dumps(Payload(marker))
    for name in [
        "model.pt",
        "optimizer.pt",
        "training_state.pt",
        "data.pkl",
        "rng_state.pth",
        "pytorch_model.bin",
        "extras.pkl",
        "model.safetensors.pt",
    ]:
        (path / name).write_bytes(payload)
    loaded = load_checkpoint(path, like=build("adam_ema", seed=1)[0])
    assert loaded.step == state.step
    assert not marker.exists()
    assert verify_checkpoint(path) == []  # unlisted files are ignored, not judged


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.json", "manifest.json"],
)
def test_pickle_payloads_under_existing_names_are_refused_without_running(
    name: str, tmp_path: Path, no_unpickling: None
) -> None:
    # Bug caught: reading a replaced file before checking it against the manifest.
    marker = tmp_path / "PWNED"
    path = saved(tmp_path)
    assert name == "manifest.json" or name in read_manifest(path).files
    (path / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=build("adam_ema", seed=1)[0])
    assert str(path / name) in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.json", "extras.safetensors"])
def test_a_consistent_manifest_over_a_pickle_is_refused_without_running(
    name: str, tmp_path: Path, no_unpickling: None
) -> None:
    # The attacker also rewrites the manifest so sizes and checksums match: the file is
    # then parsed as safetensors or JSON only, which fails, and nothing runs.
    marker = tmp_path / "PWNED"
    path = saved(tmp_path)
    assert name in read_manifest(path).files
    payload = pickle.dumps(Payload(marker))
    (path / name).write_bytes(payload)
    forge(path, {name: payload})
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=build("adam_ema", seed=1)[0])
    kind = "not JSON" if name.endswith(".json") else "not a safetensors file"
    assert f"{path / name}: {kind}" in str(error.value)
    assert not marker.exists()


def test_torch_save_zip_payload_in_place_of_the_model_file_is_refused(
    tmp_path: Path, no_unpickling: None
) -> None:
    marker = tmp_path / "PWNED"
    path = save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    data = io.BytesIO()
    torch.save({"w": Payload(marker)}, data)  # a zip archive holding data.pkl
    (path / "model.safetensors").write_bytes(data.getvalue())
    forge(path, {"model.safetensors": data.getvalue()})
    with pytest.raises(DamagedCheckpointError, match="model.safetensors: not a safetensors file"):
        load_checkpoint(path, like=TrainState(model=nn.Linear(1, 1)))
    assert not marker.exists()


def forge(path: Path, contents: dict[str, bytes]) -> None:
    """Rewrite the manifest so the given files' sizes and checksums match (an attacker)."""
    document = json.loads((path / "manifest.json").read_text())
    for name in contents:
        document["files"][name] = {"size": len(contents[name]), "xxh3_128": checksum(path / name)}
    del document["manifest_xxh3_128"], document["format"], document["version"]
    del document["checksum"], document["metrics"]
    document = manifest_document(**document, metrics={})
    (path / "manifest.json").write_text(json.dumps(document))


def test_a_manifest_listing_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    # Bug caught: following a manifest to paths outside the folder or to other file kinds.
    path = save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    document = json.loads((path / "manifest.json").read_text())
    for name in ["evil.pkl", "../outside.json", ".hidden.json"]:
        document["files"][name] = {"size": 1, "xxh3_128": "0"}
    del document["manifest_xxh3_128"], document["format"], document["version"]
    del document["checksum"], document["metrics"]
    document = manifest_document(**document, metrics={})
    (path / "manifest.json").write_text(json.dumps(document))
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=TrainState(model=nn.Linear(1, 1)))
    for name in ["evil.pkl", "../outside.json", ".hidden.json"]:
        assert (
            f"{path / 'manifest.json'}: lists {name!r}, not a .json/.safetensors name in the folder"
            in str(error.value)
        )


# ----------------------------------------------------------------------------------------
# Damage: detected from the manifest, reported by path.


def saved(tmp_path: Path) -> Path:
    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(2), epochs=1, plugins=plugins)
    return save_checkpoint(state, tmp_path / "step_000002")


def test_a_truncated_file_is_reported_by_path(tmp_path: Path) -> None:
    # Bug caught: loading a half-written file, or a load error that does not say which file.
    path = saved(tmp_path)
    target = path / "optimizer.safetensors"
    size = target.stat().st_size
    with open(target, "r+b") as file:
        file.truncate(size // 2)
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=build("adam_ema", seed=0)[0])
    assert error.value.problems == (
        f"{target}: {size // 2} bytes, the manifest says {size} (truncated)",
    )
    assert str(error.value) == (
        f"checkpoint {path} is damaged (1 problem(s)):\n  {target}: {size // 2} bytes, the "
        f"manifest says {size} (truncated)\nLoad an earlier checkpoint; resume='latest' skips "
        "damaged ones."
    )


@pytest.mark.parametrize(
    "name", ["model.safetensors", "extras.safetensors", "state.json", "rng.safetensors"]
)
def test_a_flipped_bit_is_reported_by_path(name: str, tmp_path: Path) -> None:
    # Bug caught: checksums not verified on load (a flipped bit in a tensor loads silently).
    path = saved(tmp_path)
    target = path / name
    data = bytearray(target.read_bytes())
    data[len(data) - 3] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=build("adam_ema", seed=0)[0])
    (problem,) = error.value.problems
    assert problem.startswith(f"{target}: xxh3_128 checksum ")
    assert problem.endswith(" (corrupted)")


def test_a_flipped_bit_in_the_manifest_and_a_missing_file_are_reported(tmp_path: Path) -> None:
    path = saved(tmp_path)
    text = (path / "manifest.json").read_text().replace('"step": 2', '"step": 3')
    (path / "manifest.json").write_text(text)
    with pytest.raises(DamagedCheckpointError) as error:
        load_checkpoint(path, like=build("adam_ema", seed=0)[0])
    assert error.value.problems == (
        f"{path / 'manifest.json'}: content does not match its own checksum (edited or corrupted)",
    )
    other = saved(tmp_path / "b")
    (other / "scheduler.json").unlink()
    assert verify_checkpoint(other) == [f"{other / 'scheduler.json'}: missing"]


# ----------------------------------------------------------------------------------------
# Atomic writes: a failing save leaves everything earlier intact.


@pytest.mark.parametrize("failing", ["write_tensors", "write_json"])
@pytest.mark.parametrize("target", ["new", "existing"])
def test_a_full_disk_during_a_save_leaves_earlier_checkpoints_intact(
    failing: str, target: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bugs caught: a half-written folder left under the final name or as a temporary; an
    # existing checkpoint removed before its replacement is complete; an error without
    # the path.
    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(2), epochs=1, plugins=plugins)
    root = tmp_path / "ckpt"
    first = save_checkpoint(state.replace(step=1), root / "step_000001")
    second = save_checkpoint(state.replace(step=2), root / "step_000002")
    real = getattr(save_module, failing)
    calls = []

    def full_disk(path: Path, *args: Any) -> None:
        calls.append(path)
        if len(calls) == 3:  # fail mid-save, after some files were written
            with open(path, "wb") as file:
                file.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, *args)

    monkeypatch.setattr(save_module, failing, full_disk)
    path = root / ("step_000003" if target == "new" else "step_000002")
    with pytest.raises(OSError) as error:
        save_checkpoint(state.replace(step=int(path.name[5:])), path)
    assert error.value.errno == errno.ENOSPC
    assert str(error.value) == (
        f"[Errno {errno.ENOSPC}] save_checkpoint: could not write the checkpoint {path} (No "
        "space left on device); earlier checkpoints are untouched and the temporary folder "
        "was removed. Free space or save elsewhere."
    )
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002"]
    assert verify_checkpoint(first) == [] and verify_checkpoint(second) == []
    assert load_checkpoint(second, like=build("adam_ema", seed=0)[0]).step == 2


def test_a_safetensors_io_error_becomes_an_oserror_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # safetensors reports disk errors as SafetensorError("... (os error 28) ..."): it is
    # turned into an OSError with that errno, so callers can catch disk failures as such.
    from safetensors import SafetensorError

    def failing(*args: Any, **kwargs: Any) -> None:
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr("toolkit.checkpoints._files.save_file", failing)
    with pytest.raises(OSError) as error:
        save_checkpoint(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    assert error.value.errno == 28
    assert f"could not write the checkpoint {tmp_path / 'c'} (Error while serializing" in str(
        error.value
    )
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------
# Export.


def test_export_writes_one_plain_file_of_model_or_ema_weights(tmp_path: Path) -> None:
    # Bugs caught: prefixed names, a tied name missing (strict load fails), the EMA export
    # holding the live weights, buffers missing from the EMA export.
    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(3), epochs=1, plugins=plugins)
    compiled = state.replace(model=torch.compile(state.model, backend="eager"))
    folder = save_checkpoint(compiled, tmp_path / "c")

    for source in (compiled, folder):
        live = load_file(export_model(source, tmp_path / "live.safetensors"))
        plain = Net()
        plain.load_state_dict(live, strict=True)
        assert torch.equal(plain.out.weight, state.model.out.weight)

        averaged = load_file(export_model(source, tmp_path / "ema.safetensors", weights="ema"))
        plain.load_state_dict(averaged, strict=True)
        reference = ema_model(state)
        assert torch.equal(plain.out.weight, reference.out.weight)
        assert not torch.equal(plain.out.weight, state.model.out.weight)
        assert torch.equal(plain.calls, state.model.calls)  # buffers the EMA does not hold

    half = load_file(export_model(state.model, tmp_path / "half.safetensors", dtype=torch.bfloat16))
    assert half["inp.weight"].dtype == torch.bfloat16 and half["calls"].dtype == torch.int64
    with safe_metadata(tmp_path / "half.safetensors") as metadata:
        assert metadata == {"format": "pt"}


def safe_metadata(path: Path) -> Any:
    from safetensors import safe_open

    class Opened:
        def __enter__(self) -> Any:
            self.file = safe_open(str(path), "pt")
            return self.file.metadata()

        def __exit__(self, *exc: Any) -> None:
            del self.file

    return Opened()


def test_export_writes_tied_weights_under_each_name(tmp_path: Path) -> None:
    model = Tied()
    tensors = load_file(export_model(model, tmp_path / "m.safetensors"))
    assert sorted(tensors) == ["body.bias", "body.weight", "embed.weight", "head.weight"]
    fresh = Tied()
    fresh.load_state_dict(tensors, strict=True)
    assert fresh.head.weight is fresh.embed.weight and torch.equal(
        fresh.embed.weight, model.embed.weight
    )


def test_export_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        export_model(nn.Linear(1, 1), tmp_path / "m.safetensors", weights="ema")
    assert str(error.value) == (
        "export_model: weights='ema' needs a TrainState or a checkpoint folder (the EMA lives "
        "in state.extras); got a bare module."
    )
    with pytest.raises(KeyError) as missing:
        export_model(TrainState(model=nn.Linear(1, 1)), tmp_path / "m.safetensors", weights="ema")
    assert missing.value.args[0] == (
        "export_model: the state has no EMA weights under extras['ema'] (extras keys: []); "
        "train with the ema(key='ema') plugin, or export weights='model'."
    )
    # An EMA of another model: its names are refused, not written as the model's weights.
    other = TrainState(
        model=nn.Linear(1, 1), extras={"ema": {"params": {"x.weight": torch.ones(1)}}}
    )
    with pytest.raises(
        ValueError, match=r"the EMA's names must be the model's; got \['x.weight'\]"
    ):
        export_model(other, tmp_path / "m.safetensors", weights="ema")
    assert not (tmp_path / "m.safetensors").exists()


# ----------------------------------------------------------------------------------------
# Writing in the background.


def test_a_background_save_names_its_own_keywords(tmp_path: Path) -> None:
    # Bug caught: **options passed on to a private function: a typo named _prepare, and
    # help() and type checkers saw no parameters.
    from toolkit.checkpoints import save_in_background

    assert list(inspect.signature(save_in_background).parameters)[2:] == [
        "objects",
        "metrics",
        "rules",
        "settings",
        "trainable_only",
    ]
    with pytest.raises(TypeError, match="save_in_background.* unexpected keyword .*trainable"):
        save_in_background(TrainState(model=nn.Linear(1, 1)), tmp_path / "c", trainable=True)
    assert not (tmp_path / "c").exists()


def test_a_background_save_holds_the_state_of_the_call(tmp_path: Path) -> None:
    # Bug caught: the writer thread reading live tensors (training changed them in place
    # meanwhile), or the RNG state of a later moment.
    from toolkit.checkpoints import save_in_background

    state, step, plugins = build("adam_ema", seed=0)
    state = run(step, state, batches(2), epochs=1, plugins=plugins)
    expected_weight = state.model.inp.weight.detach().clone()
    expected_moment = state.optimizer.state[state.model.inp.weight]["exp_avg"].clone()
    expected_ema = state.extras["ema"]["params"]["inp.weight"].clone()
    expected_rng = torch.get_rng_state()
    pending = save_in_background(state, tmp_path / "c", metrics={"loss": 1.0})
    with torch.no_grad():  # training goes on, in place
        state.model.inp.weight.add_(1.0)
        state.optimizer.state[state.model.inp.weight]["exp_avg"].add_(1.0)
        state.extras["ema"]["params"]["inp.weight"].add_(1.0)
    torch.rand(100)
    path = pending.result(timeout=60)
    assert path == tmp_path / "c" and read_manifest(path).metrics == {"loss": 1.0}
    loaded = load_checkpoint(path, like=build("adam_ema", seed=1)[0])
    assert torch.equal(loaded.model.inp.weight, expected_weight)
    assert torch.equal(loaded.optimizer.state[loaded.model.inp.weight]["exp_avg"], expected_moment)
    assert torch.equal(loaded.extras["ema"]["params"]["inp.weight"], expected_ema)
    assert torch.equal(torch.get_rng_state(), expected_rng)


def test_a_background_save_reports_its_failure_on_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toolkit.checkpoints import save_in_background

    def full_disk(path: Path, *args: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_module, "write_tensors", full_disk)
    pending = save_in_background(TrainState(model=nn.Linear(1, 1)), tmp_path / "c")
    with pytest.raises(OSError, match=f"could not write the checkpoint {tmp_path / 'c'}"):
        pending.result(timeout=60)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="the accumulation window is open"):
        model = nn.Linear(2, 1)
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        state, _ = accumulate(make_step(lambda m, b: m(b).mean()), micro_batches=2)(
            state, torch.ones(1, 2)
        )
        save_in_background(state, tmp_path / "d")


# ----------------------------------------------------------------------------------------
# Decision: a parameter the optimizer holds but the model does not
# (a learnable loss temperature) is refused, with the fix, not stored by position.


def test_an_optimizer_parameter_outside_the_model_is_refused_with_the_fix(tmp_path) -> None:
    model = nn.Linear(2, 1)
    temperature = nn.Parameter(torch.ones(()))
    optimizer = torch.optim.AdamW([*model.parameters(), temperature])
    state = TrainState(model=model, optimizer=optimizer)
    message = (
        r"optimizer.param_groups\[0\]\['params'\]\[2\] \(shape \[\]\) is not a parameter of "
        r"the model, so the checkpoint cannot name it; register it on the model"
    )
    with pytest.raises(ValueError, match=message):
        save_checkpoint(state, tmp_path / "step_000000")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    # Registered on the model, it is saved and restored like any parameter.
    model.temperature = temperature
    save_checkpoint(state, tmp_path / "step_000000")
    with torch.no_grad():
        temperature.fill_(3.0)
    fresh = nn.Linear(2, 1)
    fresh.temperature = nn.Parameter(torch.zeros(()))
    like = TrainState(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert load_checkpoint(tmp_path / "step_000000", like=like).model.temperature.item() == 1.0
