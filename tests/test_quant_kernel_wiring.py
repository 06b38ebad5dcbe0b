"""The quant methods hand the loaded runtime tensors to the fused Triton kernels in the layout those read:
the kernel path of a loaded pack-quantized linear layer and MoE layer, and of an unquantized MoE layer,
each MoE layer also with its block's shared expert inside the kernel (unquantized; INT6 beside INT4 in
int4-mixed), and the INT8 embedding gathered into the hc streams by `kernels/embed_streams` (the whole
model's logits, bit for bit), against the torch reference path of the same layer (the kernels' own accuracy against their reference is
tests/test_*_kernel.py's); which path a layer takes (the kernel on CUDA, unless switched off).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is first
imported), in a child process. fp32: the two paths differ only in the order of fp32 sums (K <= 64 here),
so 1e-5 of the output's magnitude bounds them; a wrong bit, group, scale or expert is off by far more.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from interpreted import interpreted_json


def kernel_vs_reference(device: str) -> dict[str, list[float]]:
    """{layer: [max |kernel path - reference path|, max |reference|]} over checkpoints it builds and
    quantizes in a temporary folder; the reference runs on the CPU, the kernel on `device` (CPU: through the
    interpreter, in the child process)."""
    import tempfile

    from reference_models import build_reference

    from tierlm.tools.quantize import quantize_checkpoint

    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        base.mkdir()
        build_reference("hc4_ple", base)
        int4_mixed = quantize_checkpoint(base, Path(folder) / "int4-mixed", "int4-mixed", 16)  # (shared width 48)
        int8 = quantize_checkpoint(base, Path(folder) / "int8", "int8", 32)
        return _compare(base, int4_mixed, int8, device)


def _compare(base: Path, int4_mixed: Path, int8: Path, device: str) -> dict[str, list[float]]:
    def on(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: t.to(device) for name, t in tensors.items()}

    from tierlm.kernels.fused_moe import triton as fused_moe_triton

    apart = fused_moe_triton.PACKED_SHARED_APART_TOKENS
    fused_moe_triton.PACKED_SHARED_APART_TOKENS = range(0)  # (a speed choice: here the fused form's numbers at 3 tokens)
    try:
        return _compare_formats(base, int4_mixed, int8, device, on)
    finally:
        fused_moe_triton.PACKED_SHARED_APART_TOKENS = apart


def _compare_formats(base: Path, int4_mixed: Path, int8: Path, device: str, on) -> dict[str, list[float]]:
    from tierlm.model.loader import load_model
    from tierlm.model.quantization.base import runtime_view

    results = {}
    gen = torch.Generator().manual_seed(0)
    for name, folder in (("dense experts", base), ("experts", int4_mixed)):
        model, config = load_model(folder, dtype="float32", device="cpu")
        mlp = model.model.layers[0].mlp
        method = mlp.experts.quant_method
        x = torch.randn(3, config.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(config.num_experts, generator=gen)[:2] for _ in range(3)])
        weights, gate = torch.rand(3, 2, generator=gen), torch.rand(3, 1, generator=gen)
        reference = mlp.experts(x, weights, ids)  # CPU: no kernel, the torch reference
        args = (x.to(device), on(method._stack(mlp.experts, "gate_up")), on(method._stack(mlp.experts, "down")),
                weights.to(device), ids.to(device))
        kernel = method.format.experts_kernel(*args)
        results[name] = [(kernel.cpu() - reference).abs().max().item(), reference.abs().max().item()]
        # the shared expert (unquantized; INT6 in int4-mixed) in the experts' launches, as the block runs it
        shared = mlp.shared_expert.as_fused_expert(gate)
        shared = shared._replace(gate=gate.to(device), w_gate_up=shared.w_gate_up.to(device),
                                 w_down=shared.w_down.to(device),
                                 scales=shared.scales and tuple(s.to(device) for s in shared.scales))
        reference = reference + gate * mlp.shared_expert(x)
        kernel = method.format.experts_kernel(*args, shared=shared)
        results[f"{name} + shared"] = [(kernel.cpu() - reference).abs().max().item(), reference.abs().max().item()]
    model, config = load_model(int8, dtype="float32", device="cpu")
    for name, layer in (("lm_head", model.lm_head), ("o_proj", model.model.layers[3].self_attn.o_proj)):
        fmt = layer.quant_method.format
        x = torch.randn(2, layer.in_features, generator=gen)
        reference = layer(x)
        kernel = fmt.linear_kernel(x.to(device), on(runtime_view(layer, fmt)), layer.in_features)
        results[name] = [(kernel.cpu() - reference).abs().max().item(), reference.abs().max().item()]
    return results


CHILD = "import json, test_quant_kernel_wiring as t; print(json.dumps(t.kernel_vs_reference('cpu')))"


@pytest.fixture(scope="module")
def kernel_results():
    if torch.cuda.is_available():
        return kernel_vs_reference("cuda")
    return interpreted_json(*INTERPRETED_EARLY["test_kernel_path_equals_reference_path"])


EMBEDDING_CHILD = ("import json, test_quant_kernel_wiring as t; "
                   "print(json.dumps(t.fused_embedding_vs_torch_path('cpu')))")

# (queued when collection ends, see tests/interpreted.py): the children build and quantize their checkpoints
INTERPRETED_EARLY = {"test_kernel_path_equals_reference_path": (CHILD,),
                     "test_int8_embedding_kernel_path_gives_the_torch_paths_logits": (EMBEDDING_CHILD,)}


@pytest.mark.parametrize("layer", ["experts", "dense experts", "experts + shared", "dense experts + shared", "lm_head",
                                   "o_proj"])
def test_kernel_path_equals_reference_path(kernel_results, layer):
    difference, magnitude = kernel_results[layer]
    assert magnitude > 0 and difference <= 1e-5 * magnitude


def test_dense_experts_take_the_kernel_on_cuda_only_unless_switched_off(monkeypatch):
    """CPU: the torch path (no kernel). CUDA: the fused kernel, unless TIERLM_NO_FUSED_MOE=1 (checked before
    anything touches the tensors, so a stand-in for a CUDA tensor shows it)."""
    from tierlm.model.quantization.base import DENSE

    monkeypatch.delenv("TIERLM_NO_FUSED_MOE", raising=False)
    assert DENSE.kernel_experts(torch.zeros(1, 4), {}, {}, None, None) is None
    monkeypatch.setenv("TIERLM_NO_FUSED_MOE", "1")
    assert DENSE.kernel_experts(SimpleNamespace(is_cuda=True), {}, {}, None, None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_on_cuda_run_the_fused_kernel(monkeypatch, dtype):
    """On CUDA an unquantized `Experts` layer returns exactly the fused kernel's output (decode and prefill
    sizes), and with TIERLM_NO_FUSED_MOE=1 exactly the torch path's (in fp32 the two within 1e-5)."""
    from tierlm.kernels.fused_moe import triton as fused
    from tierlm.model.layers.moe import Experts
    from tierlm.model.quantization.base import DenseFormat

    gen = torch.Generator().manual_seed(0)
    experts = Experts(16, 128, 64).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(16, 128, 128, generator=gen) * 128**-0.5)
        experts.down_proj.copy_(torch.randn(16, 128, 64, generator=gen) * 64**-0.5)
    experts = experts.cuda()
    for tokens in (2, 40):  # 4 pairs: the decode GEMVs; 80 pairs: the grouped GEMM
        x = torch.randn(tokens, 128, generator=gen).to(dtype).cuda()
        weights = torch.rand(tokens, 2, generator=gen).to(dtype).cuda()
        ids = torch.stack([torch.randperm(16, generator=gen)[:2] for _ in range(tokens)]).cuda()
        monkeypatch.delenv("TIERLM_NO_FUSED_MOE", raising=False)
        out = experts(x, weights, ids)
        assert torch.equal(out, fused.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids))
        with monkeypatch.context() as patch:
            patch.setattr(DenseFormat, "kernel_experts", lambda self, *args: None)
            torch_path = experts(x, weights, ids)
        monkeypatch.setenv("TIERLM_NO_FUSED_MOE", "1")
        assert torch.equal(experts(x, weights, ids), torch_path)
        if dtype == torch.float32:
            assert (out - torch_path).abs().max() <= 1e-5 * torch_path.abs().max()


