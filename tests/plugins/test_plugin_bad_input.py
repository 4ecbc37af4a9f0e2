"""Plugins refuse misuse: key clashes, validation weights, ReduceLROnPlateau.

Each misuse is refused with an error naming the argument, what was expected, what was given
and the fix, before training where it can be known then.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from spawning import gloo_group, spawn

from toolkit import TrainState, make_step, run
from toolkit.plugins import early_stop, ema, peak_memory, validate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _state(lr: float = 0.1) -> TrainState:
    model = _model()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def _loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return (m(b) - 1.0).square().mean()


_STEP = make_step(_loss)
VAL = [torch.ones(4, 2)]


def _train(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 2, generator=g) for _ in range(n)]


def _eval(m: torch.nn.Module, b: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": _loss(m, b)}


# --- item 7: two plugins writing one state.extras key ----------------------------------------


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        (
            lambda: [ema(0.9), ema(0.99)],
            "ema: key 'ema' is already kept by ema in this run; two plugins writing "
            "one key would overwrite each other's memory. Give each its own key, e.g. "
            "ema(..., key='ema_2')",
        ),
        (
            lambda: [ema(0.9), validate(_eval, VAL, every=1, key="ema")],
            "validate: key 'ema' is already kept by ema in this run",
        ),
        (
            lambda: [validate(_eval, VAL, every=1), validate(_eval, VAL, per_epoch=True)],
            "validate: key 'val' is already kept by validate in this run",
        ),
        (
            lambda: [peak_memory(), validate(_eval, VAL, every=1, key="memory")],
            "validate: key 'memory' is already kept by peak_memory in this run",
        ),
        (
            lambda: [validate(_eval, VAL, every=1), early_stop(), early_stop("val/loss")],
            "early_stop: key 'early_stop' is already kept by early_stop in this run",
        ),
        (
            lambda: [ema(0.9), peak_memory(key="ema")],
            "peak_memory: key 'ema' is already kept by ema in this run",
        ),
    ],
)
def test_two_plugins_keeping_one_extras_key_are_refused_before_training(plugins, message) -> None:
    state = _state()
    before = [p.detach().clone() for p in state.model.parameters()]
    with pytest.raises(ValueError, match=re.escape(message)):
        run(_STEP, state, _train(4), max_steps=4, plugins=plugins())
    after = list(state.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # not one update


def test_one_plugin_listed_twice_is_a_clash_too() -> None:
    plugin = ema(0.9)
    with pytest.raises(ValueError, match=r"ema: key 'ema' is already kept by ema"):
        run(_STEP, _state(), _train(2), max_steps=2, plugins=[plugin, plugin])


def test_a_users_plugin_declaring_a_key_is_refused_next_to_another_before_any_start() -> None:
    seen: list[str] = []

    def mine(event) -> None:  # publishes state.metrics["val"]: says so with its key
        seen.append(event.kind)

    mine.key = "val"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"^mine: key 'val' is already kept by validate in this"):
        run(_STEP, _state(), _train(2), max_steps=2, plugins=[mine, validate(_eval, VAL, every=1)])
    assert seen == ["restore", "end"]  # refused after the restore, before any "start"


def test_published_metrics_must_be_metrics_records() -> None:
    said = r"TrainState: metrics\['val'\] must be a Metrics, .*; got \{'step': 1, 'metrics'"
    with pytest.raises(TypeError, match=said):
        _state().replace(metrics={"val": {"step": 1, "metrics": {"loss": 0.5}}})  # the old shape


def test_own_keys_keep_two_emas_apart() -> None:
    state = run(
        _STEP,
        _state(),
        _train(4),
        max_steps=4,
        plugins=[ema(0.5, warmup=False), ema(0.9, warmup=False, key="slow")],
    )
    fast, slow = state.extras["ema"], state.extras["slow"]
    assert fast["num_updates"] == slow["num_updates"] == 4
    assert not torch.equal(fast["params"]["0.weight"], slow["params"]["0.weight"])


def test_a_key_already_in_the_state_is_a_resume_not_a_clash() -> None:
    plugins = [ema(0.9), validate(_eval, VAL, every=2), early_stop(patience=50), peak_memory(2)]
    state = run(_STEP, _state(), _train(8), max_steps=4, plugins=plugins)
    assert {"ema", "val", "early_stop"} <= state.extras.keys()
    assert {"val", "memory"} <= state.metrics.keys()
    # A second run() with the same plugin objects on the state that holds their entries.
    state = run(_STEP, state, _train(8), max_steps=8, plugins=plugins)
    assert state.extras["ema"]["num_updates"] == 8 and state.metrics["val"]["step"] == 8
    # And fresh plugins on it, as after a resume from a checkpoint.
    fresh = [ema(0.9), validate(_eval, VAL, every=2), early_stop(patience=50), peak_memory(2)]
    state = run(_STEP, state, _train(12), max_steps=10, plugins=fresh)
    assert state.extras["ema"]["num_updates"] == 10 and state.metrics["val"]["step"] == 10


# --- item 7: validation weights --------------------------------------------------------------


def _counted(count):
    return lambda m, b: ({"loss": _loss(m, b)}, count)


@pytest.mark.parametrize(
    ("count", "error", "message"),
    [
        (-1, ValueError, "validate: the count eval_fn returned for batch 0 of the validation "
         "data is -1; expected a finite number >= 0."),
        (math.nan, ValueError, "returned for batch 0 of the validation data is nan; expected"),
        (math.inf, ValueError, "returned for batch 0 of the validation data is inf; expected"),
        (torch.tensor(-2.0), ValueError, "for batch 0 of the validation data is -2.0; expected"),
        (torch.tensor([math.inf]), ValueError, "of the validation data is inf; expected a finite"),
        ("4", TypeError, "validate: the count eval_fn returned for batch 0 is a str ('4'); "
         "expected a number >= 0 or a one-element real tensor, e.g. (metrics, mask.sum())"),
        (True, TypeError, "for batch 0 is a bool (True); expected a number >= 0"),
        (torch.ones(2), TypeError, "for batch 0 is a torch.float32 tensor of shape (2,); "
         "expected a number >= 0 or a one-element real tensor, e.g. (metrics, mask.sum())"),
        (torch.tensor(True), TypeError, "for batch 0 is a torch.bool tensor of shape ()"),
        (torch.tensor(1j), TypeError, "for batch 0 is a torch.complex64 tensor of shape ()"),
    ],
)  # fmt: skip
def test_bad_validation_weights_are_refused(count, error: type, message: str) -> None:
    plugin = validate(_counted(count), VAL, every=1)
    with pytest.raises(error, match=re.escape(message)):
        run(_STEP, _state(), _train(2), max_steps=2, plugins=[plugin])


def test_the_bad_batch_is_named_by_its_position() -> None:
    counts = iter([3, torch.tensor(2), torch.tensor(-1.0)])
    plugin = validate(lambda m, b: ({"loss": _loss(m, b)}, next(counts)), VAL * 3, every=1)
    with pytest.raises(ValueError, match=r"for batch 2 of the validation data is -1.0"):
        run(_STEP, _state(), _train(1), max_steps=1, plugins=[plugin])


def test_a_python_count_is_refused_when_returned_before_the_next_batch() -> None:
    calls = []

    def eval_fn(m, b):
        calls.append(1)
        return {"loss": 1.0}, -3 if len(calls) == 1 else 1

    with pytest.raises(ValueError, match=r"for batch 0 of the validation data is -3"):
        run(_STEP, _state(), _train(1), max_steps=1, plugins=[validate(eval_fn, VAL * 3, every=1)])
    assert len(calls) == 1


def test_a_pass_of_weight_zero_warns_and_gives_nan_that_never_becomes_best() -> None:
    zero = validate(_counted(0), VAL * 2, every=2)
    with pytest.warns(RuntimeWarning, match=r"pass at step 2 had weight 0 .*every metric is NaN"):
        state = run(_STEP, _state(), _train(2), max_steps=2, plugins=[zero])
    assert math.isnan(state.metrics["val"]["values"]["loss"])
    assert state.extras["val"]["best"] is None


def test_a_batch_of_weight_zero_among_others_is_silent_and_counts_for_nothing() -> None:
    counts = iter([0, 4])
    plugin = validate(
        lambda m, b: ({"loss": b.sum()}, next(counts)),
        [torch.ones(4, 2), torch.zeros(4, 2)],
        every=1,
    )
    state = run(_STEP, _state(), _train(1), max_steps=1, plugins=[plugin])  # no warning
    assert state.metrics["val"]["values"]["loss"] == 0.0


# --- item 4: ReduceLROnPlateau stepped with a validation metric ------------------------------


def _plateau(optimizer: torch.optim.Optimizer, mode: str = "min"):
    # A large threshold makes most evaluations "bad": several reductions in a short run.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode=mode, factor=0.5, patience=0, threshold=0.3
    )


def test_plateau_metric_steps_the_scheduler_as_a_hand_written_loop_does() -> None:
    train, every, updates = _train(24), 3, 24
    # The hand-written loop.
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = _plateau(optimizer)
    expected = []
    for i, batch in enumerate(train):
        _loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (i + 1) % every == 0:
            model.eval()
            with torch.no_grad():
                val_loss = _loss(model, VAL[0])
            model.train()
            scheduler.step(val_loss)
            expected.append(optimizer.param_groups[0]["lr"])
    # The same with toolkit.
    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer))
    seen = []

    def record(event):
        if event.kind == "step" and event.state.step % every == 0:
            seen.append(event.state.optimizer.param_groups[0]["lr"])

    plugins = [validate(_eval, VAL, every=every, plateau_metric="loss"), record]
    state = run(_STEP, state, train, max_steps=updates, plugins=plugins)
    assert seen == expected and len(set(expected)) >= 3  # reduced at least twice
    assert state.scheduler.state_dict() == scheduler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), model.parameters()))


def test_plateau_metric_may_differ_from_monitor_and_follows_the_scheduler_mode() -> None:
    def eval_fn(m, b):
        return {"loss": 1.0, "acc": 0.5}  # acc never improves

    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer, mode="max"))
    plugin = validate(eval_fn, VAL, every=1, plateau_metric="acc")  # monitor "loss", min
    state = run(_STEP, state, _train(3), max_steps=3, plugins=[plugin])
    assert state.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**2


def test_a_plateau_scheduler_that_no_validate_steps_is_refused_before_start() -> None:
    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer))
    seen = []
    plugins = [validate(_eval, VAL, every=5), lambda e: seen.append((e.kind, e.state.step))]
    message = (
        "run: state.scheduler is a ReduceLROnPlateau, which the train step leaves alone "
        "(it needs a metric), and no plugin of this run steps it, so the learning rate "
        "would never be reduced. Pass the metric to step it with, e.g. "
        "validate(..., plateau_metric='loss')."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        run(_STEP, state, _train(10), max_steps=10, plugins=plugins)
    # run() raised after "restore", before any plugin's "start".
    assert seen == [("restore", 0), ("end", 0)]


@pytest.mark.parametrize("plugins", [[], [ema(0.9), peak_memory()]], ids=["none", "others"])
def test_a_plateau_scheduler_without_any_validate_is_refused(plugins) -> None:
    # Before: no validate, no check; the learning rate was silently never reduced.
    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer))
    with pytest.raises(ValueError, match=r"^run: state.scheduler is a ReduceLROnPlateau, .* no "):
        run(_STEP, state, _train(2), max_steps=2, plugins=plugins)
    assert state.optimizer.state == {}  # not one update


def test_the_check_does_not_mask_the_error_that_ended_training() -> None:
    # ema (run before validate) refuses an average of another model at "start": that error
    # is the one reported, not one of validate, whose "start" never ran, at "end".
    state = _state()
    extras = {"ema": {"step": 0, "num_updates": 0, "params": {"other": torch.ones(1)},
                      "buffers": {}}}  # fmt: skip
    state = state.replace(scheduler=_plateau(state.optimizer), extras=extras)
    with pytest.raises(ValueError, match=r"ema: state.extras\['ema'\]\['params'\] does not"):
        plugins = [validate(_eval, VAL, every=1, plateau_metric="loss"), ema()]
        run(_STEP, state, _train(2), max_steps=2, plugins=plugins)


def test_a_plugin_reused_for_a_second_run_checks_the_scheduler_again() -> None:
    plugin = validate(_eval, VAL, every=1)
    state = run(_STEP, _state(), _train(4), max_steps=2, plugins=[plugin])  # no scheduler
    state = state.replace(scheduler=_plateau(state.optimizer))
    with pytest.raises(ValueError, match=r"state.scheduler is a ReduceLROnPlateau, which"):
        run(_STEP, state, _train(4), max_steps=4, plugins=[plugin])


def test_a_validate_listed_before_the_one_that_steps_the_scheduler_is_fine() -> None:
    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer))
    plugins = [
        validate(_eval, VAL, every=1, key="other"),  # no plateau_metric, listed first
        validate(_eval, VAL, every=1, plateau_metric="loss"),
    ]
    state = run(_STEP, state, _train(4), max_steps=4, plugins=plugins)
    assert state.scheduler.last_epoch == 4  # stepped once per evaluation, by one validate


@pytest.mark.parametrize(
    ("scheduler", "plugins", "message"),
    [
        (
            None,
            lambda: [validate(_eval, VAL, every=1, plateau_metric="loss")],
            "validate: state.scheduler must be a ReduceLROnPlateau for plateau_metric='loss'; got "
            "'NoneType'. Put one in the state, or drop plateau_metric",
        ),
        (
            lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1),
            lambda: [validate(_eval, VAL, every=1, plateau_metric="loss")],
            "must be a ReduceLROnPlateau for plateau_metric='loss'; got 'StepLR'. Put one in the "
            "state, or drop plateau_metric (the train step steps other schedulers).",
        ),
        (
            lambda o: _plateau(o, mode="max"),
            lambda: [validate(_eval, VAL, every=1, plateau_metric="loss")],
            "validate: state.scheduler.mode must be 'min' like validate's; got 'max'. "
            "plateau_metric='loss' is also the monitored metric: give both one mode.",
        ),
        (
            _plateau,
            lambda: [
                validate(_eval, VAL, every=1, plateau_metric="loss"),
                validate(_eval, VAL, every=1, key="b", plateau_metric="loss"),
            ],
            "validate(key='b'): state.scheduler, a ReduceLROnPlateau, is already stepped by "
            "validate(key='val') in this run; a second one would step it twice per evaluation. "
            "Give plateau_metric to one validate.",
        ),
    ],
)
def test_plateau_misuse_is_refused_at_start(scheduler, plugins, message) -> None:
    state = _state()
    if scheduler is not None:
        state = state.replace(scheduler=scheduler(state.optimizer))
    seen = []
    with pytest.raises(ValueError, match=re.escape(message)):
        run(_STEP, state, _train(2), max_steps=2, plugins=[*plugins(), seen.append])
    assert [(e.kind, e.state.step) for e in seen] == [("restore", 0), ("end", 0)]  # at "start"


def test_a_plateau_metric_that_eval_fn_does_not_return_is_named() -> None:
    state = _state()
    state = state.replace(scheduler=_plateau(state.optimizer))
    plugin = validate(_eval, VAL, every=1, plateau_metric="nll")
    message = (
        "validate: plateau_metric must be a metric eval_fn returns, one of ['loss']; got 'nll'. "
        "Pass plateau_metric=<one of them>, or return 'nll'."
    )
    with pytest.raises(KeyError, match=re.escape(message)):
        run(_STEP, state, _train(2), max_steps=2, plugins=[plugin])


@pytest.mark.parametrize("value", ["", 3])
def test_a_bad_plateau_metric_is_refused_when_built(value) -> None:
    with pytest.raises(ValueError, match=r"validate: plateau_metric must be the name of a metric"):
        validate(_eval, VAL, every=1, plateau_metric=value)


# --- validate leaves an FSDP2 model as it found it --------------------------


def _fsdp_worker(rank: int, store: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, 2, store):
        mesh = init_device_mesh("cpu", (2,))
        model = _model()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root, holding model[2]'s parameters
        model[1].eval()  # a submodule kept in eval mode on purpose
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        data = [torch.randn(4, 2, generator=torch.Generator().manual_seed(rank))] * 2
        state = run(_STEP, state, data, max_steps=2, plugins=[validate(_eval, VAL, every=1)])
        # Sharded again: every parameter is a DTensor whose full value can be gathered (the
        # root's were left gathered as plain Parameters, without full_tensor()).
        full = [p.full_tensor() for p in model.parameters()]
        modes = [m.training for m in model.modules()]
        assert modes == [True, True, False, True], modes
        Path(out_dir, f"rank{rank}").write_text(
            f"{len(full)} {state.metrics['val']['step']} {state.metrics['val']['values']['loss']}"
        )


@pytest.mark.slow
def test_validate_leaves_an_fsdp2_model_sharded_and_in_its_modes(tmp_path: Path) -> None:
    def args(attempt: int) -> tuple[str, str]:
        out_dir = tmp_path / f"out{attempt}"
        out_dir.mkdir()
        return str(tmp_path / f"store{attempt}"), str(out_dir)

    spawn(_fsdp_worker, args, nprocs=2, timeout=120)
    out_dir = max(tmp_path.glob("out*"))  # the last attempt's
    results = [(out_dir / f"rank{r}").read_text().split() for r in range(2)]
    assert results[0] == results[1] and results[0][:2] == ["4", "2"]


def test_log_metrics_refuses_one_sink_listed_twice(tmp_path) -> None:
    from toolkit.plugins import jsonl, log_metrics

    sink = jsonl(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=r"sinks\[1\] must be listed once"):
        log_metrics(every=1, sinks=[sink, sink])
    log_metrics(every=1, sinks=[sink, jsonl(tmp_path / "other.jsonl")])  # distinct: fine


def test_log_images_refuses_one_sink_listed_twice(tmp_path) -> None:
    from toolkit.plugins import log_images, png_dir

    pytest.importorskip("PIL", reason="png_dir needs Pillow (the loggers extra)")
    sink = png_dir(tmp_path / "images")
    with pytest.raises(ValueError, match=r"log_images: sinks\[1\] must be listed once"):
        log_images(lambda state: {}, every=1, sinks=[sink, sink])
