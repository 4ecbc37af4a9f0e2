"""save_checkpoint(trainable_only=True): the trainable part and buffers, a fingerprint of the
frozen parameters checked on load, and a resume bitwise like an uninterrupted run."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import toolkit.checkpoints._model_state as model_state_module
from toolkit import TrainState, export_model, load_checkpoint, make_step, save_checkpoint
from toolkit.checkpoints import list_checkpoints, save_in_background, verify_checkpoint
from toolkit.checkpoints._manifest import read_manifest

transformers = pytest.importorskip("transformers", reason="needs the `hf` extra")
peft = pytest.importorskip("peft", reason="needs the `hf` extra")


def lora_gpt2(base_seed: int, adapter_seed: int) -> nn.Module:
    """A 2-layer GPT-2 from its config (weights from ``base_seed``, dropout on) with a LoRA
    on its attention (initialised from ``adapter_seed``): only the adapter trains."""
    torch.manual_seed(base_seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    base = transformers.GPT2LMHeadModel(config)
    torch.manual_seed(adapter_seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
    return peft.get_peft_model(base, lora)


def frozen_first_layer(base_seed: int, head_seed: int) -> nn.Module:
    """A frozen base, then a BatchNorm (training: its running stats change) and a head."""
    torch.manual_seed(base_seed)
    frozen = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 8)).requires_grad_(False)
    torch.manual_seed(head_seed)
    return nn.Sequential(frozen, nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


KINDS: dict[str, tuple[Callable[[int, int], nn.Module], Any, Callable[[int], list[Any]]]] = {
    "lora_gpt2": (
        lora_gpt2,
        lm_loss,
        lambda seed: list(
            torch.randint(0, 32, (4, 3, 8), generator=torch.Generator().manual_seed(seed))
        ),
    ),
    "frozen_layer": (
        frozen_first_layer,
        mse,
        lambda seed: [
            (torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g))
            for g in [torch.Generator().manual_seed(seed)]
            for _ in range(4)
        ],
    ),
}


def build(kind: str, base_seed: int = 0, adapter_seed: int = 1) -> TrainState:
    model = KINDS[kind][0](base_seed, adapter_seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return TrainState(model=model, optimizer=torch.optim.AdamW(trainable, lr=1e-2))


def train(kind: str, state: TrainState, batches: list[Any]) -> TrainState:
    step = make_step(KINDS[kind][1])
    for batch in batches:
        state, _ = step(state, batch)
    return state


def snapshot(state: TrainState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return copy.deepcopy(state.model.state_dict()), copy.deepcopy(state.optimizer.state_dict())


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_files_hold_the_trainable_parameters_and_buffers_only(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = train(kind, build(kind), KINDS[kind][2](0)[:2])
    part = save_checkpoint(state, tmp_path / "part", trainable_only=True)
    whole = save_checkpoint(state, tmp_path / "whole")
    trainable = {n for n, p in state.model.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in state.model.named_buffers()}  # BatchNorm's running stats
    assert set(load_file(part / "model.safetensors")) == trainable | buffers
    small, large = ((p / "model.safetensors").stat().st_size for p in (part, whole))
    assert small * 5 < large
    assert read_manifest(part).frozen.startswith(
        f"{len(state.model.state_dict()) - len(trainable | buffers)} tensors"
    )
    assert read_manifest(whole).frozen is None and verify_checkpoint(part) == []
    listed = {c.name: c.trainable_only for c in list_checkpoints(tmp_path)}
    assert listed == {"part": True, "whole": False}
    from toolkit.checkpoints import main  # python -m toolkit.checkpoints lists it

    main([str(tmp_path)])
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "trainable only" in rows["part"] and "trainable only" not in rows["whole"]
    background = save_in_background(state, tmp_path / "background", trainable_only=True).result()
    assert set(load_file(background / "model.safetensors")) == trainable | buffers


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resume_from_the_trainable_part_is_bitwise_an_uninterrupted_run(
    kind: str, tmp_path: Path
) -> None:
    # Bugs caught: the frozen part not left as the template has it, the trainable part or the
    # optimizer not restored, BatchNorm's running stats (buffers) not saved, a strict load
    # refusing the missing frozen names.
    batches = KINDS[kind][2](0)
    straight = train(kind, build(kind), batches)
    first = train(kind, build(kind), batches[:2])
    path = save_checkpoint(first, tmp_path / "step_2", trainable_only=True)
    fresh = build(kind, base_seed=0, adapter_seed=7)  # the same base, another adapter init
    resumed = train(kind, load_checkpoint(path, like=fresh), batches[2:])
    assert resumed.step == straight.step == 4
    assert_same(snapshot(resumed), snapshot(straight))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_template_on_another_base_is_refused_and_left_unchanged(
    kind: str, tmp_path: Path
) -> None:
    state = train(kind, build(kind), KINDS[kind][2](0)[:2])
    path = save_checkpoint(state, tmp_path / "ckpt", trainable_only=True)
    other = train(kind, build(kind, base_seed=3, adapter_seed=4), KINDS[kind][2](1)[:1])
    before = snapshot(other)
    with pytest.raises(
        ValueError, match=r"its frozen parameters \(\d+ tensors, xxh3_128 \w+\) are not those"
    ) as error:
        load_checkpoint(path, like=other)
    assert "the same base model" in str(error.value)
    assert_same(snapshot(other), before)
    # Another set of parameters frozen: the names differ, and so does the fingerprint.
    thawed = build(kind)
    thawed.model.requires_grad_(True)
    before = snapshot(thawed)
    with pytest.raises(ValueError, match="model: in the template, not the checkpoint") as error:
        load_checkpoint(path, like=thawed)
    assert "its frozen parameters (0 tensors" in str(error.value)
    assert_same(snapshot(thawed), before)


def test_export_refuses_a_checkpoint_without_its_base(tmp_path: Path) -> None:
    state = build("frozen_layer")
    path = save_checkpoint(state, tmp_path / "ckpt", trainable_only=True)
    with pytest.raises(ValueError, match=r"trainable parameters only .* export_model\(state\)"):
        export_model(path, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_checkpoint(path, like=build("frozen_layer"))
    exported = load_file(export_model(loaded, tmp_path / "model.safetensors"))
    assert_same(exported, dict(state.model.state_dict()))


def test_a_sharded_model_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_state_module, "is_sharded", lambda model: True)
    with pytest.raises(
        ValueError, match="save_checkpoint: trainable_only must be False for an FSDP2 model"
    ):
        save_checkpoint(build("frozen_layer"), tmp_path / "ckpt", trainable_only=True)
    assert not (tmp_path / "ckpt").exists()


def test_the_checkpoints_plugin_saves_the_trainable_part_and_resumes_from_it(
    tmp_path: Path,
) -> None:
    # Bugs caught: the plugin's option not passed to the save (whole files), a resume or
    # restore_best that loads such a checkpoint strictly (the frozen names are missing).
    from toolkit import run
    from toolkit.plugins import Retention, checkpoints

    kind, batches = "frozen_layer", KINDS["frozen_layer"][2](0)
    step = make_step(KINDS[kind][1])
    straight = run(step, build(kind), batches, max_steps=4)

    def plugin() -> Any:
        return checkpoints(tmp_path, every=1, keep=Retention(keep_last=4), trainable_only=True)

    run(step, build(kind), batches, max_steps=2, plugins=[plugin()])
    (last,) = [c for c in list_checkpoints(tmp_path) if c.step == 2]
    assert last.trainable_only
    trainable = {n for n, p in straight.model.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in straight.model.named_buffers()}
    assert set(load_file(last.path / "model.safetensors")) == trainable | buffers
    resumed = run(step, build(kind, adapter_seed=7), batches, max_steps=4, plugins=[plugin()])
    assert_same(snapshot(resumed), snapshot(straight))

    def score(event: Any) -> TrainState | None:  # a metric for keep_best: the lowest at step 2
        if event.kind != "step":
            return None
        entry = {"step": event.state.step, "values": {"loss": abs(event.state.step - 2)}}
        return event.state.replace(metrics={**event.state.metrics, "val": entry})

    keep = Retention(keep_best=1, metric="val/loss")
    best = checkpoints(
        tmp_path / "best", every=1, keep=keep, restore_best=True, trainable_only=True
    )
    restored = run(step, build(kind), batches, max_steps=4, plugins=[score, best])
    at_two = load_checkpoint(tmp_path / "step_000002", like=build(kind))
    assert_same(restored.model.state_dict(), at_two.model.state_dict())
