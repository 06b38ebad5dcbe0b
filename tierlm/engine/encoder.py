"""The vision encoder in the engine: where the tower's weights live (`--mm-encoder-offload`).

Resident, the tower's weights sit on the device beside the text model's. Streamed, they sit in pinned host
memory and each encode copies them to the device unit by unit (model/vision/streamed.py): no device bytes
between requests, bit-identical features, at the cost of the copies (bench/vision_encode.py).

`mm_encoder_offload` None (auto) decides from the cache plan: on CUDA the tower streams when, with it
resident, the device would hold fewer than max_num_seqs requests of max_model_len (the plan fails, or holds
fewer, or moves the QSA K/V to host RAM on its own because the device is short); those bytes are then the
cache's. On CPU it stays resident (host memory is the device's memory).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from tierlm.memory.plan import CachePlan, CapacityError

logger = logging.getLogger(__name__)


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
    if offload:
        tower.stream_from_host(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the tower's device copies were freed: the plan measures the room
    return plan(), _line(tower, offload, reason)


def _line(tower, streamed: bool, reason: str) -> str:
    nbytes = sum(p.numel() * p.element_size() for p in tower.parameters())
    where = "in host memory, streamed to the device unit by unit" if streamed else "resident on the device"
    return f"vision tower: {nbytes:,} B of weights {where} ({reason})"
