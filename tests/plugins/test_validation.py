"""validate: exact count-weighted means, eval/no_grad discipline, cadence, best."""

from __future__ import annotations

import math
import weakref
from pathlib import Path

import pytest
import torch
from counting import count_tolists, read_as_on_an_accelerator
from spawning import gloo_group, name_the_data_ranks, spawn

from toolkit import TrainState, accumulate, load_checkpoint, make_step, run, save_checkpoint
from toolkit.loop._evaluate import _evaluate
from toolkit.loop._run import Event
from toolkit.plugins._ema import ema, ema_model
from toolkit.plugins._validation import validate


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def _state(model: torch.nn.Module | None = None, lr: float = 0.05) -> TrainState:
    model = model if model is not None else _model()
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr))


def _loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return (m(b) - 1.0).square().mean()


_STEP = make_step(_loss)


def _train(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(4, 2, generator=g) for _ in range(n)]


def _scripted(values: list[float]):
    """An eval_fn over one val batch that returns the next scripted loss at each evaluation."""
    calls: list[int] = []

    def eval_fn(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, float]:
        calls.append(1)
        return {"loss": values[len(calls) - 1], "acc": -values[len(calls) - 1]}

    return eval_fn, calls


# ---------------------------------------------------------------- count-weighted reduction


def test_default_weights_are_batch_sizes_exact_mean():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 2, generator=g) for n in (3, 5, 1, 7)]
    model = _model()

    def eval_fn(m, b):
        err = (m(b) - 1.0).square().squeeze(1)
        return {"mse": err.mean(), "abs": (m(b) - 1.0).abs().mean()}

    state = run(
        _STEP,
        _state(model),
        _train(2),
        max_steps=2,
        plugins=[validate(eval_fn, xs, every=2, monitor="mse")],
    )
    # By hand: the mean over all 16 samples, in float64.
    with torch.no_grad():
        allx = torch.cat(xs).double()
        m64 = {k: v.double() for k, v in model.state_dict().items()}
        h = torch.relu(allx @ m64["0.weight"].T + m64["0.bias"])
        out = (h @ m64["2.weight"].T + m64["2.bias"]).squeeze(1)
    metrics = state.metrics["val"]["values"]
    assert metrics["mse"] == pytest.approx(((out - 1.0) ** 2).mean().item(), rel=1e-6)
    assert metrics["abs"] == pytest.approx((out - 1.0).abs().mean().item(), rel=1e-6)
    # The plain mean of batch means differs: the weighting is really by size.
    sizes = [len(x) for x in xs]
    chunks = torch.split((out - 1.0) ** 2, sizes)
    unweighted = sum(c.mean().item() for c in chunks) / len(chunks)
    assert metrics["mse"] != pytest.approx(unweighted, rel=1e-3)
    assert all(isinstance(v, float) for v in metrics.values())


def test_explicit_counts_and_mixed_numbers():
    # (mapping, count): a per-token mean weighted by each batch's token count.
    batches = [
        {"tokens": torch.tensor(10.0), "sum": torch.tensor(5.0)},
        {"tokens": torch.tensor(2.0), "sum": torch.tensor(4.0)},
        {"tokens": torch.tensor(8.0), "sum": torch.tensor(1.0)},
    ]

    def eval_fn(m, b):
        return {"loss": b["sum"] / b["tokens"], "const": 3}, b["tokens"]

    metrics = _evaluate(eval_fn, _model(), batches)
    assert metrics["loss"] == pytest.approx((5.0 + 4.0 + 1.0) / 20.0)
    assert metrics["const"] == 3.0
    # Python-number counts work too.
    metrics = _evaluate(lambda m, b: ({"x": b}, int(b)), _model(), [1.0, 3.0])
    assert metrics["x"] == pytest.approx((1 * 1 + 3 * 3) / 4)
    # Weights summing to zero (batches without targets): no mean, NaN rather than a crash,
    # and a warning that names the step.
    with pytest.warns(RuntimeWarning, match=r"pass at step 7 had weight 0 .* every metric is NaN"):
        metrics = _evaluate(lambda m, b: ({"x": 1.0}, 0), _model(), [1, 2], " at step 7")
    assert math.isnan(metrics["x"])


def test_batch_without_tensor_weighs_one_and_partial_metrics():
    batches = [[1.0, 2.0], [5.0], [9.0, 9.0, 9.0]]

    def eval_fn(m, b):
        out = {"first": b[0]}
        if len(b) > 1:
            out["only_long"] = float(len(b))
        return out

    metrics = _evaluate(eval_fn, _model(), batches)
    assert metrics["first"] == pytest.approx((1.0 + 5.0 + 9.0) / 3)
    assert metrics["only_long"] == pytest.approx((2.0 + 3.0) / 2)  # over the batches having it


