"""The quant methods hand the loaded runtime tensors to the fused Triton kernels in the layout those read:
the kernel path of a loaded pack-quantized linear layer and MoE layer against the torch reference path
of the same layer (the kernels' own accuracy against their reference is tests/test_*_kernel.py's).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is first
imported), in a child process. fp32: the two paths differ only in the order of fp32 sums (K <= 64 here),
so 1e-5 of the output's magnitude bounds them; a wrong bit, group, scale or expert is off by far more.
"""

from __future__ import annotations

import pytest
from interpreted import interpreted_json
from reference_models import build_reference

from tierlm.tools.quantize import quantize_checkpoint

CHILD = r"""
import json, sys, torch
from tierlm.model.loader import load_model
from tierlm.model.quantization.base import runtime_view

results = {}
int4, int8 = sys.argv[1], sys.argv[2]
gen = torch.Generator().manual_seed(0)
model, config = load_model(int4, dtype="float32", device="cpu")
experts = model.model.layers[0].mlp.experts
method = experts.quant_method
x = torch.randn(3, config.hidden_size, generator=gen)
ids = torch.stack([torch.randperm(config.num_experts, generator=gen)[:2] for _ in range(3)])
weights = torch.rand(3, 2, generator=gen)
reference = experts(x, weights, ids)  # CPU: no kernel, the torch reference
kernel = method.format.experts_kernel(x, method._stack(experts, "gate_up"), method._stack(experts, "down"),
                                      weights, ids)
results["experts"] = [(kernel - reference).abs().max().item(), reference.abs().max().item()]

model, config = load_model(int8, dtype="float32", device="cpu")
for name, layer in (("lm_head", model.lm_head), ("o_proj", model.model.layers[3].self_attn.o_proj)):
    fmt = layer.quant_method.format
    x = torch.randn(2, layer.in_features, generator=gen)
    reference = layer(x)
    kernel = fmt.linear_kernel(x, runtime_view(layer, fmt), layer.in_features)
    results[name] = [(kernel - reference).abs().max().item(), reference.abs().max().item()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory):
    base = tmp_path_factory.mktemp("base")
    build_reference("hc4_ple", base)
    int4 = quantize_checkpoint(base, tmp_path_factory.mktemp("int4"), "int4", 32)
    int8 = quantize_checkpoint(base, tmp_path_factory.mktemp("int8"), "int8", 32)
    return interpreted_json(CHILD, str(int4), str(int8))


@pytest.mark.parametrize("layer", ["experts", "lm_head", "o_proj"])
def test_kernel_path_equals_reference_path(kernel_results, layer):
    difference, magnitude = kernel_results[layer]
    assert magnitude > 0 and difference <= 1e-5 * magnitude
