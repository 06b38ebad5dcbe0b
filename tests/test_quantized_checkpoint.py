"""Quantized checkpoints end to end: `tierlm quantize` -> load -> the packed layers dequantize to exactly
the quantizer's tensors, the model's logits equal a dense model built from those tensors (fp32), an
AutoRound / GPTQ checkpoint loads the same way, a tied embedding / lm_head is stored and held once,
unknown tensors are skipped, bad configs are named, and a quantized demo model generates through
`tierlm.LLM`."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from reference_models import BASE, build_reference
from safetensors.torch import load_file, save_file

from tierlm.cli import main as cli_main
from tierlm.config import ModelConfig
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import CheckpointError, load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.quantization.gptq import GptqFormat
from tierlm.tools.quantize import quantize_checkpoint, quantize_weight

GROUP = 16  # divides every width of the reference config (H 64, I 32, shared 48, low rank 16)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    build_reference("hc4_ple", folder)
    return folder


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    return quantize_checkpoint(base, tmp_path_factory.mktemp("int4mixed"), "int4-mixed", GROUP)


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _dense_copy(base, out, replace: dict[str, torch.Tensor]):
    """`base` with some weights replaced (the dequantized reference model)."""
    shutil.copytree(base, out)
    tensors = _weights(out)
    tensors.update(replace)
    save_file(tensors, out / "model.safetensors")
    return out


def _logits(model, config, ids: list[int], chunk: int = 17, device: str = "cpu") -> torch.Tensor:
    """The model's logits (fp32) over `ids`, prefilled in chunks through one request slot."""
    block_size = 12
    cache = ModelCache(config, 1, 16, block_size, next(model.parameters()).dtype, device)
    cache.reset_slot(0)
    table, out = list(range(16)), []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        batch = ForwardBatch.build([piece], [start], [0], [table], block_size, logits="all", device=device)
        out.append(model(batch, cache).float().cpu())
    return torch.cat(out)


def _int4_mixed_modules(config: ModelConfig) -> dict[str, tuple[int, int | None]]:
    """Checkpoint module -> (bits, group) of every module the int4-mixed scheme quantizes."""
    modules = {"model.embed_tokens": (8, None), "lm_head": (8, None)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}"
        for hc in ("attn_hyper_connection", "mlp_hyper_connection"):
            for proj in ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight"):
                modules[f"{p}.{hc}.{proj}"] = (8, None)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            modules[f"{p}.mlp.shared_expert.{proj}"] = (6, GROUP)
            for e in range(config.num_experts):
                modules[f"{p}.mlp.experts.{e}.{proj}"] = (4, GROUP)
    for proj in ("input_mix_weight_down", "input_mix_weight_up"):
        modules[f"model.hyper_connection_mixer.{proj}"] = (8, None)
    return modules


def _dequantized_originals(base, config) -> dict[str, torch.Tensor]:
    """What the quantizer makes of each quantized module's weight (its own dequantization); a tied model
    has no lm_head.weight (the embedding is its lm_head)."""
    originals = _weights(base)
    return {
        f"{module}.weight": quantize_weight(originals[f"{module}.weight"], bits, group).dequantized
        for module, (bits, group) in _int4_mixed_modules(config).items() if f"{module}.weight" in originals
    }