def moe_block(dtype: torch.dtype, seed: int = 0):
    """A small SparseMoeBlock (16 experts, top-2, shared expert width 48) with random weights."""
    from tierlm.model.layers.moe import SparseMoeBlock

    config = SimpleNamespace(hidden_size=128, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
                             moe_intermediate_size=64, shared_expert_intermediate_size=48)
    block = SparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * parameter.shape[-1] ** -0.5)
    return block.to(dtype)


def test_shared_expert_runs_apart_where_the_kernel_does_not_take_it(monkeypatch):
    """The MoE block fuses its shared expert on CUDA only, unless TIERLM_NO_FUSED_SHARED_EXPERT=1; where the
    experts' kernel does not take it (here: the CPU) the block's output is the unfused sum, bit for bit;
    a shared expert whose projections are in two formats is never handed to the kernel."""
    from tierlm.model.layers import moe
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

    monkeypatch.delenv("TIERLM_NO_FUSED_SHARED_EXPERT", raising=False)
    assert not moe.fuse_shared_expert(torch.zeros(1, 4))
    assert moe.fuse_shared_expert(SimpleNamespace(is_cuda=True))
    monkeypatch.setenv("TIERLM_NO_FUSED_SHARED_EXPERT", "1")
    assert not moe.fuse_shared_expert(SimpleNamespace(is_cuda=True))

    block = moe_block(torch.float32)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    weights, experts, gate = block.route(x)
    unfused = block.experts(x, weights, experts) + gate * block.shared_expert(x)
    monkeypatch.setattr(moe, "fuse_shared_expert", lambda x: True)
    offered = []
    real = moe.Experts.with_shared  # (offered the shared expert, the kernel path declines it on a CPU)
    monkeypatch.setattr(moe.Experts, "with_shared", lambda self, *args: offered.append(args[-1]) or real(self, *args))
    assert torch.equal(block(x), unfused) and offered[0].format == "unquantized"
    block.shared_expert.down_proj.set_format(PackQuantizedFormat(6, 16))
    assert block.shared_expert.as_fused_expert(gate) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_on_cuda_fuses_its_shared_expert(monkeypatch, dtype):
    """On CUDA a decode batch's MoE block returns the fused kernel's routed + shared sum (exactly), and with
    TIERLM_NO_FUSED_SHARED_EXPERT=1 the two apart; against the same sum in fp32 (same routing), the fused
    output is off by at most twice the unfused path's own error plus one unit of x's dtype (fp32: both
    at fp32 roundoff); a prefill batch is the same either way."""
    from tierlm.kernels.fused_moe import naive
    from tierlm.kernels.fused_moe import triton as fused

    block = moe_block(dtype).cuda()
    gen = torch.Generator().manual_seed(2)
    for tokens in (3, 100):  # decode (6 pairs): fused; prefill (200 > DECODE_MAX_PAIRS): apart
        x = torch.randn(tokens, 128, generator=gen).to(dtype).cuda()
        weights, experts, gate = block.route(x)
        monkeypatch.delenv("TIERLM_NO_FUSED_SHARED_EXPERT", raising=False)
        out = block(x)
        monkeypatch.setenv("TIERLM_NO_FUSED_SHARED_EXPERT", "1")
        apart = block(x)
        if tokens * 2 > fused.DECODE_MAX_PAIRS:
            assert torch.equal(out, apart)
            continue
        shared = block.shared_expert.as_fused_expert(gate)
        assert torch.equal(out, fused.fused_moe(x, block.experts.gate_up_proj, block.experts.down_proj, weights,
                                                experts, shared=shared))
        exact = naive.fused_moe(x.float(), block.experts.gate_up_proj.float(), block.experts.down_proj.float(),
                                weights.float(), experts,
                                shared=naive.SharedExpert(*(t.float() for t in shared[:3])))
        apart_error = (apart.float() - exact).abs().max()
        bound = 2 * apart_error + torch.finfo(dtype).eps * exact.abs().max()
        assert (out.float() - exact).abs().max() <= bound


