"""Images -> flattened patches and patch grids, as transformers' Qwen2-VL image processor (PIL backend,
which Qwen4-Exp uses) makes them.

An image is converted to RGB, resized (bicubic) to the "smart" size: each side a multiple of
patch_size * merge_size, the aspect ratio kept as closely as possible, the pixel count within
[min_pixels, max_pixels]; rescaled by 1/255 (in float64, then float32), normalised per channel with the
mean and std, and cut into patch_size x patch_size patches in merge-block order (the merge x merge
patches the merger joins consecutive), each repeated temporal_patch_size times (an image is one frame)
and flattened channel-major: [grid_h * grid_w, C * temporal * patch * patch], grid (1, grid_h, grid_w).

Settings come from the checkpoint's `preprocessor_config.json` (its `size` {shortest_edge, longest_edge}
or min_pixels / max_pixels, image_mean, image_std, rescale_factor), the patch geometry from the vision
config, and vLLM's `--mm-processor-kwargs` (min_pixels, max_pixels) over both. `data_url_bytes` takes an
image's bytes out of a `data:image/...;base64,` URL.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from tierlm.config import VisionConfig

# transformers' Qwen2-VL defaults (a checkpoint's preprocessor_config.json usually overrides them)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
PROCESSOR_KWARGS = ("min_pixels", "max_pixels")


class ImageError(ValueError):
    """An image tierlm cannot use; the message says why (the server answers it 400)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels] pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image of {width}x{height}: the aspect ratio must be at most {MAX_ASPECT_RATIO}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def data_url_bytes(url: str) -> bytes:
    """The image bytes of a `data:image/<type>;base64,<bytes>` URL, or an ImageError saying what is wrong."""
    header, comma, payload = url.removeprefix("data:").partition(",")
    media_type, *options = header.split(";")
    if not url.startswith("data:") or not comma or "base64" not in options or not media_type.startswith("image/"):
        raise ImageError("a data URL must read data:image/<type>;base64,<bytes>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data is not valid base64 ({exc})") from None


@dataclass(frozen=True)
class ProcessedImage:
    patches: torch.Tensor  # [t * h * w, C * temporal * patch * patch] float32
    grid: tuple[int, int, int]  # (t, h, w) patches


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def for_model(cls, model_dir: str | Path, vision: VisionConfig, overrides: dict | None = None) -> ImageProcessor:
        """The processor of a checkpoint folder: its preprocessor_config.json (if any), then `overrides`
        (--mm-processor-kwargs: min_pixels, max_pixels)."""
        path = Path(model_dir) / "preprocessor_config.json"
        raw = json.loads(path.read_text()) if path.exists() else {}
        size = raw.get("size") or {}
        values = {
            "min_pixels": size.get("shortest_edge", raw.get("min_pixels", DEFAULT_MIN_PIXELS)),
            "max_pixels": size.get("longest_edge", raw.get("max_pixels", DEFAULT_MAX_PIXELS)),
            "image_mean": tuple(raw.get("image_mean", CLIP_MEAN)),
            "image_std": tuple(raw.get("image_std", CLIP_STD)),
            "rescale_factor": raw.get("rescale_factor", 1 / 255),
        }
        for key, value in (overrides or {}).items():
            if key not in PROCESSOR_KWARGS:
                raise ValueError(
                    f"mm_processor_kwargs: unknown key {key!r}; tierlm takes {', '.join(PROCESSOR_KWARGS)}")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"mm_processor_kwargs: {key} must be a positive integer, got {value!r}")
            values[key] = value
        if values["min_pixels"] > values["max_pixels"]:
            raise ValueError(f"min_pixels {values['min_pixels']} is above max_pixels {values['max_pixels']}")
        return cls(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size, **values)

    def decode(self, data: bytes) -> Image.Image:
        """Image file bytes (PNG, JPEG, WebP, GIF, ...) -> a loaded RGB image, or an ImageError."""
        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise ImageError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from None
        return image

    def __call__(self, image: Image.Image) -> ProcessedImage:
        image = image.convert("RGB") if image.mode != "RGB" else image
        factor = self.patch_size * self.merge_size
        height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels = (np.asarray(image).astype(np.float64) * self.rescale_factor).astype(np.float32)  # [H, W, C]
        mean, std = np.array(self.image_mean, np.float32), np.array(self.image_std, np.float32)
        pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [C, H, W]
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = pixels.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
        patches = torch.from_numpy(np.ascontiguousarray(frames).reshape(grid_h * grid_w, 3 * tp * p * p))
        return ProcessedImage(patches, (1, grid_h, grid_w))

    def num_tokens(self, image: ProcessedImage) -> int:
        """Prompt tokens (merged features) the image takes."""
        t, h, w = image.grid
        return t * h * w // (self.merge_size * self.merge_size)
