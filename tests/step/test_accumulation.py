"""Exact accumulation: counts, unequal micro-batches, skipped batches.

The gradient a step applied is read back through SGD with lr=1 and no momentum: in float64
``p0 - p1`` equals the gradient up to one rounding of ``p0`` (relative error ~1e-16 here).
References are computed with plain autograd on one big batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from toolkit import LossSum, TrainState, accumulate, make_step

IN, HIDDEN, OUT = 4, 8, 3
F64 = torch.float64
REL_TOL = 1e-12

# Micro-batch sizes that differ a lot: mixes of 1..4 and 20..64 rows, k = 1..6 per window.
SIZES = st.lists(st.one_of(st.integers(1, 4), st.integers(20, 64)), min_size=1, max_size=6)
SEEDS = st.integers(0, 2**16)


def _model(seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=F64))
    return model


def _data(n: int, seed: int, empty_mask: bool = False) -> tuple[torch.Tensor, ...]:
    """Inputs, targets and a target mask; every row has >= 1 target unless ``empty_mask``."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, IN, generator=gen, dtype=F64)
    y = torch.randn(n, OUT, generator=gen, dtype=F64)
    mask = torch.rand(n, OUT, generator=gen) < 0.6
    mask[:, 0] = not empty_mask
    if empty_mask:
        mask[:] = False
    return x, y, mask


def _split(batch: tuple[torch.Tensor, ...], sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    return list(zip(*(t.split(sizes) for t in batch)))


def _summed_loss(count_as: str):
    """A token-style loss: squared error summed over the masked targets, with their count.

    A micro-batch with no target at all is skipped (``None``), as a real loss would do.
    """

    def loss_fn(model, batch):
        x, y, mask = batch
        if not mask.any():
            return None
        total = ((model(x) - y) ** 2 * mask).sum()
        count = mask.sum() if count_as == "tensor" else int(mask.sum())
        return LossSum(total, count)

    return loss_fn


def _mean_loss(model, batch):
    x, y, mask = batch
    return ((model(x) - y) ** 2 * mask).sum() / mask.sum()


def _grad(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _big_batch_grad(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return _grad(model, _mean_loss(model, batch))


def _rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - w).flatten() for g, w in zip(got, want)])
    return float(diff.norm() / torch.cat([w.flatten() for w in want]).norm())


def _run(model: nn.Module, micro_batches, loss_fn, k: int):
    """Feed ``micro_batches`` to an accumulate(k) step on a copy of ``model`` (SGD, lr=1).

    Returns the parameter delta ``p0 - p1`` (the applied gradient), the final state, the
    outputs, and the trained copy.
    """
    model = copy.deepcopy(model)
    p0 = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    state = TrainState(model=model, optimizer=opt)
    step = accumulate(make_step(loss_fn), micro_batches=k)
    outs = []
    for b in micro_batches:
        state, out = step(state, b)
        outs.append(out)
    delta = [a - p.detach() for a, p in zip(p0, model.parameters())]
    return delta, state, outs, model


@pytest.mark.parametrize("count_as", ["int", "tensor"])
@settings(max_examples=40, deadline=None)
@given(sizes=SIZES, seed=SEEDS)
def test_counts_give_the_big_batch_gradient_for_unequal_micro_batches(count_as, sizes, seed):
    model, batch = _model(seed), _data(sum(sizes), seed)
    want = _big_batch_grad(model, batch)
    parts = _split(batch, sizes)

    delta, state, outs, _ = _run(model, parts, _summed_loss(count_as), k=len(sizes))

    assert _rel_err(delta, want) <= REL_TOL
    assert [o.updated for o in outs] == [False] * (len(sizes) - 1) + [True]
    assert state.step == 1 and state.window.micro_step == 0 and state.window.count is None
    for out, (x, y, mask) in zip(outs, parts):
        # out.loss is the micro-batch's own mean loss, out.count what the loss function said.
        own_mean = ((model(x) - y) ** 2 * mask).sum() / mask.sum()
        torch.testing.assert_close(out.loss, own_mean.detach(), rtol=1e-14, atol=0)
        assert int(out.count) == int(mask.sum()) and out.samples == len(x)
        assert isinstance(out.count, torch.Tensor) == (count_as == "tensor")


@settings(max_examples=20, deadline=None)
@given(sizes=SIZES, seed=SEEDS)
def test_counts_as_int_and_as_tensor_give_the_same_update(sizes, seed):
    model, batch = _model(seed), _data(sum(sizes), seed)
    parts = _split(batch, sizes)
    as_int, *_ = _run(model, parts, _summed_loss("int"), k=len(sizes))
    as_tensor, *_ = _run(model, parts, _summed_loss("tensor"), k=len(sizes))
    for a, b in zip(as_int, as_tensor):
        assert torch.equal(a, b)


def test_counts_without_accumulate_give_the_mean_gradient():
    model, batch = _model(3), _data(17, 3)
    p0 = [p.detach().clone() for p in model.parameters()]
    want = _big_batch_grad(model, batch)
    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    state, out = make_step(_summed_loss("tensor"))(state, batch)
    assert out.updated and state.step == 1
    assert _rel_err([a - p.detach() for a, p in zip(p0, model.parameters())], want) <= REL_TOL


