"""run(): stopping rules, epochs and set_epoch, timings, plugin order, cleanup on errors."""

from __future__ import annotations

import contextlib
import gc
import re
import warnings
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from toolkit import Event, TrainState, accumulate, make_step, run
from toolkit.plugins import validate


def _state() -> TrainState:
    model = torch.nn.Linear(2, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def _step(k: int = 1):
    step = make_step(lambda m, b: m(b).square().mean())
    return accumulate(step, micro_batches=k) if k > 1 else step


def _data(n: int = 5) -> list[torch.Tensor]:
    return [torch.randn(3, 2) for _ in range(n)]


def _recorder(log: list):
    def plugin(event: Event) -> None:
        log.append((event.kind, event.state.step, event.state.epoch))

    return plugin


def test_stops_at_max_steps_applied_updates_not_batches() -> None:
    state = run(_step(k=3), _state(), _data(5), max_steps=4)
    assert state.step == 4
    # 12 micro-batches: two full epochs of 5 and two batches into the third.
    assert (state.epoch, state.batches_seen) == (2, 2)


def test_max_steps_is_a_total_so_a_resumed_run_continues() -> None:
    state = run(_step(), _state(), _data(5), max_steps=3)
    state = run(_step(), state, _data(5), max_steps=7)
    assert state.step == 7
    assert run(_step(), state, _data(5), max_steps=7).step == 7  # already done: no batch drawn


def test_epochs_iterate_a_re_iterable_source_and_set_epoch_on_its_sampler() -> None:
    dataset = TensorDataset(torch.randn(8, 2))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3)
    seen_epochs = []
    original = sampler.set_epoch
    sampler.set_epoch = lambda e: (seen_epochs.append(e), original(e))[1]  # type: ignore[method-assign]
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    log: list = []
    state = run(
        make_step(lambda m, b: m(b[0]).mean()), _state(), loader, epochs=3, plugins=[_recorder(log)]
    )
    assert (state.epoch, state.step, state.batches_seen) == (3, 12, 0)
    assert seen_epochs == [0, 1, 2]
    assert [e for e in log if e[0] == "epoch_end"] == [
        ("epoch_end", 4, 1),
        ("epoch_end", 8, 2),
        ("epoch_end", 12, 3),
    ]


def test_first_of_max_steps_and_epochs_wins() -> None:
    assert run(_step(), _state(), _data(5), max_steps=100, epochs=2).step == 10
    assert run(_step(), _state(), _data(5), max_steps=3, epochs=2).step == 3


def test_one_shot_iterator_ends_the_run_when_exhausted() -> None:
    state = run(_step(), _state(), iter(_data(4)), max_steps=100)
    assert (state.step, state.epoch) == (4, 1)


def test_resume_mid_epoch_skips_the_batches_already_seen() -> None:
    data = _data(6)
    seen: list[torch.Tensor] = []
    step = make_step(lambda m, b: (seen.append(b), m(b).mean())[1])
    state = run(step, _state(), data, max_steps=4)
    assert state.batches_seen == 4
    seen.clear()
    run(step, state, data, max_steps=6)
    assert [id(b) for b in seen] == [id(b) for b in data[4:6]]


def test_plugin_can_stop_the_loop_with_a_reason_and_see_it() -> None:
    def stopper(event: Event) -> TrainState | None:
        if event.kind == "step" and event.state.step == 3:
            return event.state.replace(stop="enough: step 3")
        return None

    log: list = []
    state = run(_step(), _state(), _data(5), max_steps=100, plugins=[stopper, _recorder(log)])
    assert state.step == 3
    assert state.stop == "enough: step 3"
    assert log[-1] == ("end", 3, 0)
    # A new run clears the old request.
    assert run(_step(), state, _data(5), max_steps=5).step == 5


def test_plugins_run_in_list_order_and_see_each_others_states() -> None:
    order: list[str] = []

    def first(event: Event) -> TrainState | None:
        order.append(f"first:{event.kind}")
        if event.kind == "step":
            return event.state.replace(extras={**event.state.extras, "n": event.state.step})
        return None

    def second(event: Event) -> None:
        order.append(f"second:{event.kind}")
        if event.kind == "step":
            assert event.state.extras["n"] == event.state.step

    state = run(_step(), _state(), _data(2), epochs=1, plugins=[first, second])
    assert state.extras["n"] == 2
    assert order == [
        "first:restore",
        "second:restore",
        "first:start",
        "second:start",
        "first:epoch_start",
        "second:epoch_start",
        "first:step",
        "second:step",
        "first:step",
        "second:step",
        "first:epoch_end",
        "second:epoch_end",
        "first:end",
        "second:end",
    ]


