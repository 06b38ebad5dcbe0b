"""The vision encoder in the engine: where the tower's weights live (`--mm-encoder-offload`), and its
features kept across requests (`EncoderCache`, `--mm-encoder-cache-bytes`).

Resident, the tower's weights sit on the device beside the text model's. Streamed, they sit in pinned host
memory and each encode copies them to the device unit by unit (model/vision/streamed.py): no device bytes
between requests, bit-identical features, at the cost of the copies (bench/vision_encode.py).

`mm_encoder_offload` None (auto) decides from the cache plan: on CUDA the tower streams when, with it
resident, the device would hold fewer than max_num_seqs requests of max_model_len (the plan fails, or holds
fewer, or moves the QSA K/V to host RAM on its own because the device is short); those bytes are then the
cache's. On CPU it stays resident (host memory is the device's memory).

The encoder cache keeps the features of recently encoded images by image digest (grid + patches, the
digest the prefix cache mixes into block hashes), least recently used first out, within a byte bound
(device memory beside the cache plan, as activations are): a request whose image was seen before takes
its features without running the tower, and the scheduler counts no encoder work for it. Within one
request a repeated image hits the same way. 0 bytes turns it off.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable

import torch

from tierlm.memory.plan import CachePlan, CapacityError

DEFAULT_ENCODER_CACHE_BYTES = 128 << 20  # ~24 images of 1,024 features at width 2560 in bf16


def place_vision_tower(
    model, offload: bool | None, device: torch.device, max_num_seqs: int, kv_offload_auto: bool,
    plan: Callable[[], CachePlan],
) -> tuple[CachePlan, str | None]:
    """The engine's cache plan (`plan()` measures the device as it stands) with the tower placed per
    `offload` (None: auto, see the module docstring), and a line saying where it went (None: no tower)."""
    tower = getattr(model, "visual", None)
    if tower is None:
        return plan(), None
    if offload is None:
        if device.type != "cuda":
            offload, reason = False, f"auto: resident on {device.type}"
        else:
            try:
                resident = plan()
            except CapacityError:
                resident = None
            if resident is not None and resident.requests_at_max_len >= max_num_seqs and not (
                    resident.kv_offload and kv_offload_auto):
                return resident, _line(tower, False, "auto: the device holds max_num_seqs requests of "
                                                     "max_model_len beside it")
            offload, reason = True, "auto: the device is short of max_num_seqs requests of max_model_len with it"
    else:
        reason = "--mm-encoder-offload" if offload else "--no-mm-encoder-offload"
    if not offload:
        return plan(), _line(tower, False, reason)
    tower.stream_from_host(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the tower's device copies were freed: the plan measures the room
    streamed = plan()  # its reported weights (from the checkpoint layout) leave the tower out
    return dataclasses.replace(streamed, weights_bytes=streamed.weights_bytes - _bytes(tower)), _line(
        tower, True, reason)


def _bytes(tower) -> int:
    return sum(p.numel() * p.element_size() for p in tower.parameters())


def _line(tower, streamed: bool, reason: str) -> str:
    where = "in host memory, streamed to the device unit by unit" if streamed else "resident on the device"
    return f"vision tower: {_bytes(tower):,} B of weights {where} ({reason})"


class EncoderCache:
    """Image features by digest, LRU, at most `max_bytes` of them (0: nothing is kept)."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"--mm-encoder-cache-bytes must be 0 or more, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.hits = self.misses = 0
        self._features: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._features

    def __len__(self) -> int:
        return len(self._features)

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The features of the image with this digest (now the most recently used), or None."""
        features = self._features.get(digest)
        if features is None:
            self.misses += 1
            return None
        self._features.move_to_end(digest)
        self.hits += 1
        return features

    def put(self, digest: bytes, features: torch.Tensor) -> None:
        """Keep `features` (not copied), evicting the least recently used to make room; features larger
        than the whole bound are not kept."""
        size = features.numel() * features.element_size()
        if digest in self._features or size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            _, evicted = self._features.popitem(last=False)
            self.nbytes -= evicted.numel() * evicted.element_size()
        self._features[digest] = features
        self.nbytes += size
