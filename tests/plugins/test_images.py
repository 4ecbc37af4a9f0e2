"""Images: one pixel rule for every sink; PNG files, TensorBoard and W&B read back; log_images."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from toolkit import TrainState, make_step, run
from toolkit.plugins import _images as images_module
from toolkit.plugins import checkpoints
from toolkit.plugins._images import log_images
from toolkit.plugins._metrics import log_metrics
from toolkit.plugins._sinks import Sink, jsonl, pixels, png_dir, tensorboard, wandb


def EventAccumulator(*args: Any, **kwargs: Any) -> Any:  # TensorBoard's reader, imported here
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(*args, **kwargs)


def _png(path: Path) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as picture:
        data = torch.tensor(list(picture.tobytes()), dtype=torch.uint8)
        channels = len(picture.getbands())
        return data.reshape(picture.height, picture.width, channels)


def _random_pixels(*shape: int) -> torch.Tensor:
    return torch.randint(
        0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )


# ----------------------------------------------------------------------- pixel rules


def test_chw_hwc_and_grey_tensors_become_hwc_pixels() -> None:
    chw = _random_pixels(3, 5, 7)
    assert torch.equal(pixels("t", "a", chw), chw.permute(1, 2, 0))
    hwc = _random_pixels(5, 7, 4)  # first dimension 5: not channels, so HWC
    assert torch.equal(pixels("t", "a", hwc), hwc)
    grey = _random_pixels(5, 7)
    assert torch.equal(pixels("t", "a", grey), grey)
    assert torch.equal(pixels("t", "a", grey.unsqueeze(0)), grey)  # (1, H, W): grey too
    # The rule for the ambiguous case: a first dimension of 1, 3 or 4 is channels.
    assert pixels("t", "a", _random_pixels(3, 4, 3)).shape == (4, 3, 3)


def test_float_intensities_are_clamped_and_rounded_to_pixels() -> None:
    values = torch.tensor([[-0.5, 0.0, 0.499 / 255, 0.5 / 255 + 1e-6, 0.5, 1.0, 2.0]])
    assert pixels("t", "a", values).flatten().tolist() == [0, 0, 0, 1, 128, 255, 255]
    half = torch.full((1, 2, 2), 0.5, dtype=torch.float16)
    assert pixels("t", "a", half).flatten().tolist() == [128] * 4


@pytest.mark.parametrize(
    ("image", "error", "match"),
    [
        (
            [[0, 1]],
            TypeError,
            r"t: image 'a' must be a matplotlib figure, or a tensor of uint8 pixels or float "
            r"intensities in \[0, 1\]; got <class 'list'>",
        ),
        (
            torch.zeros(2, 2, dtype=torch.int64),
            TypeError,
            r"must be a matplotlib figure, or a tensor of uint8 pixels .*; got torch.int64",
        ),
        (torch.zeros(5, 6, 2), ValueError, r"\(H, W\), \(C, H, W\) or \(H, W, C\) .*\(5, 6, 2\)"),
        (torch.zeros(1, 3, 4, 4), ValueError, r"shape must be .*; got \(1, 3, 4, 4\)"),
        (torch.zeros(3, 0, 4), ValueError, r"H, W > 0; got \(0, 4, 3\)"),
        (
            torch.tensor([[0.5, float("nan")]]),
            ValueError,
            r"image 'a' must be intensities in \[0, 1\]; got 'NaN or infinite values'",
        ),
    ],
)
def test_bad_images_are_named(image: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        pixels("t", "a", image)


def test_a_matplotlib_figure_is_drawn_to_its_rgba_pixels() -> None:
    from matplotlib.figure import Figure  # the plot extra, which make installs

    figure = Figure(figsize=(2, 1), dpi=20)  # no pyplot: a canvas that cannot draw itself
    figure.add_axes((0, 0, 1, 1)).imshow([[0.0, 1.0]], cmap="gray")
    drawn = pixels("t", "plot", figure)
    assert drawn.shape == (20, 40, 4)
    assert drawn[10, 5].tolist() == [0, 0, 0, 255] and drawn[10, 35].tolist() == [255] * 4


# ---------------------------------------------------------------------------- png_dir


def test_png_dir_writes_each_image_read_back_pixel_for_pixel(tmp_path: Path) -> None:
    rgb, rgba, grey = _random_pixels(3, 6, 5), _random_pixels(6, 5, 4), _random_pixels(6, 5)
    floats = torch.rand(1, 6, 5, generator=torch.Generator().manual_seed(1))
    sink = png_dir(tmp_path)
    sink.start(0)
    sink.write(100, {"train/loss": 1.0})  # metrics are not its concern
    sink.images(100, {"rgb": rgb, "val/rgba": rgba, "grey": grey, "floats": floats})
    sink.close()
    assert torch.equal(_png(tmp_path / "rgb" / "step_000100.png"), rgb.permute(1, 2, 0))
    assert torch.equal(_png(tmp_path / "val" / "rgba" / "step_000100.png"), rgba)
    assert torch.equal(_png(tmp_path / "grey" / "step_000100.png"), grey.unsqueeze(-1))
    expected = (floats * 255).round().to(torch.uint8).permute(1, 2, 0)
    assert torch.equal(_png(tmp_path / "floats" / "step_000100.png"), expected)
    assert not list(tmp_path.rglob(".step_*"))  # no temporary file left


@pytest.mark.parametrize("name", ["", "../up", "/abs", "a//b", "a/./b", 3])
def test_png_dir_refuses_names_that_are_not_relative_paths(tmp_path: Path, name: Any) -> None:
    sink = png_dir(tmp_path / "png")
    with pytest.raises(ValueError, match=r"png_dir: an image name must be a relative path"):
        sink.images(1, {name: torch.zeros(2, 2)})
    assert not list(tmp_path.rglob("*.png"))


def test_png_dir_follows_a_resume_and_says_what_a_fresh_run_does(tmp_path: Path) -> None:
    crashed = png_dir(tmp_path)
    crashed.start(0)
    for step in (2, 4, 6):
        crashed.images(step, {"a": torch.zeros(2, 2), "b/c": torch.ones(2, 2)})
    crashed.close()
    png_dir(tmp_path).start(4)  # resumed at 4: the images of 6 came after the checkpoint
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "step_000002.png",
        "step_000004.png",
    ]
    assert sorted(p.name for p in (tmp_path / "b" / "c").iterdir())[-1] == "step_000004.png"
    with pytest.raises(
        FileExistsError,
        match=r"png_dir: '.*' already holds 4 step_\*.png files of another run, .*Pass "
        r"png_dir\(path, existing='replace'\)",
    ):
        png_dir(tmp_path).start(0)
    png_dir(tmp_path, existing="append").start(0)
    assert len(list(tmp_path.rglob("*.png"))) == 4
    png_dir(tmp_path, existing="replace").start(0)
    assert list(tmp_path.rglob("*.png")) == []
    with pytest.raises(ValueError, match=r"png_dir: existing must be one of \['refuse', 'replace'"):
        png_dir(tmp_path, existing="overwrite")
    with pytest.raises(TypeError, match=r"png_dir: path must be a path"):
        png_dir(None)  # type: ignore[arg-type]


def test_png_dir_without_pillow_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(
        ImportError,
        match=r"png_dir\(\) needs pillow and numpy: pip install pillow numpy "
        r'\(or pip install -e "\.\[loggers\]" from a checkout of toolkit\)',
    ):
        png_dir("images")


# ------------------------------------------------------------------- tensorboard, wandb


def test_tensorboard_records_images_read_back_pixel_for_pixel(tmp_path: Path) -> None:
    rgb, grey = _random_pixels(3, 4, 6), _random_pixels(4, 6)
    sink = tensorboard(tmp_path)
    sink.start(0)
    sink.images(5, {"val/rgb": rgb, "grey": grey})
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    (event,) = events.Images("val/rgb")
    assert event.step == 5
    from PIL import Image

    with Image.open(io.BytesIO(event.encoded_image_string)) as picture:
        assert picture.mode == "RGB"
        read = torch.tensor(list(picture.tobytes()), dtype=torch.uint8).reshape(4, 6, 3)
    assert torch.equal(read, rgb.permute(1, 2, 0))
    (event,) = events.Images("grey")
    with Image.open(io.BytesIO(event.encoded_image_string)) as picture:
        read = torch.tensor(list(picture.convert("L").tobytes()), dtype=torch.uint8)
    assert torch.equal(read.reshape(4, 6), grey)


def test_wandb_records_images_as_wandb_image(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    logged: list[tuple[int, dict]] = []

    class Run:
        id = "r1"

        def log(self, data: dict, step: int) -> None:
            logged.append((step, data))

        def finish(self) -> None:
            pass

    class FakeImage:
        def __init__(self, data: Any) -> None:
            self.data = data

    fake = types.SimpleNamespace(init=lambda **kw: Run(), Image=FakeImage)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    rgb, grey = _random_pixels(3, 4, 6), _random_pixels(4, 6)
    sink = wandb(dir=str(tmp_path))
    sink.start(0)
    sink.images(3, {"rgb": rgb, "grey": grey})
    sink.close()
    ((step, data),) = logged
    assert step == 3 and set(data) == {"rgb", "grey"}
    assert torch.equal(torch.from_numpy(data["rgb"].data), rgb.permute(1, 2, 0))
    assert torch.equal(torch.from_numpy(data["grey"].data), grey)  # (H, W): what W&B takes


# ------------------------------------------------------------------------- log_images


def _state() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _step_image(state: TrainState) -> dict[str, torch.Tensor]:
    """An image that says which step made it, and the model's weights as its second row."""
    weights = state.model.weight.detach().sigmoid().reshape(1, 3)
    return {"probe": torch.cat([torch.full((1, 3), state.step / 100), weights])}