def test_one_host_sync_per_evaluation(monkeypatch):
    read_as_on_an_accelerator(monkeypatch)
    tolists = count_tolists(monkeypatch)

    def forbidden(self, *args):
        raise AssertionError("a per-batch host sync")

    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "__float__", forbidden)
    data = [torch.ones(2, 2)] * 5
    _evaluate(lambda m, b: {"a": m(b).mean(), "b": m(b).sum()}, _model(), data)
    assert tolists == [5 * 2]  # every batch's metrics, read back at once at the end


def test_a_metric_that_views_a_large_tensor_does_not_keep_it_alive():
    # Each batch's metrics are kept until the end of the evaluation (one host read): a view
    # would keep the whole tensor behind it alive, batch after batch.
    bigs: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def eval_fn(m, b):
        alive.extend(i for i, ref in enumerate(bigs) if ref() is not None)
        big = torch.full((1000,), float(len(bigs)))
        bigs.append(weakref.ref(big))
        return {"first": big[0], "second": big[1:2]}

    metrics = _evaluate(eval_fn, _model(), [torch.ones(1, 2)] * 4)
    assert alive == [] and metrics == {"first": 1.5, "second": 1.5}


# ---------------------------------------------------------------- eval / no_grad discipline


def test_eval_mode_and_no_grad_inside_and_train_mode_restored():
    seen: list[tuple[bool, bool]] = []

    def eval_fn(m, b):
        seen.append((m.training, torch.is_grad_enabled()))
        return {"loss": m(b).mean()}

    model = _model()
    state = run(
        _STEP,
        _state(model),
        _train(4),
        max_steps=4,
        plugins=[validate(eval_fn, [torch.ones(2, 2)] * 2, every=2)],
    )
    assert seen == [(False, False)] * 4
    assert model.training and all(m.training for m in model.modules())
    assert torch.is_grad_enabled()
    assert state.metrics["val"]["step"] == 4


def test_eval_mode_model_stays_eval_and_mixed_modes_restored():
    model = _model()
    model.eval()
    plugin = validate(lambda m, b: {"loss": m(b).mean()}, [torch.ones(1, 2)], every=1)
    with pytest.warns(RuntimeWarning, match="run: the model is in eval mode"):
        run(_STEP, _state(model), _train(1), max_steps=1, plugins=[plugin])
    assert not model.training and not any(m.training for m in model.modules())
    # A model in train mode with a frozen part in eval mode gets exactly that back.
    model.train()
    model[0].eval()
    run(_STEP, _state(model), _train(1), max_steps=1, plugins=[plugin])
    assert model.training and not model[0].training and model[2].training


def test_mode_restored_when_eval_fn_raises():
    model = _model()

    def eval_fn(m, b):
        raise RuntimeError("boom in eval")

    plugin = validate(eval_fn, [torch.ones(1, 2)], every=1)
    with pytest.raises(RuntimeError, match="boom in eval"):
        run(_STEP, _state(model), _train(2), max_steps=2, plugins=[plugin])
    assert model.training and all(m.training for m in model.modules())


# ---------------------------------------------------------------- cadence


def test_every_n_applied_updates_with_accumulation():
    steps: list[int] = []

    def eval_fn(m, b):
        return {"loss": 0.0}

    def spy(event: Event) -> None:
        entry = event.state.metrics.get("val")
        if entry is not None and (not steps or steps[-1] != entry["step"]):
            steps.append(entry["step"])

    step = accumulate(_STEP, micro_batches=2)
    run(
        step,
        _state(),
        _train(20),
        max_steps=10,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], every=3), spy],
    )
    assert steps == [3, 6, 9]


def test_at_end_evaluates_the_final_weights_once():
    eval_fn, calls = _scripted([0.5, 0.4, 0.3])
    # 5 updates with every=2: evaluations at 2 and 4, then the final weights at 5.
    state = run(
        _STEP,
        _state(),
        _train(5),
        max_steps=5,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], every=2, at_end=True)],
    )
    assert len(calls) == 3
    assert state.metrics["val"]["step"] == 5
    assert state.metrics["val"]["values"]["loss"] == 0.3
    # Final weights already evaluated (4 is a multiple of 2): no second evaluation.
    eval_fn, calls = _scripted([0.5, 0.4, 0.3])
    run(
        _STEP,
        _state(),
        _train(4),
        max_steps=4,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], every=2, at_end=True)],
    )
    assert len(calls) == 2
    # at_end alone, and not after a training error.
    eval_fn, calls = _scripted([0.5])
    state = run(
        _STEP,
        _state(),
        _train(3),
        max_steps=3,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], at_end=True)],
    )
    assert (len(calls), state.metrics["val"]["step"]) == (1, 3)

    def boom(event: Event) -> None:
        if event.kind == "step":
            raise RuntimeError("training failed")

    eval_fn, calls = _scripted([0.5])
    with pytest.raises(RuntimeError, match="training failed"):
        run(
            _STEP,
            _state(),
            _train(3),
            max_steps=3,
            plugins=[boom, validate(eval_fn, [torch.ones(1, 2)], at_end=True)],
        )
    assert calls == []


