"""Tiny Qwen4-Exp checkpoints written by transformers (the reference), for parity tests.

Each config is built with `Qwen4ExpTextConfig`, every float parameter gets 0.05 * N(0, 1) noise (the
reference zero-initialises norms and the PLE conv, which would leave those paths untested), and the
model is saved with `save_pretrained`, so tierlm reads exactly what the reference writes.
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = {
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
    "hc_count": 4, "hc_lowrank": 16, "ple_layer_ids": [1, 2], "ple_embed_dim": 64, "ple_conv_kernel_size": 4,
    "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 1000, "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234, "split_ngram_parts": 4, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32,
    "indexer_budget": 8, "indexer_compress_ratio": 4, "eos_token_id": 1, "tie_word_embeddings": False,
}

CONFIGS = {
    # the fact sheet's config: hc 4, PLE on two GDN layers, one QSA layer
    "hc4_ple": BASE,
    # hc 2, no PLE, two QSA layers, attention biases, sigmoid GDN gate, nk == nv, full rotary
    "hc2_nople": {
        **BASE, "hc_count": 2, "ple_layer_ids": None, "layer_types": None, "full_attention_interval": 2,
        "attention_bias": True, "output_gate_type": "sigmoid", "linear_num_value_heads": 2,
        "head_dim": 16, "indexer_head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "norm_topk_prob": False, "num_experts_per_tok": 3,
    },
    # hc 3, 4-grams, compress ratio 3 (not a power of two), EOS list, tied embeddings, uneven shards
    "hc3_4gram": {
        **BASE, "hc_count": 3, "ngram_size": 4, "heads_per_ngram": 1, "ple_embed_dim": 48, "ple_layer_ids": [3, 1],
        "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        "indexer_budget": 6, "indexer_compress_ratio": 3, "eos_token_id": [3, 1], "tie_word_embeddings": True,
        "split_ngram_parts": 5, "ple_conv_kernel_size": 3,
    },
}


def build_reference(name: str, out_dir: Path, seed: int = 0):
    """Save the perturbed reference model for CONFIGS[name] into out_dir; return the HF model."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**CONFIGS[name])).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype.is_floating_point:
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return model


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits [B, T, V] of the reference, without cache."""
    with torch.no_grad():
        return model(ids, use_cache=False).logits
