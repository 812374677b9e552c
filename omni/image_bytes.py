"""Opening encoded images, the one rule for every reader of them (the image tokenizer, the shard readers, the
dataset builders): the pixel count is read from the header and bounded before anything is decoded, the image is
decoded at once (a truncated file fails here, not later), and EXIF orientation is applied, so a phone photo is
upright wherever omni reads it. A leaf: PIL only."""

from __future__ import annotations

import io
import warnings
from typing import Any

MAX_PIXELS = 8192 * 8192  # the most pixels omni decodes (a 13,000 x 13,000 PNG would need 5 GB as floats)


class ImageTooLarge(ValueError):
    """An encoded image with more than ``MAX_PIXELS`` pixels (by its header)."""


def check_image_size(width: int, height: int, name: str = "image") -> None:
    """``ImageTooLarge`` naming the image when ``width * height`` exceeds ``MAX_PIXELS``."""
    if width * height > MAX_PIXELS:
        raise ImageTooLarge(f"{name}: {width} x {height} pixels ({width * height / 1e6:.1f} MP) is more than omni "
                            f"decodes ({MAX_PIXELS / 1e6:.1f} MP, e.g. 8192 x 8192: omni.tokenizers.image.MAX_PIXELS); downscale "
                            "it first")


def open_image(data: bytes, name: str = "image") -> Any:
    """Encoded image bytes -> a loaded, upright PIL image in the file's own mode (the first frame of an
    animation). ImageTooLarge past ``MAX_PIXELS``; PIL's own errors for data it cannot decode."""
    from PIL import Image, ImageOps

    with warnings.catch_warnings():  # PIL's DecompressionBombWarning: MAX_PIXELS refuses those first
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data))
    with image:
        check_image_size(*image.size, name=name)  # from the header alone: nothing decoded yet
        image.load()  # decode now, so truncated or corrupt data fails here
        upright = ImageOps.exif_transpose(image)
    if upright is image:  # no orientation tag: exif_transpose hands back the same (about to be closed) image
        upright = image.copy()
    return upright


__all__ = ["ImageTooLarge", "MAX_PIXELS", "check_image_size", "open_image"]
