"""The trained demo model's recipes: its architecture and how it is trained, per size.

`code` is the embedded default (`models/default_model`): every layer kind the engine serves, small enough
that its bf16 files stay under 24 MB, trained on a GPU in minutes. `smoke` is the same recipe shrunk so
that a CPU runs it end to end in seconds (the tests). Both keep QSA's budget below the training context,
so the indexer's selection is in play while it trains.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Recipe:
    text_config: dict[str, Any]  # config.json fields other than vocab_size / eos_token_id
    vocab_size: int  # BPE vocabulary (special tokens included)
    seq_len: int  # tokens per training window (the context it learns)
    batch_size: int  # windows per step
    lr: float  # peak AdamW learning rate
    warmup_steps: int
    max_train_bytes: int  # corpus cap (training files)
    max_heldout_bytes: int
    tokenizer_bytes: int  # the first training files' bytes the BPE tokenizer learns from
    eval_tokens: int  # held-out tokens per perplexity measurement
    mtp_loss_weight: float  # the MTP head's next-next-token loss, added to the main loss
    indexer_loss_weight: float = 1.0  # the QSA indexers' distillation loss (it reaches their weights alone)
    weight_decay: float = 0.1
    doc_start_fraction: float = 0.25  # windows that start at a file's beginning, the rest anywhere
    stdlib_only: bool = False  # the corpus from the standard library alone (quick to list)

    def with_overrides(self, **changes: Any) -> Recipe:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def _layer_types(kinds: str) -> list[str]:
    """'LLQ' -> linear, linear, indexed."""
    return ["indexed_attention" if k == "Q" else "linear_attention" for k in kinds]


_COMMON = {
    "architectures": ["Qwen4ExpForCausalLM"],
    "model_type": "qwen4_exp_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "norm_topk_prob": True,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "output_gate_type": None,
    "bos_token_id": None,
    "pad_token_id": None,
    "use_cache": True,
    "linear_conv_kernel_dim": 4,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "indexer_kv_heads": 1,
    "mtp_num_hidden_layers": 1,
    "number_of_conv_states": 3,
}

RECIPES: dict[str, Recipe] = {
    # 10.8 M parameters (21.6 MB bf16; 4.1 M in the routed experts): 4 GDN layers (PLE on layer 2), 2 QSA
    # layers and an MTP QSA layer; QSA keeps 16 blocks of 8 (budget 128) of the 64 a 512-token window has
    "code": Recipe(
        text_config={
            **_COMMON,
            "hidden_size": 256,
            "num_hidden_layers": 6,
            "layer_types": _layer_types("LLQLLQ"),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "shared_expert_intermediate_size": 192,
            "hc_count": 4,
            "hc_lowrank": 16,
            "ple_layer_ids": [2],
            "ple_embed_dim": 128,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 4096,
            "split_ngram_parts": 1,
            "indexer_n_heads": 4,
            "indexer_head_dim": 64,
            "indexer_budget": 128,
            "indexer_compress_ratio": 8,
            "tie_word_embeddings": True,
        },
        vocab_size=8192,
        seq_len=512,
        batch_size=128,
        lr=2e-3,
        warmup_steps=100,
        max_train_bytes=160_000_000,
        max_heldout_bytes=4_000_000,
        tokenizer_bytes=24_000_000,
        eval_tokens=131_072,
        mtp_loss_weight=0.3,
    ),
    # the same layer kinds at toy sizes: a CPU trains it for a few steps in seconds
    "smoke": Recipe(
        text_config={
            **_COMMON,
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "layer_types": _layer_types("LLQ"),
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "hc_count": 2,
            "hc_lowrank": 8,
            "ple_layer_ids": [2],
            "ple_embed_dim": 16,
            "heads_per_ngram": 1,
            "ngram_vocab_size_base": 512,
            "split_ngram_parts": 1,
            "indexer_n_heads": 2,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
            "tie_word_embeddings": True,
        },
        vocab_size=512,
        seq_len=48,
        batch_size=4,
        lr=3e-3,
        warmup_steps=2,
        max_train_bytes=300_000,
        max_heldout_bytes=60_000,
        tokenizer_bytes=300_000,
        eval_tokens=490,
        mtp_loss_weight=0.3,
        stdlib_only=True,
    ),
}


def model_config(recipe: Recipe, vocab_size: int, eos_token_id: int) -> dict[str, Any]:
    """The config.json dict (flat text fields, sorted) of a recipe's model for a tokenizer's vocabulary."""
    return dict(sorted({**recipe.text_config, "vocab_size": vocab_size, "eos_token_id": eos_token_id}.items()))