@pytest.mark.parametrize("sizes", [[1, 31], [3, 5, 24], [16, 1, 1, 1, 1, 8]])
def test_plain_mean_losses_of_unequal_micro_batches_give_the_mean_of_means(sizes):
    """The known trap that counts fix: without them, each micro-batch mean weighs 1/k."""
    model, batch = _model(7), _data(sum(sizes), 7)
    parts = _split(batch, sizes)
    mean_of_means = [
        sum(gs) / len(sizes) for gs in zip(*(_grad(model, _mean_loss(model, b)) for b in parts))
    ]

    delta, state, _, _ = _run(model, parts, _mean_loss, k=len(sizes))

    assert state.step == 1
    assert _rel_err(delta, mean_of_means) <= REL_TOL
    assert _rel_err(delta, _big_batch_grad(model, batch)) > 1e-3  # not the big-batch gradient
    # ... whereas counts do give it, on the very same micro-batches.
    exact, *_ = _run(model, parts, _summed_loss("tensor"), k=len(sizes))
    assert _rel_err(exact, _big_batch_grad(model, batch)) <= REL_TOL


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 6), size=st.integers(1, 40), seed=SEEDS)
def test_plain_mean_losses_of_equal_micro_batches_give_the_big_batch_gradient(k, size, seed):
    model, batch = _model(seed), _data(k * size, seed)
    # Equal row counts are not enough when targets are masked: use every target here.
    batch = (*batch[:2], torch.ones_like(batch[2]))
    delta, *_ = _run(model, _split(batch, [size] * k), _mean_loss, k=k)
    assert _rel_err(delta, _big_batch_grad(model, batch)) <= REL_TOL


@pytest.mark.parametrize("counts", [True, False])
@settings(max_examples=25, deadline=None)
@given(
    sizes=SIZES,
    skips=st.lists(st.integers(0, 2), min_size=7, max_size=7),
    seed=SEEDS,
)
def test_a_skipped_micro_batch_never_happened(counts, sizes, skips, seed):
    """``None`` from the loss function: no backward, the window does not move."""
    k = len(sizes)
    model, batch = _model(seed), _data(sum(sizes), seed)
    parts = _split(batch, sizes)
    empty = _data(5, seed + 99, empty_mask=True)  # no targets: the loss function skips it
    # skips[i] skipped batches before the i-th real one, skips[k] after the closing one.
    fed = []
    for i, part in enumerate([*parts, None]):
        fed += [empty] * skips[i]
        if part is not None:
            fed.append(part)

    def loss_fn(model, b):
        if not counts:
            return None if not b[2].any() else _mean_loss(model, b)
        return _summed_loss("tensor")(model, b)

    model_run = copy.deepcopy(model)
    p0 = [p.detach().clone() for p in model_run.parameters()]
    state = TrainState(
        model=model_run, optimizer=torch.optim.SGD(model_run.parameters(), lr=1.0, momentum=0.0)
    )
    step = accumulate(make_step(loss_fn), micro_batches=k)
    for b in fed:
        grads = [p.grad for p in model_run.parameters()]
        saved = [None if g is None else g.clone() for g in grads]
        window = state.window
        applied = state.step
        state, out = step(state, b)
        if b is empty:
            assert out.skipped and not out.updated and not out.closed and out.loss is None
            assert state.window.micro_step == window.micro_step
            assert state.window.count is window.count and state.step == applied
            for p, g, s in zip(model_run.parameters(), grads, saved):
                assert p.grad is g and (g is None or torch.equal(g, s))
        else:
            assert not out.skipped
    assert state.step == 1 and state.window.micro_step == 0

    # The update equals the one made without the skipped batches, bit for bit.
    _, _, _, without = _run(model, parts, loss_fn, k=k)
    for p, q in zip(model_run.parameters(), without.parameters()):
        assert torch.equal(p, q)
    delta = [a - p.detach() for a, p in zip(p0, model_run.parameters())]
    if counts:
        assert _rel_err(delta, _big_batch_grad(model, batch)) <= REL_TOL


MIXED = "reported a target count for some micro-batches of the window but not for others"


@pytest.mark.parametrize("first_counts", [True, False])
def test_mixing_counts_and_plain_losses_in_one_window_raises(first_counts):
    model = _model(0)
    b1, b2 = _split(_data(6, 0), [2, 4])

    def loss_fn(model, b):
        with_count = (b is b1) == first_counts
        return _summed_loss("int")(model, b) if with_count else _mean_loss(model, b)

    state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    step = accumulate(make_step(loss_fn), micro_batches=3)
    state, _ = step(state, b1)
    with pytest.raises(ValueError, match=MIXED):
        step(state, b2)


def test_counts_and_plain_losses_may_alternate_between_windows():
    """The rule is per window: each window is normalised on its own."""
    model, batch = _model(1), _data(12, 1)
    a1, a2, b1, b2 = _split(batch, [1, 5, 2, 4])
    with_counts = {id(a1), id(a2)}

    def loss_fn(model, b):
        return _summed_loss("tensor")(model, b) if id(b) in with_counts else _mean_loss(model, b)

    m = copy.deepcopy(model)
    state = TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0))
    step = accumulate(make_step(loss_fn), micro_batches=2)
    p0 = [p.detach().clone() for p in m.parameters()]
    for b in (a1, a2):  # window 1: counts
        state, out = step(state, b)
    assert out.updated and state.step == 1
    p1 = [p.detach().clone() for p in m.parameters()]
    first_big = tuple(torch.cat(t) for t in zip(a1, a2))
    assert _rel_err([a - b for a, b in zip(p0, p1)], _big_batch_grad(model, first_big)) <= REL_TOL

    at_p1 = copy.deepcopy(m)  # the reference for window 2 needs the gradients at p1
    for b in (b1, b2):  # window 2: plain means
        state, out = step(state, b)
    assert out.updated and state.step == 2
    means = zip(_grad(at_p1, _mean_loss(at_p1, b1)), _grad(at_p1, _mean_loss(at_p1, b2)))
    delta2 = [a - p.detach() for a, p in zip(p1, m.parameters())]
    assert _rel_err(delta2, [(g1 + g2) / 2 for g1, g2 in means]) <= REL_TOL
