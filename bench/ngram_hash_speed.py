"""PLE row hash throughput: the numpy twin (`tierlm.memory.ngram_rows_np`) vs the torch path, one core.

Hashes one long token stream of the real model's shape (vocab 248320, ngram_size 3, heads_per_ngram 8, so
16 rows per token) in prefill-sized chunks, carrying the context across chunks as the engine does, and
checks both paths give the same rows. Prints tokens/s of each and the ratio.

    .venv/bin/python bench/ngram_hash_speed.py [--tokens 4000000] [--chunk 8192]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tierlm.config import ModelConfig
from tierlm.memory.ngram_rows_np import NgramHashArrays, carry_context, initial_context, ngram_rows_np
from tierlm.model.ngram_hash import NgramHasher, NgramHashSpec, ngram_context

REAL_MODEL_PLE = {
    "vocab_size": 248320,
    "hidden_size": 2560,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 4,
    "ple_layer_ids": [1],
    "ple_embed_dim": 2560,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "eos_token_id": 248046,
}


def run_numpy(spec: NgramHashSpec, ids: np.ndarray, chunk: int) -> tuple[float, np.ndarray]:
    arrays = NgramHashArrays.from_spec(spec)
    context, last = initial_context(spec), None
    start = time.perf_counter()
    for begin in range(0, len(ids), chunk):
        piece = ids[begin : begin + chunk]
        last = ngram_rows_np(arrays, context, piece)
        context = carry_context(context, piece)
    return time.perf_counter() - start, last


def run_torch(spec: NgramHashSpec, ids: torch.Tensor, chunk: int) -> tuple[float, torch.Tensor]:
    hasher = NgramHasher(spec)
    context, last = torch.full((spec.context_len,), spec.eos_token_id), None
    start = time.perf_counter()
    for begin in range(0, len(ids), chunk):
        history = torch.cat([context, ids[begin : begin + chunk]])
        last = hasher.rows(ngram_context(history, spec.eos_token_id, spec.ngram_size))
        context = history[-spec.context_len :]
    return time.perf_counter() - start, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--chunk", type=int, default=8192, help="tokens per call (a prefill chunk)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = ModelConfig.from_dict(REAL_MODEL_PLE)
    spec = NgramHashSpec.from_config(config, 0)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, args.tokens, dtype=np.int64)
    ids[rng.random(args.tokens) < 0.002] = config.eos_token_id
    np_seconds, np_last = run_numpy(spec, ids, args.chunk)
    torch_seconds, torch_last = run_torch(spec, torch.from_numpy(ids), args.chunk)
    assert np.array_equal(np_last, torch_last.numpy()), "numpy and torch rows differ"
    decode_calls = 20_000
    arrays, context = NgramHashArrays.from_spec(spec), initial_context(spec)
    start = time.perf_counter()
    for token in ids[:decode_calls]:
        ngram_rows_np(arrays, context, token[None])
        context = carry_context(context, token[None])
    decode_us = (time.perf_counter() - start) / decode_calls * 1e6
    print(f"{args.tokens:,} tokens, {spec.num_heads} rows/token, chunks of {args.chunk}, 1 thread")
    print(f"numpy: {args.tokens / np_seconds / 1e6:6.2f} M tokens/s")
    print(f"torch: {args.tokens / torch_seconds / 1e6:6.2f} M tokens/s")
    print(f"numpy / torch: {torch_seconds / np_seconds:.2f}x")
    print(f"numpy, one decode token per call: {decode_us:.1f} us/call (hash + carry)")


if __name__ == "__main__":
    main()
