"""Decode image files as a scraped folder has them: any mode, orientation, bit depth; bad files named.

Pillow opens most formats lazily and converts modes naively (16-bit to 8-bit by clipping, alpha
dropped onto black). Here a file is decoded in full, oriented by its EXIF tag, and brought to 8-bit
RGB or grey by what its pixels mean; a file that cannot be decoded raises `BadImage` saying why.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class BadImage(ValueError):
    """A file that is not a decodable image (truncated, empty, not an image, too large to be safe)."""


def decode_image(path: Path, channels: int = 3) -> Image.Image:
    """The image at `path` as fully decoded 8-bit RGB (`channels=3`) or grey (`channels=1`)."""
    try:
        with warnings.catch_warnings():
            # Pillow warns above MAX_IMAGE_PIXELS and raises above twice that: both are a bomb here.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()  # decode now: a truncated file fails here, not as a half-grey picture later
                image = ImageOps.exif_transpose(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        reason = "empty file" if path.is_file() and path.stat().st_size == 0 else " ".join(str(err).split())
        raise BadImage(f"{path}: not a usable image ({reason[:200]})") from None
    return _to_8bit(image, channels)


def header_size(path: Path) -> tuple[int, int] | None:
    """The (height, width) the image at `path` decodes to, EXIF orientation applied, from its header alone; None
    when the header cannot be read (decoding it then fails, and says why)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            orientation = image.getexif().get(0x0112)  # 5 to 8: stored turned a quarter
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    return (width, height) if orientation in (5, 6, 7, 8) else (height, width)


def _to_8bit(image: Image.Image, channels: int) -> Image.Image:
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        values = np.asarray(image, dtype=np.float64)
        top = 65535.0 if values.max(initial=0) > 255 else 255.0  # 16-bit PNGs open as "I" or "I;16"
        image = Image.fromarray(np.clip(values / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or image.mode == "P" and "transparency" in image.info:
        rgba = image.convert("RGBA")  # transparent pixels become white, as viewers show them
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert("RGB" if channels == 3 else "L")
