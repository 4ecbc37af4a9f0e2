"""The step, its plugins and checkpoints on a CUDA device, against the same loop by hand.

Each test trains with toolkit and with a hand-written loop in the nanoGPT order (written
here: tests/reference.py autocasts on the CPU only) on the same CUDA device, from the same
weights and batches. With ``torch.use_deterministic_algorithms(True)`` both sides run the
same deterministic kernels in the same order, so parameters, optimizer, scheduler and
scaler states are compared bitwise; only the compiled and EMA comparisons, whose kernels
differ between the two sides, use a tolerance. Host syncs are caught by CUDA itself:
``torch.cuda.set_sync_debug_mode("error")`` raises on a synchronising call, ``"warn"``
warns once per call (counted).

Skipped, with the reason, on a machine without CUDA (``-m cuda`` selects them).
"""

from __future__ import annotations

import contextlib
import os

# cuBLAS is deterministic only with a fixed workspace; it must be set before cuBLAS starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from toolkit import (
    TrainState,
    accumulate,
    amp_wrap,
    clip,
    compose,
    evaluate,
    guard_nonfinite,
    load_checkpoint,
    make_step,
    run,
    save_checkpoint,
    to_device,
)
from toolkit.checkpoints import list_checkpoints
from toolkit.plugins import checkpoints, ema, peak_memory, validate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_NORM = 0.5  # small enough that clipping happens; each comparison asserts it did
K = 4  # micro-batches per window


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


# Host syncs, as CUDA reports them -------------------------------------------------------


@contextlib.contextmanager
def _syncs_forbidden() -> Iterator[None]:
    """Any synchronising CUDA call in the block raises RuntimeError."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def _syncs_counted() -> Iterator[list[str]]:
    """Collects one entry per synchronising CUDA call made in the block."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Only the reports of a synchronising call (the mode also warns that it is a prototype).
    found.extend(str(w.message) for w in caught if "called a synchronizing" in str(w.message))


# The model, data and the loop by hand ----------------------------------------------------


def _mlp(device: torch.device, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(dropout), nn.Linear(64, 4))
    return model.to(device)


def _batches(n: int, device: torch.device, nan_at: int | None = None) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    batches = [
        (2 * torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)
    ]
    if nan_at is not None:
        batches[nan_at][0][1, 3] = float("nan")
    return [to_device(b, device) for b in batches]


def _loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _adamw(model: nn.Module, fused: bool = True) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, foreach=not fused, fused=fused
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))


def _by_hand(model, opt, sched, batches, *, k, dtype=None, scaler=None, guard=True) -> dict:
    """tests/reference.py's loop on the batches' device: clip by MAX_NORM, guard, scaler."""
    device = batches[0][0].device
    seen: dict[str, list] = {"updated": [], "norms": [], "rejected": [], "overflow": []}
    for start in range(0, len(batches), k):
        window_loss = torch.zeros((), device=device)
        for batch in batches[start : start + k]:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = _loss_fn(model, batch)
            window_loss += loss.detach().float()
            if k > 1:
                loss = loss / k
            (scaler.scale(loss) if scaler is not None else loss).backward()
            seen["updated"].append(False)
        if scaler is not None:
            scaler.unscale_(opt)
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        seen["norms"].append(norm.detach().clone())
        finite = not guard or (
            bool(torch.isfinite(window_loss)) and (scaler is not None or bool(torch.isfinite(norm)))
        )
        seen["rejected"].append(not finite)
        stepped = finite
        if finite:
            scaler.step(opt) if scaler is not None else opt.step()
        overflow = False
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.update()
            overflow = finite and scaler.get_scale() < scale
            stepped = stepped and not overflow
        seen["overflow"].append(overflow)
        opt.zero_grad(set_to_none=True)
        if stepped:
            sched.step()
            seen["updated"][-1] = True
    return seen


