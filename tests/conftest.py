"""Shared test settings: one CPU thread (2 shared cores), deterministic seeds."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# Optional packages and the extra that installs each. The suite runs with the core and the
# examples extra alone: a test that fails only because one of these is missing (its import,
# or toolkit's ImportError naming the extra, chained from it) is reported as skipped, with
# the package and the extra. With everything installed (make test) this never applies.
EXTRAS = {
    "tensorboard": "loggers", "wandb": "loggers", "PIL": "loggers", "matplotlib": "plot",
    "transformers": "hf", "peft": "hf", "accelerate": "compare", "lightning": "compare",
    "hydra": "hydra", "omegaconf": "hydra",
}  # fmt: skip


def missing_extra(error: BaseException | None) -> str | None:
    """The optional package whose absence caused ``error``, if that is its cause."""
    while error is not None:
        name = getattr(error, "name", None) or ""
        if isinstance(error, ModuleNotFoundError) and name.split(".")[0] in EXTRAS:
            return name.split(".")[0]
        error = error.__cause__ or error.__context__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    package = missing_extra(call.excinfo.value) if report.failed and call.excinfo else None
    if package is not None:
        reason = f"Skipped: needs {package} (pip install -e '.[{EXTRAS[package]}]')"
        report.outcome, report.longrepr = "skipped", (str(item.path), item.location[1] or 0, reason)
    return report
