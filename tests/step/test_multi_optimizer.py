"""Several optimizers from one backward, several schedulers, per-epoch schedulers, a GAN.

Each behaviour is checked bitwise against a hand-written PyTorch loop that does the same
arithmetic with the real optimizers.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from toolkit import (
    MultiOptimizer,
    MultiScheduler,
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    evaluate,
    guard_nonfinite,
    load_checkpoint,
    make_step,
    per_epoch,
    run,
    save_checkpoint,
)

LR = torch.optim.lr_scheduler


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """The matrices (for SGD, as Muon would take them) and the rest (for AdamW)."""
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


def _optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    matrices, rest = _split(model)
    return (
        torch.optim.SGD(matrices, lr=0.05, momentum=0.9),
        torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1),
    )


def _schedulers(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> list[LR.LRScheduler]:
    return [LR.StepLR(a, step_size=2, gamma=0.5), LR.LinearLR(b, start_factor=0.3, total_iters=5)]


def _batches(n: int, nan_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]
    if nan_at is not None:
        out[nan_at][0][0, 0] = float("nan")
    return out


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _hand(
    model: torch.nn.Module,
    optimizers: tuple[torch.optim.Optimizer, ...],
    schedulers: list[LR.LRScheduler],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    k: int,
    max_norm: float,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[int, int]:
    """One backward per micro-batch; per window: unscale both, one norm over all, skip both."""
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    fp16 = scaler is not None
    autocast = torch.autocast("cpu", dtype=torch.float16) if fp16 else contextlib.nullcontext()
    applied = skipped = 0
    for start in range(0, len(batches), k):
        window_loss = torch.zeros(())
        for batch in batches[start : start + k]:
            with autocast:
                loss = _loss(model, batch)
            window_loss += loss.detach()
            objective = loss / k
            (scaler.scale(objective) if scaler is not None else objective).backward()
        if scaler is not None:
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        # Under fp16 an inf gradient anywhere is an overflow, which skips every optimizer.
        finite = bool(torch.isfinite(window_loss)) and bool(torch.isfinite(norm))
        if finite:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            for optimizer in optimizers:
                optimizer.step()
        if scaler is not None:
            scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        if finite:
            for scheduler in schedulers:
                scheduler.step()
        applied += finite
        skipped += not finite
    return applied, skipped


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


def test_two_optimizers_with_clip_guard_and_two_schedulers_match_a_hand_loop() -> None:
    batches = _batches(16, nan_at=5)  # window 2 of accumulate(2) is NaN: both skip it
    ref = _model()
    ref_opts = _optimizers(ref)
    ref_scheds = _schedulers(*ref_opts)
    applied, skipped = _hand(ref, ref_opts, ref_scheds, batches, k=2, max_norm=0.05)
    assert (applied, skipped) == (7, 1)

    model = _model()
    a, b = _optimizers(model)
    state = TrainState(model=model, optimizer=[a, b], scheduler=_schedulers(a, b))
    assert isinstance(state.optimizer, MultiOptimizer)
    assert isinstance(state.scheduler, MultiScheduler)
    step = guard_nonfinite(
        clip(accumulate(make_step(_loss), micro_batches=2), max_norm=0.05), max_retries=1
    )
    outs = []
    for batch in batches:
        state, out = step(state, batch)
        outs.append(out)
    assert state.step == 7 and state.guard.total_notfinite == 1
    assert [o.nonfinite for o in outs if o.closed] == [False, False, True] + [False] * 5
    _assert_same(model, ref)
    assert state.scheduler.get_last_lr() == [s.get_last_lr()[0] for s in ref_scheds]
    assert [g["lr"] for g in state.optimizer.param_groups] == [
        g["lr"] for o in ref_opts for g in o.param_groups
    ]
    assert torch.equal(
        a.state[a.param_groups[0]["params"][0]]["momentum_buffer"],
        ref_opts[0].state[ref_opts[0].param_groups[0]["params"][0]]["momentum_buffer"],
    )


def test_fp16_one_scaler_unscales_both_and_an_overflow_skips_both() -> None:
    batches = _batches(12)
    # A scale of 2**20 overflows fp16 gradients: the first windows are skipped by both.
    ref = _model()
    ref_opts = _optimizers(ref)
    ref_scheds = _schedulers(*ref_opts)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    applied, skipped = _hand(
        ref, ref_opts, ref_scheds, batches, k=1, max_norm=1.0, scaler=ref_scaler
    )
    assert skipped >= 2 and applied >= 4

    model = _model()
    a, b = _optimizers(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    state = TrainState(model=model, optimizer=[a, b], scheduler=_schedulers(a, b))
    step = amp_wrap(clip(make_step(_loss), max_norm=1.0), dtype="fp16", scaler=scaler)
    overflows = 0
    for batch in batches:
        state, out = step(state, batch)
        overflows += out.overflow
    assert (state.step, overflows) == (applied, skipped)
    assert scaler.get_scale() == ref_scaler.get_scale()
    _assert_same(model, ref)
    assert state.scheduler.get_last_lr() == [s.get_last_lr()[0] for s in ref_scheds]


def _two_optimizer_state() -> TrainState:
    model = _model()
    a, b = _optimizers(model)
    return TrainState(model=model, optimizer=[a, b], scheduler=_schedulers(a, b))


def test_a_resumed_two_optimizer_run_is_bitwise_an_uninterrupted_one(tmp_path: Path) -> None:
    data = _batches(10)
    step = clip(accumulate(make_step(_loss), micro_batches=2), max_norm=0.5)
    whole = run(step, _two_optimizer_state(), data, max_steps=5)

    first = run(step, _two_optimizer_state(), data, max_steps=2)
    path = save_checkpoint(first, tmp_path / "ckpt")
    # A template with fresh optimizers whose state would differ if it were not restored.
    resumed = load_checkpoint(path, _two_optimizer_state())
    assert resumed.step == 2 and resumed.batches_seen == 4
    resumed = run(step, resumed, data, max_steps=5)

    _assert_same(resumed.model, whole.model)
    for got, want in zip(resumed.optimizer.optimizers, whole.optimizer.optimizers, strict=True):
        assert got.state_dict()["param_groups"] == want.state_dict()["param_groups"]
        for x, y in zip(got.state.values(), want.state.values(), strict=True):
            for key in x:
                assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), key
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()


def test_multi_optimizer_state_dict_round_trips_and_refuses_another_layout() -> None:
    state = _two_optimizer_state()
    step = make_step(_loss)
    state, _ = step(state, _batches(1)[0])
    saved = state.optimizer.state_dict()
    # Numbered across both: SGD holds parameters 0 and 1, AdamW 2 and 3.
    assert [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]]
    assert sorted(saved["state"]) == [0, 1, 2, 3]
    fresh = _two_optimizer_state().optimizer
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["param_groups"] == saved["param_groups"]
    assert torch.equal(fresh.state_dict()["state"][3]["exp_avg"], saved["state"][3]["exp_avg"])
    swapped = MultiOptimizer(*reversed(_two_optimizer_state().optimizer.optimizers))
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(AdamW\) has options \['dampening'"):
        swapped.load_state_dict(saved)
    single = _model()
    with pytest.raises(ValueError, match=r"state dict has 1 parameter group\(s\); these .* 2"):
        fresh.load_state_dict(torch.optim.SGD(single.parameters(), lr=0.1).state_dict())


def _per_epoch_hand(epochs: int, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = LR.StepLR(optimizer, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(epochs):
        for batch in data:
            _loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs + [p.detach().clone() for p in model.parameters()]  # type: ignore[list-item]


def test_a_per_epoch_scheduler_steps_after_each_epoch_like_a_hand_loop() -> None:
    data = _batches(3)
    want = _per_epoch_hand(3, data)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(
        model=model,
        optimizer=optimizer,
        scheduler=per_epoch(LR.StepLR(optimizer, step_size=1, gamma=0.5)),
    )
    seen = []

    def spy(event):  # type: ignore[no-untyped-def]
        if event.kind == "epoch_end":
            seen.append(optimizer.param_groups[0]["lr"])

    state = run(make_step(_loss), state, data, epochs=3, plugins=[spy])
    assert state.step == 9
    assert seen == want[:3] == [0.05, 0.025, 0.0125]
    for p, q in zip(model.parameters(), want[3:], strict=True):
        assert torch.equal(p, q)


def test_a_per_epoch_and_a_per_update_scheduler_together() -> None:
    model = _model()
    a, b = _optimizers(model)
    state = TrainState(
        model=model,
        optimizer=[a, b],
        scheduler=[LR.StepLR(a, step_size=1, gamma=0.5), per_epoch(LR.StepLR(b, 1, gamma=0.1))],
    )
    state = run(make_step(_loss), state, _batches(2), epochs=2)
    assert state.step == 4
    assert a.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**4)  # per update
    assert b.param_groups[0]["lr"] == pytest.approx(0.01 * 0.1**2)  # per epoch


@contextlib.contextmanager
def _frozen(module: torch.nn.Module) -> Iterator[None]:
    # The generator's loss backpropagates through the discriminator without filling its
    # gradients, which its own next update would otherwise add.
    module.requires_grad_(False)
    try:
        yield
    finally:
        module.requires_grad_(True)


def _gan(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 4), torch.nn.Sequential(torch.nn.Linear(4, 1))


def test_alternating_optimizers_a_gan_with_two_states_matches_a_hand_loop() -> None:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(5)]
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def d_loss(disc, gen, real, z):  # type: ignore[no-untyped-def]
        fake = gen(z).detach()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(z), 1)
        return bce(disc(real), ones) + bce(disc(fake), zeros)

    def g_loss(gen, disc, z):  # type: ignore[no-untyped-def]
        return bce(disc(gen(z)), torch.ones(len(z), 1))

    # By hand: the textbook alternation, zeroing each optimizer before its backward.
    ref_g, ref_d = _gan(0)
    opt_g, opt_d = (
        torch.optim.Adam(ref_g.parameters(), 1e-2),
        torch.optim.SGD(ref_d.parameters(), 0.1),
    )
    for real, z in data:
        opt_d.zero_grad()
        d_loss(ref_d, ref_g, real, z).backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss(ref_g, ref_d, z).backward()
        opt_g.step()

    gen, disc = _gan(0)
    g_state = TrainState(model=gen, optimizer=torch.optim.Adam(gen.parameters(), 1e-2))
    d_state = TrainState(model=disc, optimizer=torch.optim.SGD(disc.parameters(), 0.1))

    def g_step_loss(model, batch):  # type: ignore[no-untyped-def]
        with _frozen(disc):
            return g_loss(model, disc, batch[1])

    d_step = make_step(lambda model, batch: d_loss(model, gen, *batch))
    g_step = make_step(g_step_loss)
    for batch in data:
        d_state, _ = d_step(d_state, batch)
        g_state, _ = g_step(g_state, batch)
    assert (d_state.step, g_state.step) == (5, 5)
    _assert_same(gen, ref_g)
    _assert_same(disc, ref_d)


# --- bad input -------------------------------------------------------------------------------


def test_bad_optimizer_lists_are_refused_with_the_fix() -> None:
    model = _model()
    a, b = _optimizers(model)
    with pytest.raises(
        TypeError,
        match=r"TrainState.optimizer: MultiOptimizer: optimizers\[1\] must be a "
        r"torch.optim.Optimizer; got a str. Build one over the parameters: torch.optim.AdamW",
    ):
        TrainState(model=model, optimizer=[a, "adamw"])
    with pytest.raises(TypeError, match="expected one or more torch.optim.Optimizer; got none"):
        TrainState(model=model, optimizer=[])
    both = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=re.escape("held by optimizers[0] (SGD) and optimizers[1] (SGD)")
    ):
        TrainState(model=model, optimizer=[a, both])
    with pytest.raises(
        ValueError, match=re.escape("held by optimizers[0] (SGD) and optimizers[1]")
    ):
        MultiOptimizer(a, a)  # the same optimizer twice
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"TrainState.optimizer\[1\]: none of its 2 parameters"):
        TrainState(model=model, optimizer=[a, other])
    state = TrainState(model=model, optimizer=[a, b])
    with pytest.raises(TypeError, match="a closure would be evaluated once per optimizer"):
        state.optimizer.step(lambda: 0.0)


def test_bad_scheduler_lists_and_per_epoch_misuse_are_refused() -> None:
    model = _model()
    a, b = _optimizers(model)
    stranger = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"TrainState.scheduler\[1\]: .* steps another one"):
        TrainState(
            model=model, optimizer=[a, b], scheduler=[LR.StepLR(a, 1), LR.StepLR(stranger, 1)]
        )
    with pytest.raises(TypeError, match=r"schedulers\[0\]: got a ReduceLROnPlateau"):
        TrainState(model=model, optimizer=[a, b], scheduler=[LR.ReduceLROnPlateau(a)])
    with pytest.raises(
        TypeError, match=r"per_epoch: scheduler: got a ReduceLROnPlateau.*plateau_metric="
    ):
        per_epoch(LR.ReduceLROnPlateau(a))
    with pytest.raises(TypeError, match="per_epoch: scheduler: expected an LR scheduler"):
        per_epoch("cosine")
    # One scheduler over one of several optimizers is fine.
    TrainState(model=model, optimizer=[a, b], scheduler=LR.StepLR(b, 1))


def test_evaluate_reports_errors_under_its_own_name() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"^evaluate: eval_fn returned list: not a mapping"):
        evaluate(lambda m, b: [1.0], model, [torch.ones(1, 2)])
    with pytest.raises(ValueError, match=r"^evaluate: the data yielded no batches"):
        evaluate(lambda m, b: {"x": 1.0}, model, [])