def test_quantized_checkpoint_holds_packed_tensors(quantized):
    tensors = _weights_any(quantized)
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight_packed"].dtype == torch.int32
    assert tensors["model.layers.0.mlp.experts.3.up_proj.weight_packed"].shape == (32, 64 * 4 // 32)
    assert tensors["model.layers.0.mlp.shared_expert.down_proj.weight_packed"].shape == (64, 48 * 6 // 32)
    assert tensors["model.embed_tokens.weight_scale"].shape == (512, 1)
    assert tensors["lm_head.weight_shape"].tolist() == [512, 64]
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in tensors  # bf16 part stays dense
    raw = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert raw["quant_method"] == "compressed-tensors" and raw["format"] == "pack-quantized"


def _weights_any(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_load_dequantizes_to_exactly_the_quantizers_tensors(base, quantized):
    model, config = load_model(quantized, dtype="float32", device="cpu")
    expected = _dequantized_originals(base, config)
    layer = model.model.layers[1]
    # stacked experts: gate rows then up rows of each expert
    experts = layer.mlp.experts
    for e in (0, 5):
        gate_up = experts.quant_method.expert_weight(experts, "gate_up", e, torch.float32)
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(gate_up, torch.cat([expected[f"{p}.gate_proj.weight"], expected[f"{p}.up_proj.weight"]]))
        down = experts.quant_method.expert_weight(experts, "down", e, torch.float32)
        assert torch.equal(down, expected[f"{p}.down_proj.weight"])
    # a packed module (hyper-connection down + injection), a single one and the shared expert
    hc = layer.mlp_hyper_connection
    p = "model.layers.1.mlp_hyper_connection"
    assert torch.equal(hc.down_and_inject.quant_method.dequantized_weight(hc.down_and_inject, torch.float32),
                       torch.cat([expected[f"{p}.input_mix_weight_down.weight"],
                                  expected[f"{p}.block_inject_weight.weight"]]))
    assert torch.equal(hc.input_mix_weight_up.quant_method.dequantized_weight(hc.input_mix_weight_up, torch.float32),
                       expected[f"{p}.input_mix_weight_up.weight"])
    shared = layer.mlp.shared_expert.down_proj
    assert torch.equal(shared.quant_method.dequantized_weight(shared, torch.float32),
                       expected["model.layers.1.mlp.shared_expert.down_proj.weight"])
    # the embedding: only gathered rows are dequantized
    ids = torch.tensor([[0, 7], [511, 7]])
    assert torch.equal(model.model.embed_tokens(ids), expected["model.embed_tokens.weight"][ids])
    # packed in memory: no dense weight anywhere for a quantized module
    assert experts.gate_up_weight_packed.dtype == torch.int32 and not hasattr(experts, "gate_up_proj")


def test_quantized_logits_equal_the_dequantized_dense_model(base, quantized, tmp_path):
    model, config = load_model(quantized, dtype="float32", device="cpu")
    dense_dir = _dense_copy(base, tmp_path / "dense", _dequantized_originals(base, config))
    dense, _ = load_model(dense_dir, dtype="float32", device="cpu")
    ids = torch.randint(2, config.vocab_size, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    got, expected = _logits(model, config, ids), _logits(dense, config, ids)
    assert (got - expected).abs().max().item() <= TOLERANCE
    original, _ = load_model(base, dtype="float32", device="cpu")
    assert (_logits(original, config, ids) - got).abs().max().item() > 100 * TOLERANCE  # it did quantize


def _tied_copy(base, out):
    """`base` with tie_word_embeddings: its lm_head.weight dropped (the embedding serves as lm_head)."""
    shutil.copytree(base, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    tensors = _weights(out)
    del tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors")
    return out


def test_tied_int8_embedding_is_stored_and_held_once_and_serves_as_lm_head(base, tmp_path):
    """tie_word_embeddings: the INT8 per-channel table is written once (as model.embed_tokens), loaded once
    (lm_head runs on the embedding's packed tensors), round-trips to the quantizer's own tensors, and the
    logits equal the dense model built from them."""
    base = _tied_copy(base, tmp_path / "tied")
    quantized = quantize_checkpoint(base, tmp_path / "tied-q", "int4-mixed", GROUP)
    assert not [name for name in _weights_any(quantized) if name.startswith("lm_head.")]
    model, config = load_model(quantized, dtype="float32", device="cpu")
    embed, head = model.model.embed_tokens, model.lm_head
    assert head.weight_packed is embed.weight_packed and head.weight_scale is embed.weight_scale
    assert embed.weight_packed.dtype == torch.int32 and not hasattr(head, "weight")
    expected = _dequantized_originals(base, config)
    table = expected["model.embed_tokens.weight"]
    assert torch.equal(head.quant_method.dequantized_weight(head, torch.float32), table)
    ids = torch.tensor([[0, 7], [511, 7]])
    assert torch.equal(embed(ids), table[ids])
    dense, _ = load_model(_dense_copy(base, tmp_path / "dense", expected), dtype="float32", device="cpu")
    ids = torch.randint(2, config.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    assert (_logits(model, config, ids) - _logits(dense, config, ids)).abs().max().item() <= TOLERANCE
    with pytest.raises(CheckpointError, match="embed_tokens is int8.* but lm_head is dense"):
        quantize_checkpoint(base, tmp_path / "half-tied", "int4-mixed", GROUP, ignore=["lm_head"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_hyper_connections_over_int8_mixers_match_torch_on_gpu(quantized, monkeypatch):
    """The int4-mixed model (INT8 per-channel hyper-connection mixers) in fp32 on the GPU: the fused mix
    kernels, which read the INT8 mixers in place (chunks of <= 64 tokens), give the torch path's logits."""
    from tierlm.model.layers.hyper_connection import HyperConnection, kernel_weight

    model, config = load_model(quantized, dtype="float32", device="cuda")
    mixers = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert mixers and all(kernel_weight(m.down_and_inject)[1] is not None for m in mixers)
    ids = torch.randint(2, config.vocab_size, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    fused = _logits(model, config, ids, device="cuda")
    monkeypatch.setenv("TIERLM_NO_FUSED_HC", "1")
    torch.testing.assert_close(fused, _logits(model, config, ids, device="cuda"), rtol=0, atol=TOLERANCE)


def _dequantized_from_model(model, dtype) -> dict[str, torch.Tensor]:
    """Every quantized checkpoint module's weight as the loaded model dequantizes it in `dtype`."""
    weights = {}
    for path, module in model.named_modules():
        if not hasattr(module, "checkpoint_modules") or module.quant_method.format.label == "dense":
            continue
        for part in module.checkpoint_modules(path):
            if module.kind == "experts":
                full = module.quant_method.expert_weight(module, part.projection, part.expert, dtype)
            elif module.kind == "embedding":
                full = module(torch.arange(module.num_embeddings))
            else:
                full = module.quant_method.dequantized_weight(module, dtype)
            weights[f"{part.name}.weight"] = full[part.start : part.end].clone()
    return weights


def test_quantized_model_in_bf16_equals_its_dequantized_dense_model(base, quantized, tmp_path):
    """In bf16 (scales rounded to bf16 on load) the packed layers compute exactly what dense layers holding
    their dequantized weights compute."""
    model, config = load_model(quantized, dtype="bfloat16", device="cpu")
    dense_dir = _dense_copy(base, tmp_path / "dense", _dequantized_from_model(model, torch.bfloat16))
    dense, _ = load_model(dense_dir, dtype="bfloat16", device="cpu")
    ids = torch.randint(2, config.vocab_size, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    assert torch.equal(_logits(model, config, ids), _logits(dense, config, ids))


def test_expert_forms_agree_on_quantized_experts(quantized):
    model, config = load_model(quantized, dtype="float32", device="cpu")
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, config.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(config.num_experts, generator=gen)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, generator=gen)
    grouped = experts(x, weights, ids)  # 24 pairs: grouped by expert
    per_pair = experts(x[:8], weights[:8], ids[:8])  # 16 pairs: the small-batch loop
    gathered = experts(x, weights, ids, static=True)
    assert torch.allclose(grouped[:8], per_pair, atol=1e-6) and torch.allclose(grouped, gathered, atol=1e-6)


# ---- AutoRound / GPTQ ---------------------------------------------------------------------------------


def _gptq_symmetric(weight: torch.Tensor, perm: torch.Tensor):
    """Quantize W [N, K] in activation order `perm` (groups of GROUP permuted inputs) -> GPTQ tensors and
    the dequantized weight."""
    result = quantize_weight(weight[:, perm], 4, GROUP)
    signed = torch.empty_like(result.signed)
    signed[:, perm] = result.signed
    g_idx = torch.empty(weight.shape[1], dtype=torch.int32)
    g_idx[perm] = torch.arange(weight.shape[1], dtype=torch.int32) // GROUP
    dequantized = torch.empty_like(result.dequantized)
    dequantized[:, perm] = result.dequantized
    tensors = GptqFormat(4, GROUP, True, True).pack(signed.int() + 8, result.scale.t().contiguous(), None, g_idx)
    return tensors, dequantized


def _gptq_asymmetric(weight: torch.Tensor, bits: int = 8):
    """Min/max asymmetric quantization in groups of GROUP -> GPTQ tensors (identity g_idx), dequantized."""
    k = weight.shape[1]
    qmax = (1 << bits) - 1
    grouped = weight.unflatten(-1, (-1, GROUP))
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scale = (high - low) / qmax
    zero = torch.round(-low / scale).clamp(1, qmax)
    q = torch.clamp(torch.round(grouped / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, qmax)
    dequantized = ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).flatten(-2)
    tensors = GptqFormat(bits, GROUP, False, True).pack(
        q.flatten(-2).int(), scale.t().contiguous(), zero.t().contiguous(), torch.arange(k) // GROUP
    )
    return tensors, dequantized


def test_auto_round_gptq_checkpoint_loads_and_matches_its_dense_model(base, tmp_path):
    config = ModelConfig.from_pretrained(base)
    originals = _weights(base)
    quantized, dense = {}, {}
    gen = torch.Generator().manual_seed(2)
    for layer in range(config.num_hidden_layers):
        for e in range(config.num_experts):
            perm = torch.randperm(config.hidden_size, generator=gen)  # gate and up share the input's order
            for proj in ("gate_proj", "up_proj", "down_proj"):
                module = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                order = perm if proj != "down_proj" else torch.randperm(config.moe_intermediate_size, generator=gen)
                tensors, dense[f"{module}.weight"] = _gptq_symmetric(originals.pop(f"{module}.weight"), order)
                quantized.update({f"{module}.{k}": v for k, v in tensors.items()})
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = f"model.layers.{layer}.mlp.shared_expert.{proj}"
            tensors, dense[f"{module}.weight"] = _gptq_asymmetric(originals.pop(f"{module}.weight"))
            quantized.update({f"{module}.{k}": v for k, v in tensors.items()})
    folder = tmp_path / "autoround"
    shutil.copytree(base, folder)
    save_file({**originals, **quantized}, folder / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": 4, "group_size": GROUP,
        "sym": True, "data_type": "int", "block_name_to_quantize": "model.layers",
        "extra_config": {"shared_expert.gate_proj": {"bits": 8, "sym": False},
                         "shared_expert.up_proj": {"bits": 8, "sym": False},
                         "shared_expert.down_proj": {"bits": 8, "sym": False},
                         r"^(?!.*(experts|shared_expert)\.).*$": {"bits": 16}},
    }
    (folder / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(folder, dtype="float32", device="cpu")
    assert model.model.layers[0].mlp.experts.quant_method.format == GptqFormat(4, GROUP, True, True)
    assert model.model.layers[0].mlp.shared_expert.gate_up.quant_method.format == GptqFormat(8, GROUP, False, True)
    reference, _ = load_model(_dense_copy(base, tmp_path / "dense", dense), dtype="float32", device="cpu")
    ids = torch.randint(2, config.vocab_size, (30,), generator=gen).tolist()
    assert (_logits(model, config, ids) - _logits(reference, config, ids)).abs().max().item() <= TOLERANCE

    # gate and up run as one matrix: their activation orders must agree
    bad = _weights(folder)
    bad["model.layers.0.mlp.experts.0.up_proj.g_idx"] = bad["model.layers.0.mlp.experts.0.up_proj.g_idx"].flip(0)
    save_file(bad, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.up_proj\.g_idx differs from the g_idx"):
        load_model(folder, dtype="float32", device="cpu")


# ---- what the loader refuses or skips -----------------------------------------------------------------


def test_unknown_tensors_are_skipped_with_one_log_line(quantized, tmp_path, caplog):
    folder = tmp_path / "extra"
    shutil.copytree(quantized, folder)
    extra = {
        "model.layers.0.mlp.experts.1.gate_proj.input_global_scale": torch.ones(1),
        "model.layers.0.ple.ple_embedding.hashstats_counts": torch.zeros(4),
        "model.hyper_connection_mixer.block_inject_weight.weight": torch.zeros(4, 256),
    }
    save_file(extra, folder / "model-extra.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "model-extra.safetensors" for name in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO, logger="tierlm.model.loader"):
        load_model(folder, dtype="float32", device="cpu")
    lines = [r.getMessage() for r in caplog.records if "inference does not use" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("skipping 3 checkpoint tensors")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda q: q.update(quant_method="bitsandbytes"), "quant_method: 'bitsandbytes' is not supported"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3),
         r"weight_packed has shape \[32, 8\], expected \[32, 6\]"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=48),
         r"model\.layers\.0\.mlp\.experts \(int4/g48\): group_size 48 does not divide the 64 input columns"),
        (lambda q: q["ignore"].append("model.layers.0.mlp.experts.0.up_proj"),
         ("model.layers.0.mlp.experts runs as one module, so its checkpoint modules must share one format, "
          "but model.layers.0.mlp.experts.0.gate_proj is int4/g16, model.layers.0.mlp.experts.0.up_proj is dense")),
    ],
)
def test_bad_quantization_config_is_named(quantized, tmp_path, edit, message):
    folder = tmp_path / "bad"
    shutil.copytree(quantized, folder)
    raw = json.loads((folder / "config.json").read_text())
    edit(raw["quantization_config"])
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, dtype="float32", device="cpu")


def test_transformers_5_17_layer_type_name_loads():
    config = ModelConfig.from_dict({**BASE, "layer_types": ["linear_attention"] * 3 + ["qwen_sparse_attention"]})
    assert config.layer_types[3] == "indexed_attention"


# ---- the commands and the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from tierlm.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


@pytest.fixture(scope="module")
def demo_int4(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-int4") / "q"
    assert cli_main(["quantize", str(demo), "--out", str(out), "--scheme", "int4-mixed", "--group-size", "32"]) == 0
    return out


def test_quantize_command_writes_a_checkpoint_the_engine_serves(demo, demo_int4, tmp_path, capsys):
    from tierlm import LLM, SamplingParams

    assert (demo_int4 / "tokenizer.json").exists() and (demo_int4 / "generation_config.json").exists()
    llm = LLM(str(demo_int4), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2)
    result = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(result.outputs[0].token_ids) == 6
    # a second run refuses the non-empty folder; a group that does not divide the widths is named
    assert cli_main(["quantize", str(demo), "--out", str(demo_int4)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert cli_main(["quantize", str(demo), "--out", str(tmp_path / "g48"), "--group-size", "48"]) == 2
    assert "group_size 48 does not divide" in capsys.readouterr().err


def test_eval_kld_matches_the_engines_prompt_logprobs(demo, demo_int4, tmp_path, capsys):
    from tierlm import LLM, SamplingParams
    from tierlm.tokenizer import Tokenizer
    from tierlm.tools.eval_kld import evaluate_kld, kl_divergence, prompt_logprobs

    text = "import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 3
    ids = Tokenizer.from_pretrained(demo).encode(text)
    logprobs, _ = prompt_logprobs(demo_int4, ids, dtype="float32", device="cpu", chunk=20)
    # the engine's prompt logprobs (top 20 + the prompt token) agree with the full distributions
    llm = LLM(str(demo_int4), dtype="float32", device="cpu", max_model_len=256, max_num_seqs=1)
    engine = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    for position in (1, len(ids) // 2, len(ids) - 1):
        entry = engine.prompt_logprobs[position][ids[position]]
        assert abs(entry.logprob - logprobs[position - 1, ids[position]].item()) < 1e-4

    same = kl_divergence(logprobs, logprobs)
    assert same.mean == 0 and same.max == 0 and same.top1_agreement == 1
    report = evaluate_kld(demo, demo_int4, text, dtype="float32", device="cpu")
    base_logprobs, _ = prompt_logprobs(demo, ids, dtype="float32", device="cpu")
    expected = torch.nn.functional.kl_div(logprobs, base_logprobs, log_target=True, reduction="none").sum(-1)
    assert report.tokens == len(ids) and report.mean == pytest.approx(expected.mean().item(), rel=1e-5)
    assert 0 < report.mean <= report.p99 <= report.max and 0 < report.top1_agreement <= 1

    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    assert cli_main(["eval", "kld", str(demo), str(demo_int4), "--text", str(text_file), "--dtype", "float32",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"tokens: {len(ids)}" in out and "KL(base || quant) nats: mean" in out and "top-1 agreement" in out
    (tmp_path / "empty.txt").write_text("")
    assert cli_main(["eval", "kld", str(demo), str(demo_int4), "--text", str(tmp_path / "empty.txt")]) == 2
    assert "KL needs at least 2" in capsys.readouterr().err


def test_plan_counts_the_packed_bytes_the_loader_allocates(quantized, capsys):
    from tierlm.memory.plan import weight_bytes
    from tierlm.model.loader import read_quantization_config

    model, config = load_model(quantized, dtype="float32", device="cpu")
    by_format = weight_bytes(config, "float32", read_quantization_config(quantized))
    assert set(by_format) == {"dense", "int4/g16", "int6/g16", "int8/channel"}
    hash_buffers = 8 * sum(config.ngram_size + 2 * config.num_ngram_heads for _ in config.ple_layer_ids)
    allocated = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(by_format.values()) - hash_buffers == allocated
    assert cli_main(["plan", str(quantized)]) == 0
    assert f"int4/g16 {by_format['int4/g16']:,} B" in capsys.readouterr().out


def test_demo_model_can_be_written_quantized(tmp_path):
    from tierlm.demo_model import build_demo_model

    out = build_demo_model(tmp_path / "q", "tiny", quantize="int4", group_size=64)
    raw = json.loads((out / "config.json").read_text())["quantization_config"]
    assert raw["config_groups"]["group_0"]["weights"]["group_size"] == 64
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # the dense build is gone
    model, _ = load_model(out, dtype="float32", device="cpu")
    assert model.model.layers[0].mlp.experts.quant_method.format.label == "int4/g64"
    assert model.lm_head.quant_method.format.label == "dense"


# ---- fp8 PLE tables ------------------------------------------------------------------------------------


def _fp8_ple_copy(model_dir, out):
    """`model_dir` with every PLE table in float8 e4m3 and one global scale (vLLM's fp8 PLE layout); also
    returns the tables' dequantized rows {decoder layer: [rows, dE] fp32}."""
    shutil.copytree(model_dir, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    tensors = {f: load_file(out / f) for f in files}
    dequantized = {}
    config = ModelConfig.from_pretrained(out)
    for layer_id in config.ple_layer_ids:
        prefix = f"model.layers.{layer_id - 1}.ple.ple_embedding.ngram_embedding"
        names = sorted((n for n in index["weight_map"] if n.startswith(prefix + ".shard_")),
                       key=lambda n: int(n.split("shard_")[1].split(".")[0]))
        amax = max(tensors[index["weight_map"][n]][n].abs().max().item() for n in names)
        scale = float(torch.tensor(amax / 448, dtype=torch.float32))
        rows = []
        for name in names:
            file = index["weight_map"][name]
            fp8 = (tensors[file][name].float() / scale).to(torch.float8_e4m3fn)
            tensors[file][name] = fp8
            rows.append(fp8.float() * torch.tensor(scale, dtype=torch.float32))
        tensors[files[0]][f"{prefix}.weight_scale"] = torch.tensor([scale], dtype=torch.float32)
        index["weight_map"][f"{prefix}.weight_scale"] = files[0]
        dequantized[layer_id - 1] = torch.cat(rows)
    for file, content in tensors.items():
        save_file(content, out / file)
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out, dequantized


def test_fp8_ple_tables_load_in_memory_and_mapped(demo, tmp_path):
    from tierlm import LLM, SamplingParams
    from tierlm.memory.ple_table import export_ple_tables, load_manifest

    folder, dequantized = _fp8_ple_copy(demo, tmp_path / "fp8")
    model, config = load_model(folder, dtype="float32", device="cpu")
    for layer_index, rows in dequantized.items():
        table = model.model.layers[layer_index].ple.table
        assert table.weight.dtype == torch.float8_e4m3fn  # held as fp8: 1 byte per value
        ids = torch.tensor([[0, 5], [len(rows) - 1, 5]])
        assert torch.equal(table.gather(ids), rows[ids].flatten(-2))

    manifest = export_ple_tables(folder, tmp_path / "tables")
    assert all(t.dtype == "float8_e4m3fn" and t.scale > 0 for t in manifest.layers)
    assert load_manifest(tmp_path / "tables", config).layers == manifest.layers
    # `ple export --fp8` of the dense checkpoint writes the same bytes and scales
    assert cli_main(["ple", "export", str(demo), "--out", str(tmp_path / "converted"), "--fp8"]) == 0
    assert load_manifest(tmp_path / "converted", config).layers == manifest.layers
    for table in manifest.layers:
        assert (tmp_path / "converted" / table.file).read_bytes() == (tmp_path / "tables" / table.file).read_bytes()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompt = "def handler(event, context):\n    return"
    in_memory = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256).generate(prompt, params)[0]
    mapped_llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, ple_table=str(tmp_path / "tables"))
    mapped = mapped_llm.generate(prompt, params)[0]
    assert mapped.outputs[0].token_ids == in_memory.outputs[0].token_ids
    for a, b in zip(mapped.outputs[0].logprobs, in_memory.outputs[0].logprobs):
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in b)
