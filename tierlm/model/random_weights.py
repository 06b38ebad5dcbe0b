"""Random weights for a checkpoint layout: what `tierlm demo-model` writes and `--load-format dummy` loads.

Each tensor is drawn from its own generator, seeded from (seed, tensor name), by the `TensorSpec` kind:
- weights: normal with std 1/sqrt(fan_in) (a residual stream of RMS ~1 stays so); embeddings std 1;
  `lm_head` (and an MTP head's own) std LM_HEAD_GAIN/sqrt(hidden), so next-token distributions are
  neither flat nor one-hot;
- Gemma-style norms (1 + w): small noise around 0; biases zero; `A_log` the log of U(1, 16);
- PLE tables standard normal (their convolutions are non-zero, so that path is exercised);
- int64 hash buffers: the values the config's hash gives (passed in).
On the CPU the values are the same on every machine; on a GPU the device's generator draws them (the same
run to run on one device, but not the CPU's values), which is what makes a 20 GB random model quick.
"""

from __future__ import annotations

import hashlib
import math

import torch

from tierlm.model.checkpoint_layout import MTP_SHARED_HEAD, TensorSpec

NORM_STD = 0.05  # Gemma-style norm weights: 1 + w, w small
EMBED_STD = 1.0
# lm_head std = gain / sqrt(hidden): logits of std ~2.7 on the tiny demo model, mean next-token entropy ~60%
# of log(vocab), mean top-1 probability ~13%: varied greedy output, neither a flat nor a one-hot softmax.
LM_HEAD_GAIN = 6.0


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_tensor(
    spec: TensorSpec,
    seed: int,
    dtype: torch.dtype,
    hidden_size: int,
    hash_buffer: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One tensor of `spec`'s shape and kind (see the module docstring), on `device`."""
    if spec.kind == "int64":
        assert hash_buffer is not None, spec.name
        return torch.tensor(hash_buffer, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device).manual_seed(tensor_seed(seed, spec.name))
    shape = spec.shape
    values = torch.empty(shape, device=device)
    if spec.kind == "ones":
        values.fill_(1.0)
    elif spec.kind == "bias":
        values.zero_()
    elif spec.kind == "norm":
        values.normal_(0.0, NORM_STD, generator=gen)
    elif spec.kind == "a_log":
        values.uniform_(1.0, 16.0, generator=gen).log_()
    elif spec.kind == "ple_table":
        values.normal_(0.0, 1.0, generator=gen)
    elif spec.kind == "weight":
        if spec.name.endswith("embed_tokens.weight"):
            std = EMBED_STD
        elif spec.name in ("lm_head.weight", MTP_SHARED_HEAD):
            std = LM_HEAD_GAIN / math.sqrt(hidden_size)
        else:
            std = 1.0 / math.sqrt(math.prod(shape[1:]))
        values.normal_(0.0, std, generator=gen)
    else:
        raise ValueError(f"{spec.name}: unknown tensor kind {spec.kind!r}")
    return values.to(dtype).contiguous()
