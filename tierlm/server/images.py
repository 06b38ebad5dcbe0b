"""The images of a chat request: its `image_url` parts, checked against the served model and the server's
limits, fetched (http(s): on the fetch threads), decoded and turned into patches (on the text pool); the
event loop only waits.

Accepted: `data:image/...;base64,...` URLs (the body size limit bounds them), `file://` URLs of files
inside `--allowed-local-media-path` (vLLM's flag; the path resolved, links included, must stay inside it;
at most MAX_IMAGE_BYTES), and http(s) URLs whose host is in `--allowed-media-domains` (vLLM's flag;
multimodal/fetch.py: redirects checked, `--image-fetch-timeout`, at most MAX_IMAGE_BYTES). Refused with a
400 naming the part: any image for a model without a vision tower, more images than
`--limit-mm-per-prompt` (vLLM's flag, `{"image": N}`), http(s) URLs without the flag or to another host,
a fetch that fails, times out or is too large, file URLs without the flag or outside its folder, bytes
that are not base64 or not an image, aspect ratios beyond 200:1. `--mm-processor-kwargs` (min_pixels,
max_pixels) bounds the resize.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from tierlm.config import VisionConfig
from tierlm.multimodal.fetch import DEFAULT_FETCH_TIMEOUT_S, MAX_IMAGE_BYTES, MediaFetcher
from tierlm.multimodal.image_processor import ImageError, ImageProcessor, ProcessedImage, data_url_bytes
from tierlm.multimodal.prompt import expand_image_tokens
from tierlm.server.protocol import ApiError, ChatCompletionRequest, ImageUrlPart

DEFAULT_IMAGE_LIMIT = 8  # images per prompt without --limit-mm-per-prompt
# http(s) fetches run here (blocking urllib; a slow host holds one of these threads, not the text pool)
FETCH_POOL = ThreadPoolExecutor(8, thread_name_prefix="tierlm-fetch")


@dataclass(frozen=True)
class ImageInputs:
    """How the server takes images: the model's vision config, its processor, at most `limit` per prompt."""

    vision: VisionConfig
    processor: ImageProcessor
    limit: int
    local_media: Path | None = None  # --allowed-local-media-path, resolved
    fetcher: MediaFetcher | None = None  # --allowed-media-domains: http(s) URLs to those hosts are fetched

    @classmethod
    def for_model(
        cls, model_dir: str | Path, vision: VisionConfig | None, limit_mm_per_prompt: str | None = None,
        mm_processor_kwargs: str | None = None, allowed_local_media_path: str | None = None,
        allowed_media_domains: list[str] | None = None, image_fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S,
    ) -> ImageInputs | None:
        """None for a model without a vision tower. The two JSON flags are vLLM's forms; a bad value (or a
        local media path that is not a folder, a domain that is not a host name) is a ValueError naming
        the flag."""
        limits = _json_flag("--limit-mm-per-prompt", limit_mm_per_prompt)
        unknown = sorted(set(limits) - {"image"})
        if unknown:
            raise ValueError(f"--limit-mm-per-prompt: tierlm takes images only, not {unknown[0]!r}")
        limit = limits.get("image", DEFAULT_IMAGE_LIMIT)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"--limit-mm-per-prompt: image must be a count >= 0, got {limit!r}")
        kwargs = _json_flag("--mm-processor-kwargs", mm_processor_kwargs)
        local_media = None
        if allowed_local_media_path is not None:
            local_media = Path(allowed_local_media_path).expanduser().resolve()
            if not local_media.is_dir():
                raise ValueError(f"--allowed-local-media-path: {allowed_local_media_path!r} is not a folder")
        fetcher = MediaFetcher.from_flags(allowed_media_domains, image_fetch_timeout) if allowed_media_domains else None
        if vision is None:
            return None
        try:
            processor = ImageProcessor.for_model(model_dir, vision, kwargs)
        except ValueError as exc:
            raise ValueError(f"--mm-processor-kwargs: {exc}") from None
        return cls(vision, processor, limit, local_media, fetcher)


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