def test_per_epoch_and_dedup_with_every():
    epochs: list[tuple[int, int]] = []

    def eval_fn(m, b):
        return {"loss": 1.0}

    def spy(event: Event) -> None:
        if event.kind == "epoch_end":
            step, entry = event.state.metrics["val"]["step"], event.state.extras["val"]
            epochs.append((step, entry["epoch"]))

    counter: list[int] = []

    def counting(m, b):
        counter.append(1)
        return eval_fn(m, b)

    run(
        _STEP,
        _state(),
        _train(3),
        epochs=3,
        plugins=[validate(counting, [torch.ones(1, 2)], per_epoch=True), spy],
    )
    assert epochs == [(3, 1), (6, 2), (9, 3)] and len(counter) == 3
    # every=3 and per_epoch with 3 batches an epoch: the epoch end at the same step reuses it.
    counter.clear()
    run(
        _STEP,
        _state(),
        _train(3),
        epochs=2,
        plugins=[validate(counting, [torch.ones(1, 2)], every=3, per_epoch=True)],
    )
    assert len(counter) == 2
    counter.clear()
    run(
        _STEP,
        _state(),
        _train(3),
        epochs=2,
        plugins=[validate(counting, [torch.ones(1, 2)], every=2, per_epoch=True)],
    )
    assert len(counter) == 4  # steps 2, 3 (epoch end), 4, 6 (both: once)


# ---------------------------------------------------------------- best tracking


def test_best_min_and_max():
    values = [3.0, 2.0, 2.5, 1.0, 1.5]
    eval_fn, _ = _scripted(values)
    history: list[tuple[float, int]] = []

    def spy(event: Event) -> None:
        if event.kind == "step":
            entry = event.state.extras["val"]
            history.append((entry["best"], entry["best_step"]))

    run(
        _STEP,
        _state(),
        _train(5),
        max_steps=5,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], every=1), spy],
    )
    assert history == [(3.0, 1), (2.0, 2), (2.0, 2), (1.0, 4), (1.0, 4)]
    eval_fn, _ = _scripted(values)
    state = run(
        _STEP,
        _state(),
        _train(5),
        max_steps=5,
        plugins=[validate(eval_fn, [torch.ones(1, 2)], every=1, monitor="acc", mode="max")],
    )
    entry = state.extras["val"]
    assert (entry["best"], entry["best_step"]) == (-1.0, 4)
    assert state.metrics["val"]["values"] == {"acc": -1.5, "loss": 1.5}


def test_best_survives_resume_and_nan_never_best():
    eval_fn, _ = _scripted([2.0, float("nan"), 3.0, 1.0])
    plugin = validate(eval_fn, [torch.ones(1, 2)], every=1)
    state = run(_STEP, _state(), _train(4), max_steps=3, plugins=[plugin])
    entry = state.extras["val"]
    assert (entry["best"], entry["best_step"]) == (2.0, 1)
    assert state.metrics["val"]["values"]["loss"] == 3.0
    state = run(_STEP, state, _train(4), max_steps=4, plugins=[plugin])
    assert (state.extras["val"]["best"], state.extras["val"]["best_step"]) == (1.0, 4)


def test_the_published_result_and_the_best_survive_a_checkpoint(tmp_path: Path) -> None:
    eval_fn, _ = _scripted([2.0, 1.0, 3.0])
    state = run(_STEP, _state(), _train(3), max_steps=3, plugins=[validate(eval_fn, [1], every=1)])
    loaded = load_checkpoint(save_checkpoint(state, tmp_path / "step_000003"), like=_state())
    assert loaded.metrics == {"val": {"step": 3, "values": {"loss": 3.0, "acc": -3.0}}}
    assert loaded.extras == state.extras == {"val": {"epoch": 0, "best": 1.0, "best_step": 2}}


def test_a_first_nan_evaluation_is_not_best_either():
    eval_fn, _ = _scripted([float("nan"), 3.0])
    plugin = validate(eval_fn, [torch.ones(1, 2)], every=1)
    bests = []

    def spy(e):
        if e.kind == "step":
            entry = e.state.extras["val"]
            bests.append((entry["best"], entry["best_step"]))

    run(_STEP, _state(), _train(2), max_steps=2, plugins=[plugin, spy])
    assert bests == [(None, None), (3.0, 2)]


