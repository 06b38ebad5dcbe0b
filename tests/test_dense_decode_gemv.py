"""Unquantized projections' decode rows through quant_linear's Triton GEMV (`DenseFormat.kernel_linear`:
on CUDA, up to GEMV_MAX_ROWS rows, TIERLM_NO_TRITON_DENSE_GEMV=1 turns it off) against F.linear.

Which layers take it and when (CPU, no kernel run); then the model's logits: a prefill of two prompts
(more rows than the GEMV takes: F.linear on both paths), then decode steps of both requests (2 rows:
every `decode_gemv` projection through the GEMV), every step's logits, fp32 equal up to summation order,
bf16 the GEMV path's distance from the fp32 run within 2x the torch bf16 path's own. Without a GPU the
kernel runs in Triton's interpreter, in a child process (there the router's, hc's and the shared
expert's projections take it too: their fused CUDA kernels are off).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from interpreted import on_cuda_else_interpreted
from reference_models import assert_kernel_path_close

BLOCK_SIZE, DECODE_STEPS = 16, 3


def test_dense_decode_rows_take_the_gemv_on_cuda_only_unless_switched_off(monkeypatch):
    """CPU: no kernel (F.linear). CUDA: the GEMV up to GEMV_MAX_ROWS rows, none above (prefill stays on
    cuBLAS), none where autograd records the product (training), none with TIERLM_NO_TRITON_DENSE_GEMV=1
    (all checked before a kernel would run, so stand-ins show it)."""
    from tierlm.kernels.quant_linear.triton import GEMV_MAX_ROWS
    from tierlm.model.quantization.base import DENSE

    monkeypatch.delenv("TIERLM_NO_TRITON_DENSE_GEMV", raising=False)
    assert DENSE.kernel_linear(torch.zeros(1, 8), {"weight": torch.zeros(4, 8)}, 8) is None
    assert DENSE.linear_kernel(torch.zeros(GEMV_MAX_ROWS + 1, 8), {"weight": torch.zeros(4, 8)}, 8) is None
    assert DENSE.linear_kernel(torch.zeros(3, GEMV_MAX_ROWS, 8), {"weight": torch.zeros(4, 8)}, 8) is None
    from tierlm.model.quantization.base import DENSE_GEMV_MAX_ROWS  # on CUDA only this many rows take it
    rows = SimpleNamespace(is_cuda=True, requires_grad=False, shape=(DENSE_GEMV_MAX_ROWS + 1, 8))
    assert DENSE.kernel_linear(rows, {"weight": torch.zeros(4, 8)}, 8) is None
    trained = torch.zeros(4, 8, requires_grad=True)
    assert DENSE.kernel_linear(SimpleNamespace(is_cuda=True, requires_grad=False), {"weight": trained}, 8) is None
    monkeypatch.setenv("TIERLM_NO_TRITON_DENSE_GEMV", "1")
    assert DENSE.kernel_linear(SimpleNamespace(is_cuda=True), {}, 8) is None


def test_output_heads_stay_on_f_linear(monkeypatch):
    """The projections of GDN, QSA and PLE ask for the GEMV at a decode step; lm_head never does (it stays
    on F.linear: cuBLAS)."""
    from reference_models import CONFIGS

    from tierlm.config import ModelConfig
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.model_cache import ModelCache
    from tierlm.model.quantization.base import DenseFormat
    from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM

    asked = []
    monkeypatch.setattr(DenseFormat, "kernel_linear",
                        lambda self, x, tensors, in_features: asked.append(tensors["weight"]))
    config = ModelConfig.from_dict(CONFIGS["hc4_ple"])
    model = Qwen4ExpForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    for param in model.parameters():  # (finite values: the forward runs through routing and sampling-free steps)
        param.data.copy_(0.05 * torch.randn(param.shape, generator=gen))
    cache = ModelCache(config, 1, 4, BLOCK_SIZE, torch.float32)
    cache.reset_slot(0)
    with torch.no_grad():
        model(ForwardBatch.build([[5]], [0], [0], [[0]], BLOCK_SIZE), cache)
    asked = {id(w) for w in asked}
    assert id(model.lm_head.weight) not in asked
    for name in ("linear_attn.in_proj", "linear_attn.out_proj", "ple.key_value_proj"):
        assert id(model.model.layers[1].get_submodule(name).weight) in asked, name
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "self_attn.indexer.index_qk_proj"):
        assert id(model.model.layers[3].get_submodule(name).weight) in asked, name


def decode_logits(folder: Path, dtype: str, gemv: bool, device: str) -> torch.Tensor:
    """The decode steps' logits [steps * 2, V] in fp32 on the CPU; with gemv, checked to have run the GEMV in
    at least GDN's 2, QSA's 3 and PLE's 1 projection per step."""
    from tierlm.model.quantization.base import DenseFormat

    calls = []

    def through_gemv(self, x, tensors, in_features):
        y = DenseFormat.linear_kernel(self, x, tensors, in_features)
        calls.append(y is not None)
        return y

    saved = DenseFormat.kernel_linear
    DenseFormat.kernel_linear = through_gemv if gemv else (lambda self, x, tensors, in_features: None)
    try:
        logits = run_decode(folder, dtype, device)
    finally:
        DenseFormat.kernel_linear = saved
    assert not gemv or sum(calls) >= DECODE_STEPS * 6, sum(calls)
    return logits


def run_decode(folder: Path, dtype: str, device: str) -> torch.Tensor:
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.loader import load_model
    from tierlm.model.model_cache import ModelCache

    model, config = load_model(folder, dtype=dtype, device=device)
    cache = ModelCache(config, 2, 8, BLOCK_SIZE, getattr(torch, dtype), device)
    tables = [[0, 1, 2], [4, 5, 6]]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (21, 9)]
    logits = []
    with torch.no_grad():
        for slot in (0, 1):
            cache.reset_slot(slot)
        model(ForwardBatch.build(prompts, [0, 0], [0, 1], tables, BLOCK_SIZE, device), cache)
        positions = [len(p) for p in prompts]
        for _ in range(DECODE_STEPS):
            tokens = [[int(torch.randint(2, config.vocab_size, (1,), generator=gen))] for _ in prompts]
            logits.append(model(ForwardBatch.build(tokens, positions, [0, 1], tables, BLOCK_SIZE, device), cache))
            positions = [p + 1 for p in positions]
    return torch.cat(logits).float().cpu()


def test_model_decode_through_the_dense_gemv_equals_the_torch_path():
    on_cuda_else_interpreted(lambda: assert_kernel_path_close(decode_logits, "cuda"), INTERPRETED_EARLY,
                             "test_model_decode_through_the_dense_gemv_equals_the_torch_path")


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py): the child builds its model
    "test_model_decode_through_the_dense_gemv_equals_the_torch_path": ((
        "import test_dense_decode_gemv as t\n"
        "import tierlm.kernels.quant_linear.triton as kernels\n"
        "from reference_models import assert_kernel_path_close\n"
        "kernels.GEMV_BLOCK_N = kernels.DENSE_GEMV_BLOCK_N = 64  # (fewer programs: each costs the interpreter "
        "about the same, whatever its tile)\n"
        "assert_kernel_path_close(t.decode_logits, 'cpu')"),),
}