def test_step_events_come_once_per_update_with_the_windows_outputs() -> None:
    events: list[Event] = []
    run(_step(k=2), _state(), _data(4), epochs=2, plugins=[events.append])
    steps = [e for e in events if e.kind == "step"]
    assert len(steps) == 4
    assert all(len(e.outs) == 2 and e.out is e.outs[-1] for e in steps)
    assert [[o.updated for o in e.outs] for e in steps] == [[False, True]] * 4
    assert [e.state.step for e in steps] == [1, 2, 3, 4]
    assert [e.state.batches_seen for e in steps] == [2, 4, 2, 4]  # the data position
    assert all(e.data_time >= 0 and e.step_time > 0 for e in steps)
    loop = events[0].loop
    assert (loop.micro_batches, loop.batches_per_epoch, loop.total_steps) == (2, 4, 4)


def test_total_steps_counts_a_window_left_open_by_the_previous_run() -> None:
    infos: list = []
    state = run(_step(k=2), _state(), _data(3), epochs=1)  # 1 update, 1 micro-batch left open
    assert (state.step, state.window.micro_step) == (1, 1)
    plugin = [lambda e: infos.append(e.loop) if e.kind == "start" else None]
    state = run(_step(k=2), state, _data(3), epochs=2, plugins=plugin)
    # The open micro-batch and the 3 of epoch 2 make 2 more updates: 3 in all.
    assert infos[0].total_steps == state.step == 3


def test_a_window_spanning_an_epoch_and_skipped_micro_batches() -> None:
    events: list[Event] = []
    calls = iter(range(100))

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor | None:
        return None if next(calls) == 1 else model(batch).square().mean()  # skip the 2nd

    step = accumulate(make_step(loss_fn), micro_batches=2)
    state = run(step, _state(), _data(4), epochs=2, plugins=[events.append])
    kinds = [(e.kind, len(e.outs)) for e in events]
    # Epoch 1: b1, b2 (skipped), b3 close a window; b4 opens one that b5 closes in epoch 2;
    # b6, b7 close one; b8 is left open at the end.
    assert kinds == [
        ("restore", 0),
        ("start", 0),
        ("epoch_start", 0),
        ("step", 3),
        ("epoch_end", 0),
        ("epoch_start", 0),
        ("step", 2),
        ("step", 2),
        ("epoch_end", 0),
        ("end", 1),
    ]
    assert [o.skipped for o in events[3].outs] == [False, True, False]
    assert events[6].state.batches_seen == 1  # b5 is the first batch of epoch 2
    assert state.step == 3


def test_end_event_carries_an_open_window() -> None:
    events: list[Event] = []
    state = run(_step(k=3), _state(), iter(_data(4)), max_steps=5, plugins=[events.append])
    assert state.step == 1
    assert (events[-1].kind, len(events[-1].outs)) == ("end", 1)
    assert events[-1].state.batches_seen == 0  # the one-shot epoch ended: position reset


def test_every_plugins_end_runs_when_training_raises_and_the_error_propagates() -> None:
    ends: list = []

    def boom(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("bad batch")

    def failing_end(event: Event) -> None:
        if event.kind == "end":
            ends.append(("failing", type(event.error).__name__))
            raise OSError("disk full while closing")

    def recorder(event: Event) -> None:
        if event.kind == "end":
            ends.append(("recorder", str(event.error)))

    with pytest.raises(RuntimeError, match="bad batch") as caught:
        run(make_step(boom), _state(), _data(3), max_steps=2, plugins=[failing_end, recorder])
    assert ends == [("failing", "RuntimeError"), ("recorder", "bad batch")]
    # The plugin's own failure is not lost: it is attached to the training error.
    assert any(
        "failing_end failed at 'end'" in note and "disk full" in note
        for note in caught.value.__notes__
    )


def test_a_failing_end_after_good_training_warns_and_returns_the_state() -> None:
    # Bookkeeping at the end must not cost the trained state.
    ran = []

    def failing_end(event: Event) -> None:
        if event.kind == "end":
            raise OSError("could not flush")

    message = "failing_end failed at 'end' after training ended well: OSError('could not flush')"
    with pytest.warns(RuntimeWarning, match=re.escape(message)):
        state = run(
            _step(),
            _state(),
            _data(2),
            max_steps=1,
            plugins=[failing_end, lambda e: ran.append(e.kind)],
        )
    assert ran[-1] == "end" and state.step == 1


def test_the_data_iterator_is_closed_on_every_exit() -> None:
    closed = []

    class Source:
        def __iter__(self):
            def gen():
                try:
                    while True:
                        yield torch.randn(2, 2)
                finally:
                    closed.append(True)

            return gen()

    run(_step(), _state(), Source(), max_steps=3)
    assert closed == [True]

    def boom(event: Event) -> None:
        if event.kind == "step":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(_step(), _state(), Source(), max_steps=3, plugins=[boom])
    assert closed == [True, True]


def test_the_data_iterator_is_closed_when_a_resumed_epoch_skips_batches() -> None:
    closed = []

    class Source:
        def __len__(self) -> int:
            return 4

        def __iter__(self):
            def gen():
                try:
                    yield from (torch.randn(2, 2) for _ in range(4))
                finally:
                    closed.append(True)

            return gen()

    state = run(_step(), _state(), Source(), max_steps=2)  # stops 2 batches into the epoch
    assert state.batches_seen == 2 and closed == [True]

    def boom(event: Event) -> None:
        if event.kind == "step":
            raise KeyboardInterrupt

    with (
        pytest.raises(KeyboardInterrupt),  # resumed: the source's own iterator is closed
        pytest.warns(RuntimeWarning, match="resuming a Source: its first 2 batches"),
    ):
        run(_step(), state, Source(), max_steps=4, plugins=[boom])
    assert closed == [True, True]


def test_worker_pool_is_shut_down_on_exit() -> None:
    loader = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=2, num_workers=1)
    iterators = []
    real_iter = DataLoader.__iter__

    def spy(self):
        it = real_iter(self)
        iterators.append(it)
        return it

    DataLoader.__iter__ = spy  # type: ignore[method-assign]
    try:
        run(make_step(lambda m, b: m(b[0]).mean()), _state(), loader, max_steps=2)
    finally:
        DataLoader.__iter__ = real_iter  # type: ignore[method-assign]
    assert iterators and iterators[-1]._shutdown


