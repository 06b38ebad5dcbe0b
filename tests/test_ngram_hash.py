"""The n-gram row hash against the reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from reference_models import BASE

from tierlm.config import ModelConfig
from tierlm.model.ngram_hash import NgramHasher, NgramHashSpec, layer_multipliers, ngram_context, primes_above


def reference_rows(config_fields: dict, ple_index: int, ids: torch.Tensor) -> torch.Tensor:
    """Row ids as the reference computes them: its embedding over a table whose row r holds r."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    hf_config = Qwen4ExpTextConfig(**config_fields)
    heads = (hf_config.ngram_size - 1) * hf_config.heads_per_ngram
    module = Qwen4ExpTextNGramEmbedding(hf_config, heads, layer_idx=0, ple_layer_index=ple_index).double()
    with torch.no_grad():
        module.ngram_embedding.weight.copy_(torch.arange(module.ngram_embedding.weight.shape[0]).double()[:, None])
        return module(ids, None).long()


@pytest.mark.parametrize("ngram_size,ple_index,vocab", [(3, 0, 512), (3, 1, 512), (4, 2, 248320), (2, 0, 1000)])
def test_rows_equal_reference_on_streams_with_eos(ngram_size, ple_index, vocab):
    fields = {**BASE, "ngram_size": ngram_size, "vocab_size": vocab, "heads_per_ngram": 3,
              "ngram_vocab_size_base": 100_003, "ple_embed_dim": 3 * (ngram_size - 1) * 4, "ple_layer_ids": [1, 2, 3]}
    config = ModelConfig.from_dict(fields)
    spec = NgramHashSpec.from_config(config, ple_index)
    ngram_rows = NgramHasher(spec).rows
    gen = torch.Generator().manual_seed(ple_index + ngram_size)
    ids = torch.randint(0, vocab, (3, 200), generator=gen)
    ids[ids % 7 == 0] = config.eos_token_id  # many EOS, some adjacent
    ids[1, :3] = config.eos_token_id
    expected = reference_rows(fields, ple_index, ids)
    eos_pad = torch.full((ngram_size - 1,), config.eos_token_id)
    for b in range(3):
        whole = ngram_rows(ngram_context(torch.cat([eos_pad, ids[b]]), config.eos_token_id, ngram_size))
        assert torch.equal(whole, expected[b])
        # in chunks, carrying the last ngram_size-1 ids as the engine does
        history, pieces = eos_pad, []
        for start, end in ((0, 1), (1, 2), (2, 57), (57, 58), (58, 200)):
            chunk = ids[b, start:end]
            pieces.append(ngram_rows(ngram_context(torch.cat([history, chunk]), config.eos_token_id, ngram_size)))
            history = torch.cat([history, chunk])[-(ngram_size - 1):]
        assert torch.equal(torch.cat(pieces), expected[b])


def test_out_of_vocabulary_ids_wrap_like_int64():
    """Products past 2^63 wrap; the remainder stays non-negative (torch.remainder semantics)."""
    config = ModelConfig.from_dict({**BASE, "vocab_size": 512})
    spec = NgramHashSpec.from_config(config, 0)
    big = torch.tensor([2**40, 2**41 + 3, 2**42 + 5, 7], dtype=torch.int64)
    rows = NgramHasher(spec).rows(ngram_context(torch.cat([torch.tensor([1, 1]), big]), 1, 3))
    assert (rows >= 0).all() and (rows < spec.table_rows).all()
    fields = {**BASE, "vocab_size": 512}
    assert torch.equal(rows, reference_rows(fields, 0, big[None])[0])


def test_real_model_constants():
    """The fact sheet's figures for the real model: multipliers and the 95.37 GiB table."""
    assert layer_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]
    primes = primes_above(20_000_000 - 1, 16)
    assert primes[0] == 20000003 and primes[-1] == 20000171
    assert -(-sum(primes) // 128) * 128 == 320_001_536
