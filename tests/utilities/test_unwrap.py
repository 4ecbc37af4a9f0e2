"""unwrap: peel torch.compile, DDP, DataParallel and AveragedModel in any nesting order."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim.swa_utils import AveragedModel

from toolkit import unwrap


class Net(nn.Module):
    """A plain model with a custom method, the kind unwrap is used to reach."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def describe(self) -> str:
        return "net"


def compiled(module: nn.Module) -> nn.Module:
    # backend="eager": torch.compile only builds the OptimizedModule wrapper here (nothing is
    # compiled until it is called, which these tests never do), and the eager backend keeps
    # inductor, with its import-time DeprecationWarning from torch.utils.mkldnn, out of it.
    return torch.compile(module, backend="eager")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory: pytest.TempPathFactory):
    """A single-process gloo group, enough for DistributedDataParallel on CPU."""
    if dist.is_initialized():
        yield None  # a group someone else set up: use it, leave it to them
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("dist") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield None
    finally:
        dist.destroy_process_group()


def test_plain_module_comes_back_as_is() -> None:
    net = Net()
    assert unwrap(net) is net
    assert unwrap(net, keep_compile=True) is net


def test_compile_wrapper_is_peeled() -> None:
    net = Net()
    wrapper = compiled(net)
    assert type(wrapper).__name__ == "OptimizedModule"
    assert unwrap(wrapper) is net
    assert unwrap(wrapper).describe() == "net"


def test_keep_compile_returns_the_compiled_wrapper() -> None:
    net = Net()
    wrapper = compiled(net)
    assert unwrap(wrapper, keep_compile=True) is wrapper
    # wrappers outside the compiled one are still peeled
    # (AveragedModel holds a deep copy: a compiled wrapper of its own, not the original.)
    kept = unwrap(DataParallel(AveragedModel(wrapper)), keep_compile=True)
    assert type(kept).__name__ == "OptimizedModule" and kept is not wrapper
    assert type(unwrap(DataParallel(AveragedModel(wrapper)))) is Net
    outer = DataParallel(DataParallel(wrapper))
    assert unwrap(outer, keep_compile=True) is wrapper
    assert unwrap(outer) is net


def test_in_place_compile_is_not_a_wrapper() -> None:
    net = Net()
    net.compile(backend="eager")
    assert unwrap(net) is net
    assert unwrap(DataParallel(net), keep_compile=True) is net


def test_data_parallel_on_cpu_is_peeled() -> None:
    net = Net()
    assert unwrap(DataParallel(net)) is net
    assert unwrap(DataParallel(DataParallel(net))) is net


def test_averaged_model_gives_the_averaged_copy() -> None:
    net = Net()
    averaged = AveragedModel(net)
    inner = unwrap(averaged)
    assert inner is averaged.module
    assert inner is not net  # AveragedModel keeps its own (deep) copy
    assert type(inner) is Net
    assert all(torch.equal(a, b) for a, b in zip(inner.parameters(), net.parameters()))


@pytest.mark.usefixtures("process_group")
def test_distributed_data_parallel_is_peeled() -> None:
    net = Net()
    ddp = DistributedDataParallel(net)
    assert unwrap(ddp) is net
    assert unwrap(compiled(ddp)) is net
    assert unwrap(DistributedDataParallel(compiled(net))) is net
    assert list(unwrap(ddp).state_dict()) == ["linear.weight", "linear.bias"]


WRAPPERS = ("compile", "ddp", "data_parallel", "averaged")


def _chains() -> st.SearchStrategy[list[str]]:
    # torch.compile of an OptimizedModule returns a function, not a module: never compile twice
    # in a row.
    return st.lists(st.sampled_from(WRAPPERS), max_size=5).filter(
        lambda chain: ("compile", "compile") not in itertools.pairwise(chain)
    )


@pytest.mark.usefixtures("process_group")
@settings(max_examples=40, deadline=None)
@given(chain=_chains())
def test_any_nesting_unwraps_to_the_plain_module(chain: list[str]) -> None:
    """chain lists wrappers innermost first; the reference follows the objects it built."""
    net = Net()
    module: nn.Module = net
    last_compiled = None  # the outermost OptimizedModule, while no AveragedModel copied it
    copied = False  # an AveragedModel deep-copied everything inside it
    for name in chain:
        if name == "compile":
            module = compiled(module)
            last_compiled = module
        elif name == "ddp":
            module = DistributedDataParallel(module)
        elif name == "data_parallel":
            module = DataParallel(module)
        else:
            module = AveragedModel(module)
            copied = True
            last_compiled = None

    inner = unwrap(module)
    assert type(inner) is Net
    if not copied:
        assert inner is net

    kept = unwrap(module, keep_compile=True)
    if "compile" not in chain:
        assert kept is inner
    else:
        assert type(kept).__name__ == "OptimizedModule"
        if last_compiled is not None:
            assert kept is last_compiled
        assert type(unwrap(kept)) is Net


@pytest.mark.parametrize(
    "value", [None, {"weight": torch.ones(1)}, [nn.Linear(1, 1)], torch.ones(2), "model"]
)
def test_non_module_raises_type_error(value: object) -> None:
    message = r"must be a torch\.nn\.Module; got a \w+\. Pass state\.model"
    with pytest.raises(TypeError, match=message):
        unwrap(value)  # type: ignore[arg-type]


def test_optimizer_is_rejected_by_name() -> None:
    optimizer = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="got a SGD"):
        unwrap(optimizer)  # type: ignore[arg-type]


@pytest.mark.slow  # starts Python processes: seconds each
def test_unwrap_does_not_import_dynamo() -> None:
    # torch._dynamo is a slow import; unwrap looks OptimizedModule up only when it is loaded.
    code = (
        "import sys, torch, toolkit\n"
        "net = torch.nn.Linear(1, 1)\n"
        "assert toolkit.unwrap(torch.nn.DataParallel(net)) is net\n"
        "assert 'torch._dynamo' not in sys.modules, 'unwrap imported torch._dynamo'\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
