"""The model's prefill with both Triton prefill kernels (the gated delta rule over the whole varlen batch,
QSA attention reading its rows in place) against its torch path, under TRITON_INTERPRET=1 on CPU (on a GPU
the kernels are the default and the kill switches give the torch path).

Two requests in one batch (a first chunk of 25 tokens beside a whole 23-token prompt), then the rest of
the first request from its cached state, logits of every row. fp32: equal up to summation order. bf16:
the kernel path's distance from the fp32 run within 2x the torch bf16 path's own."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from interpreted import on_cuda_else_interpreted
from reference_models import assert_kernel_path_close

BLOCK_SIZE = 16


def prefill_logits(folder: Path, dtype: str, kernels: bool, device: str) -> torch.Tensor:
    import tierlm.model.layers.gated_deltanet as gdn
    import tierlm.model.layers.qsa_attention as qsa

    saved = gdn.triton_prefill_applies, qsa.sparse_kernel_applies
    gdn.triton_prefill_applies = lambda x: kernels
    qsa.sparse_kernel_applies = lambda q: kernels
    try:
        return run_prefill(folder, dtype, device)
    finally:
        gdn.triton_prefill_applies, qsa.sparse_kernel_applies = saved


def run_prefill(folder: Path, dtype: str, device: str) -> torch.Tensor:
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.loader import load_model
    from tierlm.model.model_cache import ModelCache

    model, config = load_model(folder, dtype=dtype, device=device)
    cache = ModelCache(config, 2, 16, BLOCK_SIZE, getattr(torch, dtype), device)
    cache.reset_slot(0)
    cache.reset_slot(1)
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (40, 23))
    tables = [list(range(math.ceil(40 / BLOCK_SIZE))), list(range(4, 4 + math.ceil(23 / BLOCK_SIZE)))]
    with torch.no_grad():
        a = model(ForwardBatch.build([first[:25], second], [0, 0], [0, 1], tables, BLOCK_SIZE, device, "all"), cache)
        b = model(ForwardBatch.build([first[25:]], [25], [0], tables[:1], BLOCK_SIZE, device, "all"), cache)
    return torch.cat([a, b]).float().cpu()


def test_model_prefill_through_the_kernels_equals_the_torch_path():
    on_cuda_else_interpreted(lambda: assert_kernel_path_close(prefill_logits, "cuda"), INTERPRETED_EARLY,
                             "test_model_prefill_through_the_kernels_equals_the_torch_path")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py): the child builds its model
    "test_model_prefill_through_the_kernels_equals_the_torch_path": ((
        "import test_prefill_kernels_model as t\n"
        "from reference_models import assert_kernel_path_close\n"
        "assert_kernel_path_close(t.prefill_logits, 'cpu')"),),
}