def _assert_bitwise(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, where
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{where}: {a!r} vs {b!r}"
        assert torch.equal(a.isnan(), b.isnan()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_bitwise(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _compare(
    device: torch.device,
    *,
    amp: str | None,
    fused: bool = True,
    guard: bool = True,
    nan_at: int | None = None,
    scaler: Callable[[], torch.amp.GradScaler] | None = None,
    windows: int = 4,
) -> dict:
    """Train toolkit's step and the loop by hand; assert they ended bitwise the same."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[amp]
    batches = _batches(K * windows, device, nan_at)
    model = _mlp(device)
    opt, sched = _adamw(model, fused)
    decorators = [accumulate(micro_batches=K), clip(max_norm=MAX_NORM)]
    if amp is not None:
        decorators.append(amp_wrap(dtype=amp, scaler=scaler() if scaler else None))
    if guard:
        decorators.append(guard_nonfinite(max_retries=3))
    step = compose(*decorators)(make_step(_loss_fn))
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    outs = []
    for batch in batches:
        state, out = step(state, batch)
        outs.append(out)

    ref_model = _mlp(device)
    ref_opt, ref_sched = _adamw(ref_model, fused)
    ref_scaler = None
    if amp == "fp16":
        ref_scaler = scaler() if scaler else torch.amp.GradScaler(device.type)
    seen = _by_hand(
        ref_model, ref_opt, ref_sched, batches, k=K, dtype=dtype, scaler=ref_scaler, guard=guard
    )

    _assert_bitwise(model.state_dict(), ref_model.state_dict(), "model")
    _assert_bitwise(opt.state_dict(), ref_opt.state_dict(), "optimizer")
    _assert_bitwise(sched.state_dict(), ref_sched.state_dict(), "scheduler")
    if ref_scaler is not None:
        assert state.scaler is not None
        _assert_bitwise(state.scaler.state_dict(), ref_scaler.state_dict(), "scaler")
    assert [o.updated for o in outs] == seen["updated"]
    closed = [o for o in outs if o.closed]
    assert [o.nonfinite for o in closed] == seen["rejected"]
    assert [o.overflow for o in closed] == seen["overflow"]
    _assert_bitwise([o.grad_norm for o in closed], seen["norms"], "grad_norm")
    assert state.step == sum(seen["updated"])
    assert any(bool(n > MAX_NORM) for n in seen["norms"])  # clipping clipped
    assert all(p.device == device for p in model.parameters())
    return seen


# 1-5: the step against the loop by hand ---------------------------------------------------


def test_fp16_grad_scaler_and_fused_adamw_match_the_loop_by_hand_bitwise(
    device: torch.device, deterministic: None
) -> None:
    seen = _compare(device, amp="fp16")
    assert all(seen["updated"][K - 1 :: K])


def test_fp16_first_window_overflow_is_skipped_as_the_scaler_decides(
    device: torch.device, deterministic: None
) -> None:
    def scaler() -> torch.amp.GradScaler:  # overflows at once, then backs off to 2**16
        return torch.amp.GradScaler(device.type, init_scale=2.0**40, backoff_factor=2.0**-24)

    seen = _compare(device, amp="fp16", scaler=scaler, windows=5)
    assert seen["overflow"][0] and sum(seen["updated"]) == 4


def test_bf16_autocasts_on_cuda_and_matches_the_loop_by_hand_bitwise(
    device: torch.device, deterministic: None
) -> None:
    dtypes = []

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        out = model(batch[0])
        dtypes.append(out.dtype)
        return F.mse_loss(out.float(), batch[1])

    model = _mlp(device)
    state = TrainState(model=model, optimizer=_adamw(model)[0])
    amp_wrap(make_step(loss_fn), dtype="bf16")(state, _batches(1, device)[0])
    assert dtypes == [torch.bfloat16]
    _compare(device, amp="bf16")


def test_float32_with_foreach_adamw_matches_the_loop_by_hand_bitwise(
    device: torch.device, deterministic: None
) -> None:
    _compare(device, amp=None, fused=False)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_a_non_finite_window_is_rejected_as_by_hand(
    device: torch.device, deterministic: None, amp: str
) -> None:
    seen = _compare(device, amp=amp, nan_at=K + 1, windows=5)
    assert seen["rejected"] == [False, True, False, False, False]
    assert sum(seen["updated"]) == 4


# 6-7: host syncs ---------------------------------------------------------------------------


def test_the_sync_checks_see_a_synchronising_call(device: torch.device) -> None:
    # Without this, a counter that never counts would pass the test below.
    x = torch.ones(3, device=device)
    with _syncs_counted() as syncs:
        x.sum().item()
    assert len(syncs) == 1, syncs
    with pytest.raises(RuntimeError), _syncs_forbidden():
        x.sum().item()


@pytest.mark.parametrize(
    ("amp", "guard"), [("fp16", True), ("bf16", True), ("bf16", False), (None, True)]
)
def test_no_host_sync_inside_a_window_and_at_most_one_per_update(
    device: torch.device, amp: str | None, guard: bool
) -> None:
    model = _mlp(device)
    opt, _ = _adamw(model, fused=True)  # fused: the scaler's found_inf goes into the kernel
    decorators = [accumulate(micro_batches=K), clip(max_norm=MAX_NORM)]
    decorators += [amp_wrap(dtype=amp)] if amp else []
    decorators += [guard_nonfinite()] if guard else []
    step = compose(*decorators)(make_step(_loss_fn))
    state = TrainState(model=model, optimizer=opt)
    batches = _batches(3 * K, device)
    for batch in batches[:K]:  # a first window creates the optimizer's and scaler's state
        state, _ = step(state, batch)
    per_update = []
    for start in (K, 2 * K):
        with _syncs_forbidden():
            for batch in batches[start : start + K - 1]:
                state, out = step(state, batch)
                assert not out.closed
        with _syncs_counted() as syncs:
            state, out = step(state, batches[start + K - 1])
        assert out.closed and out.updated
        per_update.append(len(syncs))
    assert max(per_update) <= 1, per_update
    assert state.step == 3


# 8-9: checkpoints --------------------------------------------------------------------------


def _fp16_state(device: torch.device) -> tuple[TrainState, Any]:
    model = _mlp(device, dropout=0.1)
    opt, sched = _adamw(model)
    step = compose(accumulate(micro_batches=2), amp_wrap(dtype="fp16"), guard_nonfinite())(
        make_step(_loss_fn)
    )
    return TrainState(model=model, optimizer=opt, scheduler=sched), step


def test_a_checkpoint_of_cuda_state_round_trips_with_the_cuda_rng(
    device: torch.device, tmp_path: pathlib.Path
) -> None:
    state, step = _fp16_state(device)
    for batch in _batches(6, device):
        state, _ = step(state, batch)
    assert state.step == 3 and state.scaler is not None
    save_checkpoint(state, tmp_path / "ckpt")
    after_save = torch.rand(5, device=device)

    torch.manual_seed(123)  # another CUDA RNG state, which the load must replace
    like, _ = _fp16_state(device)  # no scaler yet: the load creates one for the device
    loaded = load_checkpoint(tmp_path / "ckpt", like=like)
    assert torch.equal(torch.rand(5, device=device), after_save)
    _assert_bitwise(loaded.model.state_dict(), state.model.state_dict(), "model")
    _assert_bitwise(loaded.optimizer.state_dict(), state.optimizer.state_dict(), "optimizer")
    _assert_bitwise(loaded.scaler.state_dict(), state.scaler.state_dict(), "scaler")
    assert loaded.scheduler.state_dict() == state.scheduler.state_dict()
    assert loaded.step == 3 and loaded.scaler.get_scale() == state.scaler.get_scale()
    assert all(t.device == device for t in loaded.optimizer.state_dict()["state"][0].values())


def test_a_resumed_run_ends_bitwise_as_an_uninterrupted_one(
    device: torch.device, deterministic: None, tmp_path: pathlib.Path
) -> None:
    batches = _batches(16, device)

    def train(folder: pathlib.Path, max_steps: int) -> TrainState:
        state, step = _fp16_state(device)  # dropout: draws from the CUDA RNG
        return run(
            step, state, batches, max_steps=max_steps, plugins=[checkpoints(folder, every=2)]
        )

    torch.manual_seed(7)
    whole = train(tmp_path / "a", 8)
    torch.manual_seed(7)
    train(tmp_path / "b", 4)
    torch.manual_seed(99)  # a restarted process: its own RNG until the resume restores it
    resumed = train(tmp_path / "b", 8)
    assert resumed.step == whole.step == 8
    _assert_bitwise(resumed.model.state_dict(), whole.model.state_dict(), "model")
    _assert_bitwise(resumed.optimizer.state_dict(), whole.optimizer.state_dict(), "optimizer")
    _assert_bitwise(resumed.scaler.state_dict(), whole.scaler.state_dict(), "scaler")


# 10-12: plugins and compile -----------------------------------------------------------------


def test_ema_on_cuda_follows_the_closed_form(device: torch.device) -> None:
    model = _mlp(device)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    history = []

    def record(event: Any) -> None:
        if event.kind == "step":
            history.append({n: p.detach().clone() for n, p in model.named_parameters()})

    state = TrainState(model=model, optimizer=_adamw(model)[0])
    state = run(make_step(_loss_fn), state, _batches(5, device), max_steps=5,
                plugins=[ema(decay=0.9, warmup=False), record])  # fmt: skip
    expected = start
    for live in history:
        expected = {n: 0.9 * expected[n] + 0.1 * live[n] for n in expected}
    averaged = state.extras["ema"]["params"]
    assert len(history) == 5 and averaged.keys() == expected.keys()
    for name, tensor in averaged.items():
        assert tensor.device == device
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-6)


def test_peak_memory_reads_cuda_allocator_statistics(device: torch.device) -> None:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        scratch = torch.ones(2**26, device=device)  # 256 MiB held during the forward
        return _loss_fn(model, batch) + 0 * scratch[0]

    model = _mlp(device)
    state = TrainState(model=model, optimizer=_adamw(model)[0])
    state = run(make_step(loss_fn), state, _batches(2, device), max_steps=2,
                plugins=[peak_memory(every=1)])  # fmt: skip
    peak = state.metrics["memory"]["values"]["peak_gib"] * 2**30
    # What the allocator holds now (model, batches, cuBLAS workspaces) plus the scratch and
    # a little for activations: the tensors' peak, not the process's resident set.
    held = torch.cuda.memory_allocated(device)
    assert 2**28 <= peak <= held + 2**28 + 2**25, (peak, held)


@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores")  # inductor's TF32 advice
@pytest.mark.filterwarnings("ignore::UserWarning:torch._inductor.*")
@pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo.*")
def test_a_compiled_model_under_the_step_matches_a_compiled_loop_by_hand(
    device: torch.device,
) -> None:
    batches = _batches(4 * K, device)
    model = _mlp(device)
    opt, sched = _adamw(model)
    step = compose(accumulate(micro_batches=K), clip(max_norm=MAX_NORM))(make_step(_loss_fn))
    state = TrainState(model=torch.compile(model), optimizer=opt, scheduler=sched)
    for batch in batches:
        state, _ = step(state, batch)

    ref_model = _mlp(device)
    ref_opt, ref_sched = _adamw(ref_model)
    seen = _by_hand(torch.compile(ref_model), ref_opt, ref_sched, batches, k=K, guard=False)
    assert state.step == sum(seen["updated"]) == 4
    torch.testing.assert_close(model.state_dict(), ref_model.state_dict(), rtol=1e-5, atol=1e-6)


# 13-16: evaluation, to_device, DDP over NCCL --------------------------------------------------


def _eval_fn(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x).float()
    return {"mse": F.mse_loss(out, y), "mean": out.mean()}


def _by_hand_means(model: nn.Module, data: list[Any]) -> dict[str, float]:
    sums: dict[str, float] = {}
    with torch.no_grad():
        for batch in data:
            for name, value in _eval_fn(model, batch).items():
                sums[name] = sums.get(name, 0.0) + value.item() * len(batch[0])
    return {name: total / sum(len(b[0]) for b in data) for name, total in sums.items()}


def _uneven(device: torch.device) -> list[Any]:
    g = torch.Generator().manual_seed(2)
    return [to_device((torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)), device)
            for n in (5, 8, 3)]  # fmt: skip


def test_evaluate_on_cuda_gives_the_count_weighted_means(device: torch.device) -> None:
    model = _mlp(device, dropout=0.5).train()
    result = evaluate(_eval_fn, model, _uneven(device))
    assert model.training  # restored
    expected = _by_hand_means(model.eval(), _uneven(device))
    assert result == pytest.approx(expected, rel=1e-5)


def test_validate_on_cuda_evaluates_the_trained_weights(device: torch.device) -> None:
    model = _mlp(device)
    state = TrainState(model=model, optimizer=_adamw(model)[0])
    data = _uneven(device)
    state = run(make_step(_loss_fn), state, _batches(4, device), max_steps=4,
                plugins=[validate(_eval_fn, data, every=2, monitor="mse")])  # fmt: skip
    assert state.metrics["val"]["step"] == 4
    assert state.metrics["val"]["values"] == pytest.approx(_by_hand_means(model, data), rel=1e-5)


def test_to_device_copies_pinned_batches_without_a_host_sync(device: torch.device) -> None:
    batch = {"x": torch.randn(64, 16).pin_memory(), "y": [torch.arange(64).pin_memory()], "n": 3}
    with _syncs_forbidden():
        moved = to_device(batch, device, non_blocking=True)
    assert moved["x"].device == device and moved["y"][0].device == device and moved["n"] == 3
    assert torch.equal(moved["x"].cpu(), batch["x"]) and torch.equal(
        moved["y"][0].cpu(), batch["y"][0]
    )


JOB = """
import os, signal, sys
import torch
from torch.nn.parallel import DistributedDataParallel
from toolkit import TrainState, accumulate, clip, compose, guard_nonfinite, make_step, run
from toolkit.distributed import process_group
from toolkit.plugins import checkpoints

device, folder, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])

def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

def signal_self(event):
    if event.kind == "start":
        print("start", event.state.step, flush=True)
    if event.kind == "step" and event.state.step == kill_at:
        os.kill(os.getpid(), signal.SIGUSR1)

with process_group(seed=0, device=device) as launch:
    print("backend", launch.backend, flush=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(launch.device)
    model = DistributedDataParallel(model, device_ids=launch.device_ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=launch.device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g).to(launch.device),
             torch.randn(8, 4, generator=g).to(launch.device)) for _ in range(40)]
    step = compose(accumulate(micro_batches=2), clip(max_norm=1.0), guard_nonfinite())(
        make_step(loss_fn))
    state = TrainState(model=model, optimizer=opt)
    state = run(step, state, data, max_steps=10,
                plugins=[signal_self, checkpoints(folder, every=100)])
    print("finished", state.step, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(device: torch.device, folder: pathlib.Path, kill_at: int) -> subprocess.CompletedProcess:
    script = folder.parent / "job.py"
    script.write_text(textwrap.dedent(JOB))
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]  # keep the caller's (optree there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}  # fmt: skip
    command = [sys.executable, str(script), str(device), str(folder), str(kill_at)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


def test_ddp_over_nccl_saves_on_a_signal_exits_and_resumes(
    device: torch.device, tmp_path: pathlib.Path
) -> None:
    folder = tmp_path / "ckpt"
    first = _job(device, folder, kill_at=3)
    log = f"{first.stdout}\n{first.stderr}"
    assert first.returncode == 128 + signal.SIGUSR1, log
    if device.type == "cuda":
        assert "backend nccl" in first.stdout, log  # setup() asks for NCCL alone
    assert "finished" not in first.stdout, log
    assert [info.step for info in list_checkpoints(folder)] == [3], log

    second = _job(device, folder, kill_at=-1)
    log = f"{second.stdout}\n{second.stderr}"
    assert second.returncode == 0, log
    assert "start 3" in second.stdout and "finished 10" in second.stdout, log
    assert [info.step for info in list_checkpoints(folder)] == [10], log
