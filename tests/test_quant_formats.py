"""Weight formats on their own: bit layouts checked against hand-built words, each format's dequantize
against the quantizer's own dequantization, the clip search against plain round-to-nearest, and the
quantization_config parser's errors."""

from __future__ import annotations

import pytest
import torch

from tierlm.model.quantization.base import QuantizationError
from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat
from tierlm.model.quantization.config import QuantizationConfig
from tierlm.model.quantization.gptq import GptqFormat
from tierlm.model.quantization.packing import pack_int32, unpack_int32
from tierlm.tools.quantize import quantize_weight, scheme_config


def _load(fmt, checkpoint: dict[str, torch.Tensor], n: int, k: int) -> dict[str, torch.Tensor]:
    """What the loader does with one module's checkpoint tensors: convert each to runtime tensors."""
    runtime = {}
    for name, tensor in checkpoint.items():
        runtime.update(fmt.convert(name, tensor, n, k, name))
    return runtime


def test_pack_layout_matches_hand_built_words():
    # 4 bits: eight values per word, value j at bits 4j (LSB first)
    values = torch.arange(1, 17).remainder(16).view(1, 16)
    words = pack_int32(values, 4)
    expected = [sum(int(v) << (4 * j) for j, v in enumerate(values[0, w * 8 : w * 8 + 8])) for w in range(2)]
    assert [w & 0xFFFFFFFF for w in words[0].tolist()] == expected
    # 6 bits: value i at bit 6i of the row's stream; value 5 straddles words 0 and 1 (bits 30..35)
    six = torch.tensor([[3, 0, 0, 0, 0, 0b101101] + [0] * 26])
    packed = pack_int32(six, 6)
    assert packed.shape == (1, 6)
    assert packed[0, 0].item() & 0xFFFFFFFF == 3 | (0b01 << 30)
    assert packed[0, 1].item() == 0b1011
    # 8 bits: four bytes per word, little end first; a word with the top bit set is a negative int32
    eight = torch.tensor([[0x01, 0x02, 0x03, 0xFF]])
    assert pack_int32(eight, 8).item() == 0xFF030201 - (1 << 32)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_pack_unpack_round_trip_along_either_dim(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (5, 70), generator=gen)  # 70: not a multiple of 32 / bits
    assert torch.equal(unpack_int32(pack_int32(values, bits), bits, 70), values.int())
    assert torch.equal(unpack_int32(pack_int32(values, bits, dim=0), bits, 5, dim=0), values.int())


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_quantized_dequantize_equals_the_quantizers_own(bits, group_size, dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + (group_size or 0))
    weight = (torch.randn(24, 256, generator=gen) * 0.02).to(dtype)
    result = quantize_weight(weight, bits, group_size)
    fmt = PackQuantizedFormat(bits, group_size)
    runtime = _load(fmt, fmt.pack(result.signed, result.scale), 24, 256)
    assert runtime["weight_packed"].shape == (24, 256 * bits // 32) and runtime["weight_scale"].dtype == dtype
    assert torch.equal(fmt.dequantize(runtime, 256), result.dequantized)
    # and close to the original: within half a step wherever the clip range covers the value
    step = result.scale.float().repeat_interleave(group_size or 256, dim=-1)
    inside = weight.float().abs() <= step * ((1 << (bits - 1)) - 1)
    error = (result.dequantized - weight.float()).abs()
    assert inside.float().mean() > 0.9 and (error[inside] <= step[inside] / 2 * (1 + 1e-6)).all()


def test_asymmetric_pack_quantized_with_packed_zero_points():
    """A hand-built asymmetric module: values and zero points stored unsigned, zero points packed along N."""
    n, k, bits, group = 8, 64, 4, 32
    gen = torch.Generator().manual_seed(0)
    stored = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, k // group), generator=gen)
    scales = torch.rand(n, k // group, generator=gen) + 0.5
    checkpoint = {
        "weight_packed": pack_int32(stored, bits),
        "weight_scale": scales,
        "weight_shape": torch.tensor([n, k]),
        "weight_zero_point": pack_int32(zeros, bits, dim=0),  # [ceil(8 * 4 / 32) = 1, groups]
    }
    fmt = PackQuantizedFormat(bits, group, symmetric=False)
    assert checkpoint["weight_zero_point"].shape == (1, 2)
    expected = (stored.float() - zeros.repeat_interleave(group, 1).float()) * scales.repeat_interleave(group, 1)
    assert torch.equal(fmt.dequantize(_load(fmt, checkpoint, n, k), k), expected)


def test_weight_shape_must_match():
    fmt = PackQuantizedFormat(4, 32)
    with pytest.raises(QuantizationError, match=r"x.weight_shape is \[8, 32\], expected \[8, 64\]"):
        fmt.convert("weight_shape", torch.tensor([8, 32]), 8, 64, "x.weight_shape")


def _gptq_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight by hand: word i of column n holds inputs i*pf .. i*pf+pf-1, value j at bit j*bits."""
    pf = 32 // bits
    k, n = q.shape
    words = torch.zeros(k // pf, n, dtype=torch.int64)
    for j in range(pf):
        words |= q[j::pf].long() << (bits * j)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).int()


@pytest.mark.parametrize("with_g_idx", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_dequantize_against_a_hand_built_module(with_g_idx, symmetric):
    bits, n, k, group = 4, 16, 64, 16
    gen = torch.Generator().manual_seed(int(with_g_idx) + 2 * int(symmetric))
    q = torch.randint(0, 16, (k, n), generator=gen)  # [K, N]: GPTQ stores W transposed
    scales = torch.rand(k // group, n, generator=gen) + 0.1
    zeros = torch.full((k // group, n), 8) if symmetric else torch.randint(1, 16, (k // group, n), generator=gen)
    g_idx = torch.randperm(k, generator=gen) // group if with_g_idx else torch.arange(k) // group
    qzeros = _gptq_words((zeros - 1).t().contiguous(), bits).t().contiguous()  # packed along N, minus one
    checkpoint = {"qweight": _gptq_words(q, bits), "scales": scales, "qzeros": qzeros}
    if with_g_idx:
        checkpoint["g_idx"] = g_idx.int()
    fmt = GptqFormat(bits, group, symmetric, with_g_idx)
    shapes = {name: t.shape for name, t in fmt.checkpoint_tensors(n, k).items()}
    assert shapes == {name: tuple(t.shape) for name, t in checkpoint.items()}
    expected = ((q.float() - zeros[g_idx].float()) * scales[g_idx]).t()
    assert torch.equal(fmt.dequantize(_load(fmt, checkpoint, n, k), k), expected)
    # the format's own writer produces the same words
    written = fmt.pack(q.t(), scales, None if symmetric else zeros, g_idx if with_g_idx else None)
    assert torch.equal(written["qweight"], checkpoint["qweight"])
    assert torch.equal(written["qzeros"], qzeros)


def test_clip_search_beats_round_to_nearest():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    for bits, most in ((4, 0.9), (6, 0.97)):  # measured: 0.80 and 0.93 of the round-to-nearest error
        plain = quantize_weight(weight, bits, 32, clip_search=False)
        searched = quantize_weight(weight, bits, 32, clip_search=True)
        err_plain = ((plain.dequantized - weight) ** 2).unflatten(-1, (8, 32)).sum(-1)
        err_searched = ((searched.dequantized - weight) ** 2).unflatten(-1, (8, 32)).sum(-1)
        assert (err_searched <= err_plain).all()  # per group: r = 1 is one of the candidates
        assert err_searched.sum() < most * err_plain.sum()


def _config(section):
    return QuantizationConfig.from_config_json({"quantization_config": section})


@pytest.mark.parametrize(
    "change,message",
    [
        ({"quant_method": "awq"}, "quant_method: 'awq' is not supported"),
        ({"config_groups": {}}, "config_groups: missing or empty"),
        ({"format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8}}}},
         "g.format: 'float-quantized' is not supported"),
        ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 9, "type": "int"}}}},
         "g.weights.num_bits: must be an integer in [2, 8], got 9"),
        ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
         "g.weights.type: 'float' is not supported"),
        ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "strategy": "group"}}}},
         "g.weights.group_size: strategy 'group' needs a positive integer"),
        ({"config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4},
                                  "input_activations": {"num_bits": 8}}}}, "activation quantization"),
        ({"config_groups": {"g": {"targets": [], "weights": {"num_bits": 4}}}}, "g.targets: expected a non-empty"),
    ],
)
def test_bad_compressed_tensors_config_names_the_field(change, message):
    section = {**scheme_config("int4", 32, []), **change}
    with pytest.raises(QuantizationError) as err:
        _config(section)
    assert message in str(err.value)


def test_bad_auto_round_config_names_the_field():
    with pytest.raises(QuantizationError, match="packing_format: 'auto_round:auto_awq' is not supported"):
        _config({"quant_method": "auto-round", "bits": 4, "group_size": 32, "packing_format": "auto_round:auto_awq"})
    rules = _config({"quant_method": "auto-round", "bits": 4, "group_size": 32,
                     "extra_config": {"model.layers.0.mlp.shared_expert.down_proj": {"bits": 6}}})
    with pytest.raises(QuantizationError, match="6-bit GPTQ packing is not supported"):
        rules.format_of("model.layers.0.mlp.shared_expert.down_proj", "linear")


def test_module_resolution_follows_targets_ignore_and_extra_config():
    ct = _config(scheme_config("int4-mixed", 32, ["re:.*layers\\.1\\.mlp\\.experts\\..*"]))
    assert ct.format_of("model.layers.0.mlp.experts.3.up_proj", "linear") == PackQuantizedFormat(4, 32)
    assert ct.format_of("model.layers.1.mlp.experts.3.up_proj", "linear").label == "dense"  # ignored
    assert ct.format_of("model.layers.0.mlp.shared_expert.down_proj", "linear") == PackQuantizedFormat(6, 32)
    assert ct.format_of("model.embed_tokens", "embedding") == PackQuantizedFormat(8, None)
    assert ct.format_of("model.layers.2.attn_hyper_connection.input_mix_weight_up", "linear").bits == 8
    assert ct.format_of("model.layers.2.linear_attn.in_proj_qkv", "linear").label == "dense"
    # the VLM checkpoint's names match too
    vlm = _config({**scheme_config("int4", 32, []), "ignore": ["model.language_model.layers.0.mlp.experts.1.up_proj"]})
    assert vlm.format_of("model.layers.0.mlp.experts.1.up_proj", "linear").label == "dense"
    # AutoRound: block_name_to_quantize, extra_config by suffix and regex, bits 16 = unquantized, lm_head dense
    ar = _config({"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": True,
                  "block_name_to_quantize": "model.language_model.layers",
                  "extra_config": {"shared_expert.down_proj": {"bits": 8, "group_size": -1},
                                   r".*experts\.0\..*": {"bits": 16}}})
    assert ar.format_of("model.layers.1.mlp.experts.5.gate_proj", "linear") == GptqFormat(4, 32, True)
    assert ar.format_of("model.layers.1.mlp.shared_expert.down_proj", "linear") == GptqFormat(8, -1, True)
    assert ar.format_of("model.layers.1.mlp.experts.0.gate_proj", "linear").label == "dense"
    assert ar.format_of("lm_head", "linear").label == "dense"
    assert ar.format_of("model.embed_tokens", "embedding").label == "dense"