def test_model_option_evaluates_the_ema():
    seen: list[torch.Tensor] = []

    def eval_fn(m, b):
        seen.append(m[0].weight.detach().clone())
        return {"loss": m(b).mean()}

    model = _model()
    state = run(
        _STEP,
        _state(model),
        _train(3),
        max_steps=3,
        plugins=[ema(0.5), validate(eval_fn, [torch.ones(1, 2)], every=3, model=ema_model)],
    )
    torch.testing.assert_close(seen[-1], state.extras["ema"]["params"]["0.weight"])
    assert not torch.allclose(seen[-1], model[0].weight)


# ---------------------------------------------------------------- validate errors


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, r"expected every=N, per_epoch=True and/or at_end=True; got none"),
        ({"every": 0}, ValueError, r"every must be an int >= 1 \(.*or None\); got 0"),
        ({"every": 2, "key": ""}, ValueError, r"key must be a non-empty string"),
        ({"every": 2, "mode": "best"}, ValueError, r"mode must be one of \['min', 'max'\].*'best'"),
        ({"every": 2, "model": "ema"}, TypeError, r"model must be a function state -> module"),
    ],
)
def test_validate_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        validate(lambda m, b: {"loss": 0.0}, [1], **kwargs)


def test_validate_bad_data_and_eval_fn():
    with pytest.raises(ValueError, match=r"re-iterable .* one-shot iterator"):
        validate(lambda m, b: {}, iter([1]), every=1)
    with pytest.raises(TypeError, match=r"eval_fn must be callable"):
        validate({"loss": 1}, [1], every=1)


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (1.0, r"returned float: not a mapping of metrics"),
        (({"loss": 1.0}, None), r"its count is None"),
        ({"loss": torch.ones(3)}, r"metric 'loss' is a tensor of shape \(3,\)"),
        ({"loss": "low"}, r"metric 'loss' is a str"),
    ],
)
def test_bad_eval_fn_results(result, match):
    plugin = validate(lambda m, b: result, [torch.ones(1, 2)], every=1)
    with pytest.raises(TypeError, match=match):
        run(_STEP, _state(), _train(1), max_steps=1, plugins=[plugin])


def test_missing_monitor_lists_metrics():
    plugin = validate(lambda m, b: {"acc": 1.0, "nll": 2.0}, [torch.ones(1, 2)], every=1)
    message = r"monitor must be a metric eval_fn returns, one of \['acc', 'nll'\]; got 'loss'"
    with pytest.raises(KeyError, match=message):
        run(_STEP, _state(), _train(1), max_steps=1, plugins=[plugin])


def test_empty_validation_data():
    plugin = validate(lambda m, b: {"loss": 1.0}, [], every=1)
    with pytest.raises(ValueError, match=r"yielded no batches"):
        run(_STEP, _state(), _train(1), max_steps=1, plugins=[plugin])


# ---------------------------------------------------------------- distributed reduction


def _dist_worker(rank: int, store: str, out_dir: str) -> None:
    with gloo_group(rank, 2, store):
        name_the_data_ranks(2)  # a plain Linear: no data-parallel wrapper names them
        # Rank 0 holds 3 samples of value 1, rank 1 holds 1 sample of value 5: mean 2.
        data = [torch.full((3, 1), 1.0)] if rank == 0 else [torch.full((1, 1), 5.0)]
        metrics = _evaluate(lambda m, b: {"v": b.mean()}, torch.nn.Linear(1, 1), data)
        Path(out_dir, f"rank{rank}").write_text(repr(metrics["v"]))
        # Different metric names on the ranks would mix unrelated sums: refused on every rank.
        try:
            _evaluate(lambda m, b: {f"v{rank}": b.mean()}, torch.nn.Linear(1, 1), data)
        except ValueError as exc:
            assert f"different keys (this rank: ['v{rank}'])" in str(exc)
        else:
            raise AssertionError("mismatched metric names were not detected")


@pytest.mark.slow
def test_distributed_all_reduces_sums_and_weights(tmp_path):
    def args(attempt: int) -> tuple[str, str]:
        out_dir = tmp_path / f"out{attempt}"
        out_dir.mkdir()
        return str(tmp_path / f"store{attempt}"), str(out_dir)

    spawn(_dist_worker, args, nprocs=2, timeout=120)
    out_dir = max(tmp_path.glob("out*"))  # the last attempt's
    results = [float((out_dir / f"rank{r}").read_text()) for r in range(2)]
    assert results == [pytest.approx(2.0), pytest.approx(2.0)]
