"""A request's images inside the engine: where each sits in the prompt, its encoder features while the
prefill needs them, and what a step's batch takes from them.

An image arrives processed (`multimodal/image_processor.py`: patches and a patch grid) with a prompt whose
marker was already widened to its placeholder run (`multimodal/prompt.py`). The engine keeps, per image,
its run (first prompt row, length) and a digest of its grid and patches: the prefix cache mixes the digest
into the hash of every block the run touches (vLLM's mm hashes), so equal placeholder ids of different
images never share blocks. The vision tower runs once per image, at the first prefill chunk that reaches
its run, unless the engine's encoder cache (engine/encoder.py) holds the image's digest; the features stay
on the request until a chunk has taken its last row (a preempted request, recomputed from its start, takes
them again from the cache or encodes again). The scheduler counts an image's features in the step's token
budget when the chunk encodes it (`encoder_tokens`; a cached image costs nothing).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from tierlm.config import VisionConfig
from tierlm.engine.encoder import EncoderCache
from tierlm.model.vision.grid import merged_tokens
from tierlm.model.vision.mrope import MropePositions
from tierlm.multimodal.image_processor import ProcessedImage


@dataclass(frozen=True)
class RequestImage:
    """One image of a prompt: its patches and grid, its placeholder run [start, start + num_tokens) of the
    prompt, and the digest of grid and patches."""

    patches: torch.Tensor
    grid: tuple[int, int, int]
    start: int
    num_tokens: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def image_digest(image: ProcessedImage) -> bytes:
    patches = image.patches.detach().to("cpu", torch.float32).contiguous()
    header = torch.tensor(image.grid, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(header + patches.numpy().tobytes(), digest_size=16).digest()


def request_images(
    token_ids: list[int], images: list[ProcessedImage], vision: VisionConfig
) -> tuple[list[RequestImage], MropePositions]:
    """The images located in an expanded prompt (each run of image tokens is the next image's, in order),
    and the prompt's M-RoPE positions. A prompt whose runs do not fit the images is a ValueError."""
    merge = vision.spatial_merge_size
    runs, index = [], 0
    while index < len(token_ids):
        if token_ids[index] != vision.image_token_id:
            index += 1
            continue
        end = index
        while end < len(token_ids) and token_ids[end] == vision.image_token_id:
            end += 1
        runs.append((index, end - index))
        index = end
    if len(runs) != len(images):
        raise ValueError(f"{len(images)} images given, but the prompt has {len(runs)} runs of image tokens "
                         f"(id {vision.image_token_id})")
    for number, ((_, count), image) in enumerate(zip(runs, images)):
        if count != merged_tokens(image.grid, merge):
            raise ValueError(f"image {number}: its run has {count} image tokens, but its grid {image.grid} gives "
                             f"{merged_tokens(image.grid, merge)} (expand the prompt with expand_image_tokens)")
        expected = image.grid[0] * image.grid[1] * image.grid[2]
        if image.patches.ndim != 2 or image.patches.shape[0] != expected:
            raise ValueError(f"image {number}: {list(image.patches.shape)} patches for its grid {image.grid} "
                             f"(expected {expected} rows)")
    located = [RequestImage(image.patches, tuple(image.grid), start, count, image_digest(image))
               for (start, count), image in zip(runs, images)]
    return located, MropePositions.of_prompt(token_ids, vision.image_token_id, [i.grid for i in images], merge)


def encoder_tokens(request, start: int, end: int, cache: EncoderCache | None = None) -> int:
    """Features the vision tower computes for a chunk [start, end) of the request: those of the images it
    reaches that are neither on the request nor in the encoder cache (what the scheduler counts in its
    budget)."""
    return sum(image.num_tokens for index, image in enumerate(request.images)
               if image.overlaps(start, end) and index not in request.image_features
               and not (cache is not None and image.digest in cache))


def chunk_image_rows(
    model, request, start: int, end: int, first_row: int, cache: EncoderCache | None = None
) -> list[tuple[torch.Tensor, range]]:
    """The features of a chunk [start, end) of the request's tokens (packed from `first_row` on) and the
    packed rows they replace, per image it reaches: each image's features taken from the encoder cache or
    encoded (and cached) at the first chunk that reaches it, kept on the request, dropped after the chunk
    that takes its last row."""
    pieces = []
    for index, image in enumerate(request.images):
        if not image.overlaps(start, end):
            continue
        features = request.image_features.get(index)
        if features is None and cache is not None:
            features = cache.get(image.digest)
        if features is None:
            features = model.encode_images(image.patches.to(model.visual.device, model.visual.dtype), [image.grid])
            if cache is not None:
                cache.put(image.digest, features)
        request.image_features[index] = features
        lo, hi = max(start, image.start), min(end, image.end)
        pieces.append((features[lo - image.start : hi - image.start], range(first_row + lo - start, first_row + hi - start)))
        if hi == image.end:
            del request.image_features[index]
    return pieces
