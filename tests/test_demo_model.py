"""`tierlm demo-model`: the tiny checkpoint matches the layout table, is deterministic, and transformers
loads it (names, shapes, logits) and its tokenizer (encoding, chat template) exactly as tierlm does."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tierlm.cli import main as cli_main
from tierlm.config import ModelConfig
from tierlm.demo_model import IM_END, SIZES, build_demo_model, demo_config, train_tokenizer
from tierlm.model.checkpoint_layout import checkpoint_layout, ple_hash_buffers
from tierlm.tokenizer import Tokenizer

SAFETENSORS_DTYPE = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def config(model_dir) -> ModelConfig:
    return ModelConfig.from_pretrained(model_dir)


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _headers(folder: Path) -> tuple[dict, dict[str, tuple[tuple[int, ...], str]]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    found = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(folder / shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                view = f.get_slice(name)
                found[name] = (tuple(view.get_shape()), view.get_dtype(), shard)
    return index, found


def test_config(model_dir, config):
    tok = Tokenizer.from_pretrained(model_dir)
    assert config.architecture == "Qwen4ExpForCausalLM" and config.torch_dtype == "float32"
    assert config.vocab_size == tok.vocab_size == SIZES["tiny"].tokenizer_vocab
    assert config.eos_token_ids == (tok.token_to_id(IM_END),) == (tok.eos_token_id,)
    assert config.ple_layer_ids and all(
        config.layer_types[i - 1] == "linear_attention" for i in config.ple_layer_ids
    )
    assert "indexed_attention" in config.layer_types and config.has_qsa
    assert config.indexer_budget == 64 and config.partial_rotary_factor in (0.5, 0.25)
    assert config.rotary_dim <= config.indexer_head_dim
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen4_exp_text" and isinstance(raw["eos_token_id"], int)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    assert set(tok.eos_token_ids) == set(generation["eos_token_id"])
    assert (
        tok.generation_defaults.temperature,
        tok.generation_defaults.top_p,
        tok.generation_defaults.top_k,
    ) == (0.7, 0.8, 20)


@pytest.mark.parametrize("size", sorted(SIZES))
def test_both_sizes_validate(size):
    vocab = SIZES[size].tokenizer_vocab
    config = ModelConfig.from_dict(demo_config(size, vocab, eos_token_id=2))
    assert config.vocab_size % 64 == 0 and config.vocab_size >= vocab
    assert config.ple_layer_ids and config.has_qsa
    assert config.torch_dtype == SIZES[size].dtype


def test_weights_match_layout(model_dir, config):
    index, found = _headers(model_dir)
    layout = checkpoint_layout(config)
    assert set(index["weight_map"]) == {t.name for t in layout} == set(found)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    total = 0
    for spec in layout:
        shape, dtype, shard = found[spec.name]
        assert shape == spec.shape, spec.name
        assert shard == index["weight_map"][spec.name]
        assert dtype == ("I64" if spec.kind == "int64" else "F32"), spec.name
        total += math.prod(shape) * SAFETENSORS_DTYPE[dtype].itemsize
    assert index["metadata"]["total_size"] == total
    assert any(".ngram_embedding.shard_1.weight" in t.name for t in layout)


def test_ple_hash_buffers(model_dir, config):
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for k, layer_id in enumerate(config.ple_layer_ids):
        prefix = f"model.layers.{layer_id - 1}.ple.ple_embedding."
        for name, values in ple_hash_buffers(config, k).items():
            with safe_open(model_dir / index[prefix + name], framework="pt") as f:
                tensor = f.get_tensor(prefix + name)
            assert tensor.dtype == torch.int64 and tensor.tolist() == values, prefix + name


def test_deterministic(model_dir, tmp_path):
    again = tmp_path / "again"
    assert cli_main(["demo-model", str(again), "--size", "tiny", "--seed", "0"]) == 0
    assert _digests(again) == _digests(model_dir)
    other = build_demo_model(tmp_path / "other", "tiny", seed=1)
    differs = {name for name, digest in _digests(other).items() if digest != _digests(model_dir)[name]}
    assert differs == {name for name in _digests(model_dir) if name.endswith(".safetensors")}
    # the tokenizer training itself (not the per-process cache) is reproducible
    spec = SIZES["tiny"]
    assert (
        train_tokenizer.__wrapped__(spec.tokenizer_vocab, spec.corpus_bytes)
        == (model_dir / "tokenizer.json").read_text()
    )


def test_existing_checkpoint_is_kept_unless_overwrite(tmp_path, capsys):
    target = build_demo_model(tmp_path / "m", "tiny", seed=3)
    (target / "README.md").write_text("mine")
    with pytest.raises(FileExistsError):
        build_demo_model(target, "tiny", seed=4)
    assert cli_main(["demo-model", str(target)]) == 2
    assert "--force" in capsys.readouterr().err
    build_demo_model(target, "tiny", seed=4, overwrite=True)
    assert (target / "README.md").read_text() == "mine"
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_transformers_loads_it(model_dir):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen4ExpForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tok = Tokenizer.from_pretrained(model_dir)
    ids = tok.encode(
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib", add_special_tokens=False
    )
    assert len(ids) >= 8
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0].float()
    assert logits.shape == (len(ids), tok.vocab_size) and torch.isfinite(logits).all()
    assert logits.argmax(-1).unique().numel() > 1
    probs = logits.softmax(-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1) / math.log(tok.vocab_size)
    assert 0.2 < entropy.mean().item() < 0.9  # neither flat nor one-hot
    assert probs.max(-1).values.mean().item() < 0.8


def test_transformers_reads_the_tokenizer_the_same_way(model_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_pretrained(model_dir)
    text = "héllo 世界 🎉\n    return x  # done<|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write fib."},
        {"role": "assistant", "content": "def fib(n): ..."},
        {"role": "user", "content": [{"type": "text", "text": "Faster?"}]},
    ]
    for add in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected


def test_bigger_ngram_tables(tmp_path, monkeypatch, capsys):
    """`--ngram-vocab-base` etc.: the table grows, split so that no shard exceeds MAX_PLE_SHARD_BYTES."""
    from tierlm import demo_model

    monkeypatch.setattr(demo_model, "MAX_PLE_SHARD_BYTES", 1 << 20)
    out = tmp_path / "big"
    assert cli_main(["demo-model", str(out), "--ngram-vocab-base", "30000", "--heads-per-ngram", "4",
                     "--ple-embed-dim", "128"]) == 0
    config = ModelConfig.from_pretrained(out)
    assert (config.ngram_vocab_size_base, config.heads_per_ngram, config.ple_embed_dim) == (30000, 4, 128)
    assert config.split_ngram_parts == math.ceil(30000 * 128 * 4 / (1 << 20))
    index, found = _headers(out)
    assert set(index["weight_map"]) == {t.name for t in checkpoint_layout(config)}
    tables = [shape for name, (shape, _, _) in found.items() if ".ngram_embedding.shard_" in name]
    assert len(tables) == 2 * config.split_ngram_parts and all(s[1] == 16 for s in tables)
    assert max(s[0] * s[1] * 4 for s in tables) <= 1 << 20
    assert cli_main(["demo-model", str(tmp_path / "bad"), "--ple-embed-dim", "30"]) == 2
    assert "ple_embed_dim" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot be overridden"):
        demo_config("tiny", 4096, 2, {"hidden_size": 64})
