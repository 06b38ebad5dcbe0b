"""The images of a chat request: its `image_url` parts, checked against the served model and the server's
limits, decoded and turned into patches (on the text pool, off the event loop).

Accepted: `data:image/...;base64,...` URLs (the body size limit bounds them). Refused with a 400 naming
the part: any image for a model without a vision tower, more images than `--limit-mm-per-prompt`
(vLLM's flag, `{"image": N}`), http(s) and file URLs (not enabled), bytes that are not base64 or not an
image, aspect ratios beyond 200:1. `--mm-processor-kwargs` (min_pixels, max_pixels) bounds the resize.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tierlm.config import VisionConfig
from tierlm.multimodal.image_processor import ImageError, ImageProcessor, ProcessedImage, data_url_bytes
from tierlm.multimodal.prompt import expand_image_tokens
from tierlm.server.protocol import ApiError, ChatCompletionRequest, ImageUrlPart

DEFAULT_IMAGE_LIMIT = 8  # images per prompt without --limit-mm-per-prompt


@dataclass(frozen=True)
class ImageInputs:
    """How the server takes images: the model's vision config, its processor, at most `limit` per prompt."""

    vision: VisionConfig
    processor: ImageProcessor
    limit: int

    @classmethod
    def for_model(
        cls, model_dir: str | Path, vision: VisionConfig | None, limit_mm_per_prompt: str | None = None,
        mm_processor_kwargs: str | None = None,
    ) -> ImageInputs | None:
        """None for a model without a vision tower. The two flags are JSON text (vLLM's forms); a bad
        value is a ValueError naming the flag."""
        limits = _json_flag("--limit-mm-per-prompt", limit_mm_per_prompt)
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"--limit-mm-per-prompt: tierlm takes images only, not {unknown[0]!r}")
        limit = limits.get("image", DEFAULT_IMAGE_LIMIT)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"--limit-mm-per-prompt: image must be a count >= 0, got {limit!r}")
        kwargs = _json_flag("--mm-processor-kwargs", mm_processor_kwargs)
        if vision is None:
            return None
        try:
            processor = ImageProcessor.for_model(model_dir, vision, kwargs)
        except ValueError as exc:
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None
        return cls(vision, processor, limit)


def _json_flag(flag: str, text: str | None) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object, got {text!r}")  # noqa: TRY004 (a flag's value: the CLI's error)
    return value


def image_parts(request: ChatCompletionRequest) -> list[tuple[str, ImageUrlPart]]:
    """The request's image parts in prompt order, each with its parameter path."""
    found = []
    for i, message in enumerate(request.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImageUrlPart):
                    found.append((f"messages[{i}].content[{j}]", part))
    return found


def load_images(images: ImageInputs | None, model_name: str, request: ChatCompletionRequest) -> list[ProcessedImage]:
    """The request's images as patches, or an ApiError (400) naming the part that cannot be used."""
    parts = image_parts(request)
    if not parts:
        return []
    if images is None:
        raise ApiError(400, f"model {model_name!r} has no vision tower (its config.json has no vision_config), so "
                            "it takes no image_url parts", parts[0][0])
    if len(parts) > images.limit:
        raise ApiError(400, f"{len(parts)} images in one prompt; this server takes at most {images.limit} "
                            "(--limit-mm-per-prompt)", parts[images.limit][0])
    return [_load(images.processor, part, param) for param, part in parts]


def _load(processor: ImageProcessor, part: ImageUrlPart, param: str) -> ProcessedImage:
    url = part.image_url.url
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ApiError(400, f"image_url: only data: URLs (base64 image bytes) are accepted, not {scheme!r}", param)
    try:
        return processor(processor.decode(data_url_bytes(url)))
    except ImageError as exc:
        raise ApiError(400, f"image_url: {exc}", param) from None


def expand_prompt(token_ids: list[int], images: ImageInputs, loaded: list[ProcessedImage]) -> list[int]:
    """The rendered prompt with each image's marker widened to its feature count; a chat template that
    did not mark every image once is a 400."""
    try:
        return expand_image_tokens(token_ids, images.vision, [images.processor.num_tokens(i) for i in loaded])
    except ValueError as exc:
        raise ApiError(400, f"the chat template's image markers do not fit the images: {exc}", "messages") from None
