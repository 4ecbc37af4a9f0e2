"""One image (tensor or matplotlib figure) as the uint8 pixels every image sink writes."""

import sys
from typing import Any

import torch

from toolkit._checks import check

_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA


def pixels(who: str, name: str, image: Any) -> torch.Tensor:
    """``image`` as a contiguous CPU ``uint8`` tensor: ``(H, W)`` grey, or ``(H, W, C)``, C in 3, 4.

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
        canvas = image.canvas
        if not hasattr(canvas, "buffer_rgba"):  # a canvas that does not draw with Agg
            from matplotlib.backends.backend_agg import FigureCanvasAgg

            canvas = FigureCanvasAgg(image)
        canvas.draw()
        rgba = canvas.buffer_rgba()  # a (H, W, 4) memoryview of the canvas's own memory: copied
        return torch.frombuffer(bytearray(rgba), dtype=torch.uint8).reshape(rgba.shape)
    what, tensor = f"image {name!r}", isinstance(image, torch.Tensor)
    ok = tensor and (image.dtype == torch.uint8 or image.is_floating_point())
    expected = "a matplotlib figure, or a tensor of uint8 pixels or float intensities in [0, 1]"
    check(ok, who, what, expected, image.dtype if tensor else type(image), "", TypeError)
    image = image.detach().cpu()
    if image.dim() == 3 and image.shape[0] in _CHANNELS:
        image = image.permute(1, 2, 0)
    if image.dim() == 3 and image.shape[-1] == 1:
        image = image[..., 0]  # grey: (H, W), as Pillow and W&B take it
    shaped = image.dim() == 2 or (image.dim() == 3 and image.shape[-1] in _CHANNELS)
    shaped = shaped and image.numel() > 0
    shapes = "(H, W), (C, H, W) or (H, W, C) with C in 1, 3 or 4 and H, W > 0"
    check(shaped, who, f"{what}'s shape", shapes, tuple(image.shape))
    if image.dtype != torch.uint8:
        finite = bool(torch.isfinite(image).all())
        check(finite, who, what, "intensities in [0, 1]", "NaN or infinite values")
        image = image.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return image.contiguous()


def check_name(who: str, name: Any) -> str:
    """An image name: a non-empty relative path of "/"-separated parts, none "." or ".."."""
    parts = name.split("/") if isinstance(name, str) else [""]
    ok = not any(part in ("", ".", "..") or "\\" in part for part in parts)
    example = "a relative path such as 'val/samples' (no empty, '.' or '..' part, no backslash)"
    check(ok, who, "an image name", example, name)
    return name
