"""Tiny Qwen4-Exp checkpoints written by transformers (the reference), for parity tests.

Each config is built with `Qwen4ExpTextConfig`, every float parameter gets 0.05 * N(0, 1) noise (the
reference zero-initialises norms and the PLE conv, which would leave those paths untested), and the
model is saved with `save_pretrained`, so tierlm reads exactly what the reference writes. `Runner`
drives tierlm's model over the same tokens, request by request and chunk by chunk, in any dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner

BLOCK_SIZE = 12  # a multiple of every test config's compress ratio (3 and 4)
BLOCKS_PER_REQUEST = 20

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


def _layer_type_names(fields: dict) -> dict:
    """transformers before 5.19 (the GPU machine has 5.17) calls the QSA layer `qwen_sparse_attention`;
    tierlm loads either name."""
    import transformers

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 19) or not fields.get("layer_types"):
        return fields
    names = ["qwen_sparse_attention" if t == "indexed_attention" else t for t in fields["layer_types"]]
    return {**fields, "layer_types": names}


def build_reference(config: str | dict, out_dir: Path, seed: int = 0):
    """Save the perturbed reference model for config (a CONFIGS name, or the config itself) into out_dir;
    return the HF model."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    fields = _layer_type_names(CONFIGS[config] if isinstance(config, str) else config)
    model = Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**fields)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype.is_floating_point:
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return model


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def assert_kernel_path_close(logits, device: str, config: str = "hc4_ple") -> None:
    """A model-level kernel test's check: `logits(folder, dtype, kernels, device)` (fp32 on the CPU) over the
    reference checkpoint of `config`, kernels on against off. fp32: equal up to summation order; bf16: the
    kernel path's distance from the fp32 run within 2x the torch bf16 path's own."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        build_reference(config, Path(folder))
        exact = logits(Path(folder), "float32", False, device)
        kernel_fp32 = logits(Path(folder), "float32", True, device)
        assert rel_rms(kernel_fp32, exact) < 1e-5, rel_rms(kernel_fp32, exact)
        torch_bf16 = logits(Path(folder), "bfloat16", False, device)
        kernel_bf16 = logits(Path(folder), "bfloat16", True, device)
    assert rel_rms(kernel_bf16, exact) <= 2 * rel_rms(torch_bf16, exact), (rel_rms(kernel_bf16, exact),
                                                                           rel_rms(torch_bf16, exact))


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits [B, T, V] of the reference, without cache."""
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def prompt_ids(config, batch: int, length: int, seed: int) -> torch.Tensor:
    """Random ids with EOS planted mid-sequence (and right after another EOS once)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, config.vocab_size, (batch, length), generator=gen)
    eos = config.eos_token_id if config.eos_token_id is not None else 1
    ids[:, length // 3] = eos
    ids[0, length // 2] = eos
    ids[0, length // 2 + 1] = eos
    return ids


class Runner:
    """Drives the tierlm model over several requests with disjoint slots and block tables.

    static_mode: run decode-only steps through a `StaticDecodeRunner` in that mode (its fixed-shape
    batches), with room for all the requests at once.
    """

    def __init__(
        self, model, config, num_requests: int, dtype: torch.dtype = torch.float32, static_mode: str | None = None
    ) -> None:
        self.model = model
        self.cache = ModelCache(config, num_requests, num_requests * BLOCKS_PER_REQUEST, BLOCK_SIZE, dtype)
        self.tables = [list(range(i * BLOCKS_PER_REQUEST, (i + 1) * BLOCKS_PER_REQUEST)) for i in range(num_requests)]
        self.positions = [0] * num_requests
        for slot in range(num_requests):
            self.cache.reset_slot(slot)
        self.static = None
        if static_mode is not None:
            self.static = StaticDecodeRunner(model, self.cache, num_requests, BLOCKS_PER_REQUEST, static_mode)

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Compute the next chunk of each named request in ONE forward; logits per request [T, V]."""
        reqs = sorted(chunks)
        batch = ForwardBatch.build(
            [chunks[r] for r in reqs], [self.positions[r] for r in reqs], reqs,
            [self.tables[r] for r in reqs], BLOCK_SIZE, logits="all",
        )
        if self.static is not None and self.static.can_run(batch):
            logits = self.static.run(batch)
        else:
            logits = self.model(batch, self.cache)
        out = {}
        for r, (start, end) in zip(reqs, batch.bounds):
            out[r] = logits[start:end]
            self.positions[r] += end - start
        return out