def _expected(step: int, weight: torch.Tensor) -> torch.Tensor:
    rows = torch.cat([torch.full((1, 3), step / 100), weight.sigmoid().reshape(1, 3)])
    return (rows * 255).round().to(torch.uint8).unsqueeze(-1)


DATA = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(10)]
LOSS = make_step(lambda m, b: m(b).square().mean())


def test_log_images_records_at_due_updates_and_at_the_end(tmp_path: Path) -> None:
    weights: dict[int, torch.Tensor] = {}

    def watch(event: Any) -> None:
        if event.kind == "step":
            weights[event.state.step] = event.state.model.weight.detach().clone()

    plugin = log_images(_step_image, every=3, sinks=[png_dir(tmp_path)])
    state = run(LOSS, _state(), DATA, max_steps=7, plugins=[watch, plugin])
    assert state.step == 7
    files = sorted(p.name for p in (tmp_path / "probe").iterdir())
    assert files == ["step_000003.png", "step_000006.png", "step_000007.png"]
    for step in (3, 6, 7):
        png = _png(tmp_path / "probe" / f"step_{step:06d}.png")
        assert torch.equal(png, _expected(step, weights[step]))


def test_log_images_at_the_end_only_when_the_last_update_had_none(tmp_path: Path) -> None:
    seen: list[int] = []
    sink = Sink(print, lambda: None, images=lambda step, images: seen.append(step))
    run(LOSS, _state(), DATA, max_steps=6, plugins=[log_images(_step_image, 3, sinks=sink)])
    assert seen == [3, 6]


