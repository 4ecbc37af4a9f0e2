"""The coming-from guides' scripts train the same job the library's way and toolkit's way,
and get the same weights: bitwise where the arithmetic is the same (Accelerate, Fabric), to
rounding where HF Trainer sums its token-averaged loss in another order.
"""

from __future__ import annotations

import importlib.util
import pathlib
from types import ModuleType

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [name for name in a if not torch.equal(a[name], b[name])]
    assert not unequal, f"not bitwise equal: {unequal}"


def _moved(script: ModuleType, weights: dict[str, torch.Tensor]) -> float:
    start = script.make_job()[0].state_dict()
    return script.max_difference(start, weights)


def test_accelerate_and_toolkit_train_bitwise_alike() -> None:
    pytest.importorskip("accelerate")
    script = _script("compare_accelerate")
    accelerate_weights, accelerate_losses = script.train_with_accelerate()
    toolkit_weights, toolkit_losses = script.train_with_toolkit()
    assert len(toolkit_losses) == script.UPDATES * script.MICRO_BATCHES
    assert toolkit_losses == accelerate_losses
    _assert_bitwise(accelerate_weights, toolkit_weights)
    assert _moved(script, toolkit_weights) > 1e-2  # it trained


@pytest.mark.slow  # importing lightning takes 7 s of CPU
def test_fabric_and_toolkit_train_bitwise_alike_under_bf16_autocast() -> None:
    pytest.importorskip("lightning")
    script = _script("compare_fabric")
    fabric_weights, fabric_losses = script.train_with_fabric()
    toolkit_weights, toolkit_losses = script.train_with_toolkit()
    assert len(toolkit_losses) == script.UPDATES * script.MICRO_BATCHES
    assert toolkit_losses == fabric_losses
    _assert_bitwise(fabric_weights, toolkit_weights)
    assert _moved(script, toolkit_weights) > 1e-2


@pytest.mark.slow  # importing transformers' Trainer takes several seconds
def test_hf_trainer_token_mean_matches_loss_sum_where_a_mean_of_means_does_not() -> None:
    pytest.importorskip("accelerate")  # Trainer needs it
    pytest.importorskip("transformers", minversion="5.0")  # train_sampling_strategy
    script = _script("compare_hf_trainer")
    hf_weights = script.train_with_hf_trainer()
    assert script.max_difference(hf_weights, script.train_with_toolkit()) < 1e-6
    # The check can tell: a mean per micro-batch averaged over the window is far off.
    assert (
        script.max_difference(hf_weights, script.train_with_toolkit(loss_fn=script.mean_of_means))
        > 1e-3
    )
    assert _moved(script, hf_weights) > 1e-3