@pytest.mark.parametrize(
    ("kwargs", "data", "error", "message"),
    [
        ({}, [1], ValueError, "give max_steps and/or epochs; got neither"),
        ({"max_steps": -1}, [1], ValueError, "max_steps must be an int >= 0; got -1"),
        ({"epochs": 1.5}, [1], ValueError, "epochs must be an int >= 0; got 1.5"),
        ({"epochs": 1}, iter([1]), ValueError, "needs data that can be iterated again"),
        ({"max_steps": 1}, 3, TypeError, "data must be an iterable of batches"),
    ],
)
def test_bad_arguments(kwargs: dict, data: object, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        run(_step(), _state(), data, **kwargs)  # type: ignore[arg-type]


def test_plugin_returning_something_else_is_an_error() -> None:
    def plugin(event: Event) -> int:
        return 3

    with pytest.raises(TypeError, match="returned int; expected a TrainState or None"):
        run(_step(), _state(), _data(2), max_steps=1, plugins=[plugin])  # type: ignore[list-item]


def test_plugin_returning_something_else_at_end_is_reported_too() -> None:
    def plugin(event: Event) -> int | None:
        return 3 if event.kind == "end" else None

    with pytest.warns(RuntimeWarning, match="returned int; expected a TrainState or None"):
        run(_step(), _state(), _data(2), max_steps=1, plugins=[plugin])  # type: ignore[list-item]


def test_a_plugin_exiting_at_the_end_waits_for_every_other_end() -> None:
    # The checkpoints plugin exits with 128 + signal after a preemption; the plugins after
    # it (log_metrics closing its sinks) must still run their end first.
    ran = []

    def exits(event: Event) -> None:
        if event.kind == "end":
            raise SystemExit(143)

    with pytest.raises(SystemExit) as caught:
        run(_step(), _state(), _data(2), max_steps=1, plugins=[exits, lambda e: ran.append(e.kind)])
    assert caught.value.code == 143 and ran[-1] == "end"


@pytest.mark.parametrize("where", ["end", "step"])
def test_an_exception_out_of_run_leaves_no_cycle_that_keeps_the_model_alive(where: str) -> None:
    # Bug caught: run() kept the error (and _end the SystemExit) in a local of a frame its
    # traceback holds: a cycle that kept the model until Python's last collection, and a DDP
    # model keeps gloo's threads running, which can abort the interpreter's shutdown (-6).
    def plugin(event: Event) -> None:
        if event.kind == where:
            raise SystemExit(143) if where == "end" else ValueError("a failing plugin")

    state = _state()
    model = weakref.ref(state.model)
    gc.disable()  # only reference counts free it: no collection may hide a cycle
    try:
        with contextlib.suppress(SystemExit, ValueError):
            run(_step(), state, _data(2), max_steps=1, plugins=[plugin])
        del state
        assert model() is None, gc.get_referrers(model())
    finally:
        gc.enable()


def test_a_model_left_in_eval_mode_is_reported_once_at_the_start() -> None:
    # from_pretrained returns models in eval mode: dropout would be off for the whole run.
    state = _state()
    inner = state.model.eval()
    wrapped = state.replace(model=torch.nn.DataParallel(inner))  # the wrapper itself trains
    for start in (state, wrapped):
        with pytest.warns(RuntimeWarning, match=r"eval mode.*call model\.train\(\)") as caught:
            run(_step(), start, _data(3), max_steps=3)
        assert len(caught) == 1 and caught[0].filename == __file__  # points at run()'s caller
    # The filter the message gives silences it (warnings are errors in this test suite).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "run: the model is in eval mode")
        run(_step(), state, _data(3), max_steps=3)
    # Training that starts in train mode is not reported, however plugins switch the mode
    # (validate evaluates in eval mode and switches back); a plugin may switch it at "start".
    inner.train()
    evaluates = validate(lambda m, b: {"loss": m(b).mean()}, _data(1), every=1)
    run(_step(), state, _data(3), max_steps=3, plugins=[evaluates])
    inner.eval()

    def trains(event: Event) -> None:
        if event.kind == "start":
            event.state.model.train()

    run(_step(), state, _data(3), max_steps=3, plugins=[trains])