def test_log_images_resumed_run_rewrites_the_steps_past_its_checkpoint(tmp_path: Path) -> None:
    images = tmp_path / "images"

    def plugins(crash_after: int | None = None) -> list[Any]:
        def crash(event: Any) -> None:
            if event.kind == "step" and event.state.step == crash_after:
                raise RuntimeError("preempted")

        return [
            checkpoints(tmp_path / "ckpt", every=4, at_end=False),
            log_images(_step_image, every=2, sinks=[png_dir(images)]),
            crash,
        ]

    with pytest.raises(RuntimeError, match="preempted"):
        run(LOSS, _state(), DATA, max_steps=10, plugins=plugins(crash_after=7))
    names = sorted(p.name for p in (images / "probe").iterdir())
    assert names == ["step_000002.png", "step_000004.png", "step_000006.png"]  # none at 7
    state = run(LOSS, _state(), DATA, max_steps=5, plugins=plugins())  # resumed at 4
    assert state.step == 5
    names = sorted(p.name for p in (images / "probe").iterdir())
    assert names == ["step_000002.png", "step_000004.png", "step_000005.png"]  # 6 is gone


def test_log_images_only_on_rank_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(images_module, "is_rank_zero", lambda: False)
    calls: list[int] = []

    def fn(state: TrainState) -> dict:
        calls.append(state.step)
        return {}

    run(
        LOSS,
        _state(),
        DATA,
        max_steps=4,
        plugins=[log_images(fn, 2, sinks=[png_dir(tmp_path / "p")])],
    )
    assert calls == [] and not (tmp_path / "p").exists()


def test_one_sink_for_metrics_and_images(tmp_path: Path) -> None:
    sink = tensorboard(tmp_path)
    plugins = [log_metrics(2, sinks=[sink]), log_images(_step_image, 2, sinks=[sink])]
    run(LOSS, _state(), DATA, max_steps=4, plugins=plugins)
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.step for e in events.Images("probe")] == [2, 4]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # one writer, opened once


def test_log_images_not_called_at_the_end_of_a_run_that_raised(tmp_path: Path) -> None:
    calls: list[int] = []
    closed: list[int] = []

    def fn(state: TrainState) -> dict:
        calls.append(state.step)
        return {}

    def crash(event: Any) -> None:
        if event.kind == "step" and event.state.step == 3:
            raise RuntimeError("boom")

    sink = Sink(print, lambda: closed.append(1), images=lambda step, images: None)
    with pytest.raises(RuntimeError, match="boom"):
        run(LOSS, _state(), DATA, max_steps=6, plugins=[log_images(fn, 2, sinks=[sink]), crash])
    assert calls == [2] and closed == [1]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("x",), {"sinks": []}, TypeError, r"log_images: fn must be a function state -> "),
        ((dict,), {"every": 0, "sinks": []}, ValueError, r"log_images: every must be an int >= 1"),
        ((dict,), {"sinks": []}, TypeError, r"log_images: sinks must be a list of sinks"),
        ((dict,), {"sinks": "png"}, TypeError, r"log_images: sinks must be a list of sinks"),
        (
            (dict,),
            {"sinks": [Sink(print, print)]},
            TypeError,
            r"log_images: sinks\[0\] must be a sink with images, close, start; .*Use png_dir",
        ),
    ],
)
def test_log_images_bad_arguments(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        log_images(*args, **kwargs)


def test_log_images_refuses_jsonl_and_a_fn_that_returns_no_mapping(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"sinks\[0\] must be a sink with images.*jsonl records"):
        log_images(dict, sinks=[jsonl(tmp_path / "m.jsonl")])
    plugin = log_images(lambda state: [torch.zeros(2, 2)], 1, sinks=[png_dir(tmp_path / "p")])
    with pytest.raises(TypeError, match=r"log_images: fn must be a function state -> \{name: "):
        run(LOSS, _state(), DATA, max_steps=1, plugins=[plugin])
