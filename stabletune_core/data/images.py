"""Open any image a user is likely to drop into a dataset folder, as 8-bit RGB.

Datasets come from phones (EXIF rotation), screenshots (RGBA), print workflows
(CMYK), scanners and scientific tools (16-bit grayscale) and half-finished
downloads (truncated files). Every one of them must either become a sane RGB
image or fail with one sentence that names the file, so the scan can list it
as skipped instead of crashing a run hours later.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS: frozenset[str] = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"})

# Modes that carry transparency; they are composited onto white because a
# transparent pixel has no colour of its own (PIL would expose whatever RGB
# happens to sit under alpha=0, often black).
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}

# Modes whose pixel values are not 8-bit and must be rescaled, not clipped.
_HIGH_DEPTH_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I", "F"}


class UnreadableImageError(ValueError):
    """An image file that cannot be decoded; `reason` says why in plain words."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"Cannot read image {self.path}: {reason}.")


def load_image(path: Path) -> Image.Image:
    """Decode `path` completely and return it as an upright 8-bit RGB image.

    The whole file is decoded (not just the header) so that truncated files
    fail here, during the dataset scan, rather than in the middle of training.
    """
    path = Path(path)
    try:
        with Image.open(path) as opened:
            opened.load()  # forces a full decode; truncation raises OSError here
            image = _upright(opened)
            return _to_rgb(image, path)
    except UnreadableImageError:
        raise
    except FileNotFoundError:
        raise UnreadableImageError(path, "the file does not exist") from None
    except IsADirectoryError:
        raise UnreadableImageError(path, "it is a folder, not a file") from None
    except PermissionError:
        raise UnreadableImageError(path, "permission denied") from None
    except UnidentifiedImageError:
        raise UnreadableImageError(path, "it is not an image file or its format is not supported") from None
    except Image.DecompressionBombError as exc:
        raise UnreadableImageError(path, f"it is too large to decode safely ({exc})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # PIL reports truncated and corrupt data as OSError/SyntaxError/EOFError
        # with terse messages; keep them, they help when a user reports a bug.
        raise UnreadableImageError(path, f"the file is truncated or corrupt ({exc})") from None


def _upright(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation tag so phone photos are not trained sideways."""
    try:
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, KeyError, TypeError, SyntaxError, struct.error):
        # Pillow's ways of saying the EXIF block is malformed: that should not cost the user an otherwise fine
        # image; training on it un-rotated is the lesser evil. (Anything else is a bug and is not hidden.)
        return image


def _to_rgb(image: Image.Image, path: Path) -> Image.Image:
    if image.mode == "RGB":
        return image
    if image.mode in _HIGH_DEPTH_MODES:
        return _high_depth_to_rgb(image)
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    try:
        # CMYK, YCbCr, L, 1 and plain P convert directly.
        return image.convert("RGB")
    except ValueError:
        raise UnreadableImageError(path, f"its colour mode {image.mode} cannot be converted to RGB") from None


def _high_depth_to_rgb(image: Image.Image) -> Image.Image:
    """Scale a 16/32-bit integer or float grayscale image down to 8 bits.

    PIL's own convert("L") clips these modes at 255, which turns a 16-bit
    mid-gray (32768) into pure white. "I" and "F" do not record their bit
    depth, so the range is inferred from the largest value.
    """
    values = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16"):
        scale_max = 65535.0
    else:
        finite = values[np.isfinite(values)]
        low = float(finite.min()) if finite.size else 0.0
        high = float(finite.max()) if finite.size else 0.0
        if image.mode == "F" and low >= 0.0 and high <= 1.0:
            scale_max = 1.0  # normalised float data
        elif low >= 0.0 and high <= 255.0:
            scale_max = 255.0
        elif low >= 0.0 and high <= 65535.0:
            scale_max = 65535.0  # 16-bit data opened as "I" (older PIL, TIFF)
        else:
            # Unknown range (negative or >16-bit): stretch to full contrast.
            values = values - low
            scale_max = max(high - low, 1e-12)
    values = np.nan_to_num(values, nan=0.0, posinf=scale_max, neginf=0.0)
    gray = np.clip(np.rint(values * (255.0 / scale_max)), 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")