def test_int8_embedding_takes_the_embed_streams_kernel_on_cuda_only_unless_switched_off(monkeypatch, tmp_path):
    """An int4-mixed model's INT8 per-row embedding hands its packed words and scales to the embed-streams
    kernel (a dense table itself; another format nothing: the torch path), and the model asks for that kernel
    on CUDA only, unless TIERLM_NO_FUSED_EMBED_STREAMS=1 (checked on a stand-in for a CUDA tensor)."""
    from reference_models import build_reference

    from tierlm.model.layers.embedding import Embedding
    from tierlm.model.loader import load_model
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat
    from tierlm.model.qwen4_exp import fused_embed_streams
    from tierlm.tools.quantize import quantize_checkpoint

    build_reference("hc4_ple", tmp_path / "base")
    model, config = load_model(quantize_checkpoint(tmp_path / "base", tmp_path / "q", "int4-mixed", 16),
                               dtype="float32", device="cpu")
    embedding = model.model.embed_tokens
    words, scales = embedding.kernel_table()
    assert words is embedding.weight_packed and words.shape == (config.vocab_size, config.hidden_size // 4)
    assert scales is embedding.weight_scale and scales.shape == (config.vocab_size, 1)
    dense = Embedding(10, 8)
    assert dense.kernel_table() == (dense.weight, None)
    dense.set_format(PackQuantizedFormat(8, 4))  # INT8 in groups: not the kernel's form
    assert dense.kernel_table() is None
    monkeypatch.delenv("TIERLM_NO_FUSED_EMBED_STREAMS", raising=False)
    assert not fused_embed_streams(torch.zeros(1, dtype=torch.int64))
    assert fused_embed_streams(SimpleNamespace(is_cuda=True))
    monkeypatch.setenv("TIERLM_NO_FUSED_EMBED_STREAMS", "1")
    assert not fused_embed_streams(SimpleNamespace(is_cuda=True))


def fused_embedding_vs_torch_path(device: str) -> dict[str, dict]:
    """{dtype: {"int8 launches": embed-streams kernel launches given an INT8 table, "dense launches": given a
    dense one, "equal": the logits bit for bit equal to the torch path's}} for an int4-mixed model on
    `device` over a 9-token prefill then 2 decode steps, with the kernel switched on (CPU: the interpreter
    runs it; the model's other layers keep their CPU paths) and then off."""
    import tempfile

    from reference_models import build_reference

    from tierlm.kernels.embed_streams import triton as kernels
    from tierlm.model import qwen4_exp
    from tierlm.model.loader import load_model
    from tierlm.tools.quantize import quantize_checkpoint

    launches = []
    real_kernel = kernels.embed_streams

    def spy(table, ids, hc_count, scales=None):
        launches.append("int8" if scales is not None else "dense")
        return real_kernel(table, ids, hc_count, scales)

    real_applies = qwen4_exp.fused_embed_streams
    kernels.embed_streams = spy
    results = {}
    try:  # (restored after: on CUDA this runs in the test process, beside the other GPU tests)
        with tempfile.TemporaryDirectory() as folder:
            build_reference("hc4_ple", Path(folder) / "base")
            int4_mixed = quantize_checkpoint(Path(folder) / "base", Path(folder) / "q", "int4-mixed", 16)
            for dtype in ("float32", "bfloat16"):
                model, config = load_model(int4_mixed, dtype=dtype, device=device)
                launches.clear()
                qwen4_exp.fused_embed_streams = lambda token_ids: True
                fused = _prefill_then_decode(model, config, device)
                counts = {f"{form} launches": launches.count(form) for form in ("int8", "dense")}
                qwen4_exp.fused_embed_streams = lambda token_ids: False
                results[dtype] = {**counts, "equal": torch.equal(fused, _prefill_then_decode(model, config, device))}
    finally:
        kernels.embed_streams, qwen4_exp.fused_embed_streams = real_kernel, real_applies
    return results


def _prefill_then_decode(model, config, device: str) -> torch.Tensor:
    """The logits (fp32, on the CPU) of a 9-token prefill and 2 one-token decode steps through one slot."""
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.model_cache import ModelCache

    block_size = 12
    cache = ModelCache(config, 1, 4, block_size, next(model.parameters()).dtype, device)
    cache.reset_slot(0)
    ids = torch.randint(2, config.vocab_size, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    out = []
    for start, end in ((0, 9), (9, 10), (10, 11)):
        batch = ForwardBatch.build([ids[start:end]], [start], [0], [list(range(4))], block_size, logits="all",
                                   device=device)
        out.append(model(batch, cache).float().cpu())
    return torch.cat(out)


def test_int8_embedding_kernel_path_gives_the_torch_paths_logits():
    """The int4-mixed model's logits with its INT8 embedding gathered by the embed-streams kernel (one launch
    a forward) equal the torch path's bit for bit, in fp32 and bf16 (CPU: in the interpreter child)."""
    if torch.cuda.is_available():
        results = fused_embedding_vs_torch_path("cuda")
    else:
        results = interpreted_json(*INTERPRETED_EARLY["test_int8_embedding_kernel_path_gives_the_torch_paths_logits"])
    for dtype in ("float32", "bfloat16"):
        assert results[dtype] == {"int8 launches": 3, "dense launches": 0, "equal": True}, dtype
