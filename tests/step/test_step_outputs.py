"""What a train step hands back and refuses: detached records, a "loss" record, amp_wrap's
positional dtype, a scheduler stepped twice per update."""

from __future__ import annotations

import warnings

import pytest
import torch

from toolkit import LossSum, TrainState, amp_wrap, make_step


def _state(scheduler: bool = False) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if scheduler else None
    return TrainState(model=model, optimizer=optimizer, scheduler=sched)


def test_records_come_back_detached() -> None:
    def loss_fn(model: torch.nn.Module, batch: torch.Tensor):
        out = model(batch)
        return out.mean(), {"max": out.max(), "nested": {"min": out.min()}, "n": 3}

    state, out = make_step(loss_fn)(_state(), torch.randn(4, 3))
    for record in (out.records["max"], out.records["nested"]["min"]):
        assert not record.requires_grad and record.grad_fn is None
    assert out.records["n"] == 3
    counted = make_step(lambda m, b: LossSum(m(b).sum(), 4, {"sum": m(b).sum()}))
    _, out = counted(state, torch.randn(4, 3))
    assert out.records["sum"].grad_fn is None


@pytest.mark.parametrize("kind", ["dict", "model output"])
def test_a_loss_record_is_refused_at_the_first_step(kind: str) -> None:
    if kind == "model output":
        outputs = pytest.importorskip("transformers.modeling_outputs", reason="the hf extra")

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor):
        logits = model(batch)
        if kind == "dict":
            return logits.mean(), {"loss": logits.mean()}
        out = outputs.CausalLMOutput(loss=logits.square().mean(), logits=logits)
        return out.loss, out  # what a Hugging Face user writes

    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(ValueError, match=r"without a 'loss' key.*return out\.loss alone"):
        make_step(loss_fn)(state, torch.randn(4, 3))
    assert all(torch.equal(a, p) for a, p in zip(before, state.model.parameters()))


def test_amp_wrap_takes_the_dtype_positionally() -> None:
    step = amp_wrap("bf16")(make_step(lambda m, b: m(b).float().mean()))
    assert step.amp.dtype == torch.bfloat16
    assert amp_wrap(torch.float16)(make_step(lambda m, b: m(b).mean())).amp.dtype == torch.float16
    state, out = step(_state(), torch.randn(4, 3))
    assert out.updated and state.step == 1
    with pytest.raises(TypeError, match="expected a Step"):
        amp_wrap("bf16", dtype="fp16")


def test_a_scheduler_stepped_outside_the_step_warns() -> None:
    step = make_step(lambda m, b: m(b).mean())
    state = _state(scheduler=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step's own scheduler steps: no warning
        for _ in range(3):
            state, _ = step(state, torch.randn(4, 3))
        other = torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=1)
        other.step()  # a new scheduler, already stepped: no history with this one
        state, _ = step(state.replace(scheduler=other), torch.randn(4, 3))
    other.step()  # the user's own sched.step() next to the step's
    with pytest.warns(
        UserWarning, match=r"stepped outside the train step.*Remove your scheduler"
    ) as caught:
        state, _ = step(state, torch.randn(4, 3))
    assert caught[0].filename == __file__  # the user's call of the step, not toolkit's line