def checked_image_parts(
    images: ImageInputs | None, model_name: str, request: ChatCompletionRequest
) -> list[tuple[str, ImageUrlPart]]:
    """The request's image parts, or an ApiError (400) when the model or the limit refuses them."""
    parts = image_parts(request)
    if parts and images is None:
        raise ApiError(400, f"model {model_name!r} has no vision tower (its config.json has no vision_config), so "
                            "it takes no image_url parts", parts[0][0])
    if parts and len(parts) > images.limit:
        raise ApiError(400, f"{len(parts)} images in one prompt; this server takes at most {images.limit} "
                            "(--limit-mm-per-prompt)", parts[images.limit][0])
    return parts


def _is_http(url: str) -> bool:
    return url.startswith(("http:", "https:"))


async def fetch_remote_images(
    images: ImageInputs | None, model_name: str, request: ChatCompletionRequest
) -> dict[str, bytes]:
    """The bytes of the request's http(s) image parts by parameter path, fetched at once on the fetch
    threads while the event loop waits; an ApiError (400) naming the first part that fails. Parts the
    server does not fetch (no --allowed-media-domains) are left to load_images to refuse."""
    parts = checked_image_parts(images, model_name, request)
    remote = [(param, part.image_url.url) for param, part in parts if _is_http(part.image_url.url)]
    if not remote or images.fetcher is None:
        return {}
    loop = asyncio.get_running_loop()
    bodies = await asyncio.gather(*(loop.run_in_executor(FETCH_POOL, images.fetcher.fetch, url) for _, url in remote),
                                  return_exceptions=True)
    for (param, _), body in zip(remote, bodies):
        if isinstance(body, ImageError):
            raise ApiError(400, f"image_url: {body}", param)
        if isinstance(body, BaseException):
            raise body
    return {param: body for (param, _), body in zip(remote, bodies)}


def load_images(
    images: ImageInputs | None, model_name: str, request: ChatCompletionRequest, fetched: dict[str, bytes]
) -> list[ProcessedImage]:
    """The request's images as patches, or an ApiError (400) naming the part that cannot be used.
    fetched: what fetch_remote_images returned for the request (its http(s) parts' bytes by parameter path),
    required: they are never fetched here, on the text pool."""
    return [_load(images, part, param, fetched) for param, part in checked_image_parts(images, model_name, request)]


def _load(images: ImageInputs, part: ImageUrlPart, param: str, fetched: dict[str, bytes]) -> ProcessedImage:
    url = part.image_url.url
    try:
        if url.startswith("data:"):
            data = data_url_bytes(url)
        elif url.startswith("file:"):
            data = _local_file(images.local_media, url)
        elif _is_http(url):
            if images.fetcher is None:
                raise ImageError("http(s) URLs are not enabled on this server (--allowed-media-domains)")
            data = fetched[param]  # fetched on the fetch threads before (fetch_remote_images)
        else:
            scheme = url.split(":", 1)[0] if ":" in url else url[:16]
            accepted = ", ".join(["data:"] + ["file:"] * bool(images.local_media) + ["http(s):"] * bool(images.fetcher))
            raise ApiError(400, f"image_url: only {accepted} URLs are accepted, not {scheme!r}", param)
        return images.processor(images.processor.decode(data))
    except ImageError as exc:
        raise ApiError(400, f"image_url: {exc}", param) from None


def _local_file(folder: Path | None, url: str) -> bytes:
    """The bytes of a file:// URL's file, which must resolve to a file inside `folder`."""
    if folder is None:
        raise ImageError("file: URLs are not enabled on this server (--allowed-local-media-path)")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ImageError(f"file: URL names host {parsed.netloc!r}; only local files are read")
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(folder):
        raise ImageError(f"{path} is outside --allowed-local-media-path ({folder})")
    if not path.is_file():
        raise ImageError(f"{path} is not a file")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageError(f"{path} is larger than {MAX_IMAGE_BYTES} bytes")
    return path.read_bytes()


def expand_prompt(token_ids: list[int], images: ImageInputs, loaded: list[ProcessedImage]) -> list[int]:
    """The rendered prompt with each image's marker widened to its feature count; a chat template that
    did not mark every image once is a 400."""
    try:
        return expand_image_tokens(token_ids, images.vision, [images.processor.num_tokens(i) for i in loaded])
    except ValueError as exc:
        raise ApiError(400, f"the chat template's image markers do not fit the images: {exc}", "messages") from None
