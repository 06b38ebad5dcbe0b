"""The numpy PLE row hash equals the torch path (`ngram_context` + `NgramHasher.rows`) bit for bit."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from reference_models import BASE

from tierlm.config import ModelConfig
from tierlm.memory.ngram_rows_np import NgramHashArrays, carry_context, initial_context, ngram_rows_np
from tierlm.model.ngram_hash import NgramHasher, NgramHashSpec, ngram_context


def _spec(ngram_size: int, vocab: int, ple_index: int = 0, heads_per_ngram: int = 3) -> NgramHashSpec:
    fields = {
        **BASE,
        "ngram_size": ngram_size,
        "vocab_size": vocab,
        "heads_per_ngram": heads_per_ngram,
        "ngram_vocab_size_base": 100_003,
        "ple_embed_dim": heads_per_ngram * (ngram_size - 1) * 4,
        "ple_layer_ids": [1, 2, 3],
    }
    return NgramHashSpec.from_config(ModelConfig.from_dict(fields), ple_index)


def _torch_rows(spec: NgramHashSpec, context: np.ndarray, chunk: np.ndarray) -> np.ndarray:
    history = torch.from_numpy(np.concatenate([context, chunk]).astype(np.int64))
    return NgramHasher(spec).rows(ngram_context(history, spec.eos_token_id, spec.ngram_size)).numpy()


def _stream(spec: NgramHashSpec, vocab: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, length, dtype=np.int64)
    ids[rng.random(length) < 0.15] = spec.eos_token_id  # many EOS, some adjacent
    ids[:2] = spec.eos_token_id
    ids[40:44] = spec.eos_token_id
    return ids


@pytest.mark.parametrize(
    "ngram_size,vocab,ple_index", [(3, 512, 0), (3, 248320, 1), (4, 248320, 2), (2, 1000, 0)]
)
def test_whole_and_chunked_equal_torch(ngram_size, vocab, ple_index):
    spec = _spec(ngram_size, vocab, ple_index)
    ids = _stream(spec, vocab, 300, seed=ngram_size + ple_index)
    start = initial_context(spec)
    expected = _torch_rows(spec, start, ids)
    whole = ngram_rows_np(spec, start, ids)
    assert whole.dtype == np.int64 and whole.shape == (300, spec.num_heads) and whole.flags.c_contiguous
    assert np.array_equal(whole, expected)
    assert ((whole >= 0) & (whole < spec.table_rows)).all()
    # chunk edges right before, on and after EOS runs; empty and one-token chunks; torch chunked the same way
    edges = [0, 0, 1, 2, 3, 40, 41, 44, 45, 57, 58, 58, 299, 300]
    context, pieces = start, []
    torch_context, torch_pieces = start, []
    for begin, end in itertools.pairwise(edges):
        chunk = ids[begin:end]
        pieces.append(ngram_rows_np(spec, context, chunk))
        torch_pieces.append(_torch_rows(spec, torch_context, chunk))
        context = carry_context(context, chunk)
        torch_context = np.concatenate([torch_context, chunk])[-(ngram_size - 1) :]
        assert np.array_equal(context, torch_context)
    assert np.array_equal(np.concatenate(pieces), whole)
    assert np.array_equal(np.concatenate(torch_pieces), whole)


def test_eos_at_chunk_edges_is_carried():
    """An EOS that ends one chunk hides the context before it from the next chunk's tokens."""
    spec = _spec(3, 512)
    eos = spec.eos_token_id
    ids = np.array([5, 6, eos, 7, 8, eos, eos, 9], dtype=np.int64)
    expected = ngram_rows_np(spec, initial_context(spec), ids)
    for cut in range(len(ids) + 1):
        first = ngram_rows_np(spec, initial_context(spec), ids[:cut])
        second = ngram_rows_np(spec, carry_context(initial_context(spec), ids[:cut]), ids[cut:])
        assert np.array_equal(np.concatenate([first, second]), expected), cut
    # token 7 (after the EOS) sees (eos, eos): the same rows as 7 at a request's start
    assert np.array_equal(expected[3], ngram_rows_np(spec, initial_context(spec), ids[3:4])[0])


def test_out_of_vocabulary_ids_wrap_like_torch():
    """Products past 2^63 wrap silently in both; no numpy overflow warning or error on any path."""
    spec = _spec(3, 248320)
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 2**62, 500, dtype=np.int64)
    ids[::5] = rng.integers(0, 248320, 100)
    ids[3] = 2**63 - 1
    ids[17] = spec.eos_token_id
    with np.errstate(all="raise"):
        rows = ngram_rows_np(spec, initial_context(spec), ids)
        one = ngram_rows_np(spec, carry_context(initial_context(spec), ids[:3]), ids[3:4])  # a decode step
    assert np.array_equal(rows, _torch_rows(spec, initial_context(spec), ids))
    assert np.array_equal(one[0], rows[3])
    assert ((rows >= 0) & (rows < spec.table_rows)).all()


def test_arrays_and_int32_input_give_the_same_rows():
    spec = _spec(3, 248320, heads_per_ngram=8)
    ids = _stream(spec, 248320, 64, seed=3)
    expected = ngram_rows_np(spec, initial_context(spec), ids)
    arrays = NgramHashArrays.from_spec(spec)
    assert np.array_equal(ngram_rows_np(arrays, initial_context(spec), ids.astype(np.int32)), expected)
    with pytest.raises(ValueError, match="ngram_size-1"):
        ngram_rows_np(spec, np.zeros(1, dtype=np.int64), ids)
