"""One image (tensor or matplotlib figure) as the uint8 HWC pixels every image sink writes."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["check_name", "pixels"]

_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def pixels(who: str, name: str, image: Any) -> torch.Tensor:
    """``image`` as a contiguous CPU ``uint8`` tensor of shape ``(H, W, C)``, C in 1, 3, 4.

    A tensor is ``(H, W)`` (grey), or 3-D: **CHW when its first dimension is 1, 3 or 4**
    (torch's convention), else HWC (its last dimension must then be 1, 3 or 4); so an HWC
    image whose height is 1, 3 or 4 must be given as CHW. ``uint8`` values are pixels as
    they are; floating-point values are intensities in [0, 1] (clamped to it, then
    ``round(x * 255)``). A matplotlib figure is drawn (RGBA) with its own canvas when
    that draws with Agg, else with an Agg canvas that replaces it.

    Example:
        >>> import torch
        >>> pixels("log_images", "grid", torch.zeros(3, 2, 5)).shape  # CHW
        torch.Size([2, 5, 3])
        >>> pixels("log_images", "grid", torch.tensor([[0.0, 0.5, 1.0]])).flatten().tolist()
        [0, 128, 255]
    """
    figure = sys.modules.get("matplotlib.figure")  # a figure exists only if this is imported
    if figure is not None and isinstance(image, figure.Figure):
        return _figure(image)
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"{who}: image {name!r} must be a tensor (CHW or HWC, uint8 or float in [0, 1]) "
            f"or a matplotlib figure; got {type(image).__name__}."
        )
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise TypeError(
            f"{who}: image {name!r} must hold uint8 pixels or float intensities in [0, 1]; "
            f"got dtype {image.dtype}. Convert it, e.g. image.to(torch.uint8)."
        )
    image = image.detach().cpu()
    if image.dim() == 2:
        image = image.unsqueeze(-1)
    elif image.dim() == 3 and image.shape[0] in _CHANNELS:
        image = image.permute(1, 2, 0)
    if image.dim() != 3 or image.shape[-1] not in _CHANNELS or image.numel() == 0:
        raise ValueError(
            f"{who}: image {name!r} must be (H, W), (C, H, W) or (H, W, C) with C in 1, 3 "
            f"or 4 and H, W > 0; got shape {tuple(image.shape)}."
        )
    if image.dtype != torch.uint8:
        if not bool(torch.isfinite(image).all()):
            raise ValueError(
                f"{who}: image {name!r} holds NaN or infinite values; float images are "
                "intensities in [0, 1]."
            )
        image = image.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return image.contiguous()


def _figure(figure: Any) -> torch.Tensor:
    canvas = figure.canvas
    if not hasattr(canvas, "buffer_rgba"):  # a canvas that does not draw with Agg
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(figure)
    canvas.draw()
    rgba = canvas.buffer_rgba()  # a (H, W, 4) memoryview of the canvas's own memory: copied
    return torch.frombuffer(bytearray(rgba), dtype=torch.uint8).reshape(rgba.shape)


def check_name(who: str, name: Any) -> str:
    """An image name: a non-empty relative path of "/"-separated parts, none "." or ".."."""
    parts = name.split("/") if isinstance(name, str) else None
    if not parts or any(part in ("", ".", "..") or "\\" in part for part in parts):
        raise ValueError(
            f"{who}: an image name must be a relative path such as 'samples' or "
            f"'val/samples' (no empty, '.' or '..' part, no backslash); got {name!r}."
        )
    return name
