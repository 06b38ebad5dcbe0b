"""Config derivations, validation messages, and checkpoint loading errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from reference_models import BASE, build_reference
from safetensors.torch import load_file, save_file

from tierlm.config import ConfigError, ModelConfig
from tierlm.model.loader import CheckpointError, ModelNotFoundError, load_model


def test_derivations_follow_the_reference():
    fields = {**BASE, "layer_types": None, "full_attention_interval": 2, "ple_layer_ids": [3, 1, 1],
              "ple_embed_dim": None}
    config = ModelConfig.from_dict(fields)
    assert config.layer_types == ("linear_attention", "indexed_attention") * 2
    assert config.ple_layer_ids == (1, 3)
    assert config.ple_embed_dim == config.hidden_size
    legacy = ModelConfig.from_dict({**BASE, "layer_types": ["linear_attention"] * 3 + ["full_attention"]})
    assert legacy.layer_types[3] == "indexed_attention"


def test_vlm_config_reads_text_config():
    raw = {"architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": dict(BASE),
           "vision_config": {"out_hidden_size": BASE["hidden_size"]}, "image_token_id": 500,
           "vision_start_token_id": 501, "vision_end_token_id": 502}
    config = ModelConfig.from_dict(raw)
    assert config.hidden_size == BASE["hidden_size"]
    assert (config.vision.depth, config.vision.image_token_id, config.vision.vision_end_token_id) == (27, 500, 502)
    with pytest.raises(ConfigError, match="vision_config.out_hidden_size: .* must equal hidden_size=64"):
        ModelConfig.from_dict({**raw, "vision_config": {}})
    assert ModelConfig.from_dict({**raw, "vision_config": None}).vision is None


@pytest.mark.parametrize(
    "change,field,rule",
    [
        ({"hc_count": 1}, "hc_count", "> 1"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok", "[1, num_experts=8]"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads", "exactly 1"),
        ({"indexer_budget": 10}, "indexer_budget", "divisible by indexer_compress_ratio"),
        ({"indexer_head_dim": None}, "indexer_head_dim", "missing required"),
        ({"indexer_head_dim": 8}, "indexer_head_dim", "rotary_dim=16"),
        ({"ple_layer_ids": [4]}, "ple_layer_ids", "only supported on linear_attention"),
        ({"ple_layer_ids": [0]}, "ple_layer_ids", "[1, 4]"),
        ({"ple_embed_dim": 30}, "ple_embed_dim", "divisible"),
        ({"eos_token_id": None}, "eos_token_id", "PLE"),
        ({"hidden_act": "gelu"}, "output_gate_type", "'sigmoid' or 'silu'"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types", "sliding_attention"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads", "multiple"),
    ],
)
def test_invalid_configs_name_field_and_rule(change, field, rule):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({**BASE, **change})
    assert field in str(err.value) and rule in str(err.value)


def test_unknown_architecture():
    with pytest.raises(ConfigError, match="unknown architecture 'LlamaForCausalLM'"):
        ModelConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"]})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    build_reference("hc4_ple", folder)
    return folder


def _edited_copy(checkpoint, tmp_path, edit):
    folder = tmp_path / "edited"
    shutil.copytree(checkpoint, folder)
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_missing_tensor(checkpoint, tmp_path):
    folder = _edited_copy(checkpoint, tmp_path, lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.3\.self_attn\.k_norm\.weight "
                                              r"\(expected shape \[32\]\)"):
        load_model(folder, device="cpu")


def test_wrong_shape(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.linear_attn.out_proj.weight"] = torch.zeros(64, 63)
    folder = _edited_copy(checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\.out_proj\.weight has shape "
                                              r"\[64, 63\], expected \[64, 64\]"):
        load_model(folder, device="cpu")


def test_unexpected_tensor(checkpoint, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)
    folder = _edited_copy(checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts\.8\.up_proj"):
        load_model(folder, device="cpu")


def test_a_tied_checkpoint_that_also_stores_lm_head_loads_the_embedding_as_its_head(tmp_path):
    """vLLM skips lm_head.* of a tied model; so does the loader (the head stays the embedding's)."""
    from tierlm.demo_model import TRAINED_DEFAULT_DIR

    if not (TRAINED_DEFAULT_DIR / "config.json").exists():
        pytest.skip("the trained default (a tied model) is not committed")

    def edit(t):
        t["lm_head.weight"] = torch.zeros_like(t["model.embed_tokens.weight"])
    folder = _edited_copy(TRAINED_DEFAULT_DIR, tmp_path, edit)
    model, config = load_model(folder, dtype="float32", device="cpu")
    assert config.tie_word_embeddings
    embedding = model.model.embed_tokens.weight
    assert embedding.abs().max() > 0 and torch.equal(model.lm_head.weight, embedding)


def test_vlm_prefix_and_ignored_parts_load(checkpoint, tmp_path):
    def edit(t):
        for name in [n for n in t if n.startswith("model.")]:
            t["model.language_model." + name[len("model."):]] = t.pop(name)
        t["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
        t["mtp.fc_hidden.weight"] = torch.zeros(2, 2)
    folder = _edited_copy(checkpoint, tmp_path, edit)
    model, _ = load_model(folder, device="cpu")
    reference, _ = load_model(checkpoint, device="cpu")
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert torch.equal(model.model.layers[0].ple.table.weight, reference.model.layers[0].ple.table.weight)


def test_invalid_config_file(checkpoint, tmp_path):
    folder = tmp_path / "badcfg"
    shutil.copytree(checkpoint, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["indexer_budget"] = 7
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="indexer_budget"):
        load_model(folder, device="cpu")


def test_dtype_choice(checkpoint):
    model, _ = load_model(checkpoint, dtype="bfloat16", device="cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8' is not supported"):
        load_model(checkpoint, dtype="int8", device="cpu")


def test_model_name_that_is_not_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not be downloaded.*local checkpoint folder"):
        load_model("Qwen/Qwen3.8-Flash-Next", device="cpu")
