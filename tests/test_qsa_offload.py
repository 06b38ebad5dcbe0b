"""QSA K/V in host pools (and through the row cache) generate exactly what device pools generate; the
offloaded layer's prefill staging and its decode-batch limit."""

from __future__ import annotations

import pytest
import torch

from tierlm import LLM, SamplingParams
from tierlm.demo_model import build_demo_model
from tierlm.kernels.qsa_row_cache import attend_rows
from tierlm.kernels.qsa_sparse_attention import sparse_attention
from tierlm.memory.host_pool import allocate_pools
from tierlm.model.layers import qsa_attention
from tierlm.model.qsa_offload import OffloadedKV

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("demo") / "tiny", "tiny")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")),
])
def test_offload_with_and_without_row_cache_equals_device_pools(demo_dir, device, monkeypatch):
    """Bit for bit: the same tokens and logprobs. On CUDA the pools are pinned and read over UVA by the
    Triton attention kernel, which also reads device pools there, and decode steps run in CUDA graphs.
    Prefill takes the torch path on both sides (the kill switch): with the tiny arena the kernel path
    would merge parts of the rows, equal within rounding, not bit for bit (see
    test_offloaded_prefill_kernel_path_on_cuda)."""
    monkeypatch.setenv("TIERLM_NO_TRITON_QSA_PREFILL", "1")
    options = {"device": device, "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": False}
    prompts = ["def parse(tokens):\n" * 30, "import os\n", "class Node:\n    def __init__(self):\n" * 8]
    expected = LLM(str(demo_dir), **options, qsa_kv_offload=False).generate(prompts, PARAMS)
    variants = {  # a tiny arena: prefill stages in many sections; many slots collide, rows are evicted every step
        "row cache": {"qsa_row_cache": True},
        "no row cache": {"qsa_row_cache": False},
        "batches of 3 too large for the cache": {"qsa_row_cache": True, "qsa_row_cache_max_batch": 2},
    }
    for name, variant in variants.items():
        llm = LLM(str(demo_dir), **options, qsa_kv_offload=True, qsa_row_cache_rows=61, **variant)
        assert all(s.offload is not None for s in llm.engine.cache.layers if s.key_cache is not None)
        got = llm.generate(prompts, PARAMS)
        for a, b in zip(got, expected):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
            assert [list(p.items()) for p in a.outputs[0].logprobs] == [list(p.items()) for p in b.outputs[0].logprobs]
        stats = llm.engine.stats()
        if name == "row cache":
            assert stats.qsa_row_cache_hits > 0 and stats.qsa_row_cache_misses > 0
        elif name == "no row cache":
            assert stats.qsa_row_cache_hits == 0
        else:  # the 3 requests decode together to the end (ignore_eos, one max_tokens): never a small batch
            assert stats.qsa_row_cache_hits == stats.qsa_row_cache_misses == 0


def offloaded_layer(arena_rows: int, max_cached_batch: int = 12) -> OffloadedKV:
    """One layer's K/V in host pools of 40 blocks x 4 rows (2 KV heads x 8 dims), random contents."""
    pools = allocate_pools({kind: ((40, 4, 2, 8), torch.float32) for kind in ("keys", "values")}, pin=False)
    gen = torch.Generator().manual_seed(0)
    for pool in pools.values():
        pool.tensor.copy_(torch.randn(pool.shape, generator=gen))
    return OffloadedKV(pools["keys"], pools["values"], arena_rows, torch.device("cpu"),
                       max_cached_batch=max_cached_batch)


@pytest.mark.parametrize("arena_rows", [7, 200])
def test_prefill_reads_of_query_groups_equal_pool_reads(arena_rows):
    """200 rows hold the chunk's distinct rows: staged once. 7 do not: each group of queries is staged
    on its own, section by section. Either way the arena's overwritten slots are forgotten."""
    layer = offloaded_layer(arena_rows=arena_rows)
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 160, (5, 12), generator=gen)
    valid = torch.rand(5, 12, generator=gen) > 0.2
    layer.cache.tags[:] = torch.arange(arena_rows) + arena_rows * 3  # pretend every slot holds a row
    read = layer.prefill_reader(rows, valid)
    for lo, hi in ((0, 2), (2, 5)):
        keys, values = read(lo, hi)
        mask = valid[lo:hi, :, None, None]
        assert torch.equal(keys, torch.where(mask, layer.host_k[rows[lo:hi]], 0.0))
        assert torch.equal(values, torch.where(mask, layer.host_v[rows[lo:hi]], 0.0))
    distinct = torch.unique(rows[valid]).numel()
    if arena_rows > distinct:  # staged once: the first `distinct` slots were overwritten, the rest kept
        assert (layer.cache.tags[:distinct] == -1).all() and (layer.cache.tags[distinct:] >= 0).all()
    else:  # staged a section at a time: every slot was overwritten
        assert (layer.cache.tags == -1).all()


@pytest.mark.parametrize("arena_rows", [7, 200])
def test_prefill_attention_through_the_arena_equals_attention_over_the_pools(arena_rows):
    """The kernel path's staging (the CPU runs the reference attention): 200 rows hold the chunk's rows,
    staged once, and give the very bits of attention over the pools; 7 do not: parts merged."""
    layer = offloaded_layer(arena_rows=arena_rows)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 8, generator=gen)
    rows = torch.randint(0, 160, (5, 12), generator=gen)
    valid = torch.rand(5, 12, generator=gen) > 0.2
    valid[:, -1] = True
    got = layer.prefill_attention(q, rows, valid, 0.35)
    expected = sparse_attention(q, layer.host_k, layer.host_v, rows, valid, 0.35)
    if arena_rows > torch.unique(rows[valid]).numel():
        assert torch.equal(got, expected)
    else:
        assert torch.allclose(got, expected, atol=1e-5) and not torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("arena_rows", [61, 16384])
def test_offloaded_prefill_kernel_path_on_cuda(demo_dir, arena_rows):
    """Prefill through the sparse kernel from the arena: staged once (16,384 rows), the same tokens and
    logprobs as device pools bit for bit; in parts (61 rows), the same tokens, logprobs within 1e-2."""
    options = {"device": "cuda", "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": False}
    prompts = ["def parse(tokens):\n" * 30, "import os\n", "class Node:\n    def __init__(self):\n" * 8]
    expected = LLM(str(demo_dir), **options, qsa_kv_offload=False).generate(prompts, PARAMS)
    got = LLM(str(demo_dir), **options, qsa_kv_offload=True, qsa_row_cache_rows=arena_rows).generate(prompts, PARAMS)
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for p, r in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if arena_rows == 16384:
                assert list(p.items()) == list(r.items())
            else:
                assert [x.logprob for x in p.values()] == pytest.approx([x.logprob for x in r.values()], abs=1e-2)


def test_large_batches_read_every_row_from_the_pool_and_still_invalidate():
    layer = offloaded_layer(arena_rows=64, max_cached_batch=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 8, generator=gen)
    rows = torch.randint(0, 160, (3, 10), generator=gen)
    valid = torch.ones(3, 10, dtype=torch.bool)
    layer.write(torch.tensor([5]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8))
    small = layer.decode_attention(q[:2], rows[:2], valid[:2], 0.35)  # decode-shaped: fills the cache
    cached = layer.cache.tags.clone()
    assert (cached >= 0).sum() > 0
    rewritten = cached[cached >= 0][:1]
    layer.write(rewritten, torch.ones(1, 2, 8), torch.ones(1, 2, 8))  # a cached row changes in the pool
    assert layer.cache.tags[rewritten % 64] == -1
    large = layer.decode_attention(q, rows, valid, 0.35)  # 3 > 2 requests: not planned, nothing cached
    hits, misses = layer.cache.counters()
    assert (hits, misses) == (0, int(valid[:2].sum()))
    assert ((layer.cache.tags == cached) | (layer.cache.tags == -1)).all()
    expected = attend_rows(q, layer.host_k[rows], layer.host_v[rows], valid, 0.35)
    assert torch.equal(large, expected) and not torch.equal(large[:2], small)


@pytest.mark.parametrize("arena_rows", [61, 16384])
def test_prefill_in_query_groups_gives_what_one_group_gives(demo_dir, monkeypatch, arena_rows):
    """Prefill queries scored, selected and attended a few at a time (bounded memory at long context):
    the same generation as all at once, and offloaded pools still equal device pools bit for bit, whether
    each group is staged on its own (61 rows) or the chunk is staged once (16,384)."""
    options = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 2, "enable_prefix_caching": False}
    prompts = ["def parse(tokens):\n" * 30, "class Node:\n    def __init__(self):\n" * 8]
    whole = LLM(str(demo_dir), **options).generate(prompts, PARAMS)
    monkeypatch.setattr(qsa_attention, "PREFILL_GROUP_BYTES", 1)  # one query at a time
    grouped = {offload: LLM(str(demo_dir), **options, qsa_kv_offload=offload, qsa_row_cache_rows=arena_rows).generate(
        prompts, PARAMS) for offload in (False, True)}
    for a, b, c in zip(grouped[False], grouped[True], whole):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert [list(p.items()) for p in a.outputs[0].logprobs] == [list(p.items()) for p in b.outputs[0].logprobs]
        for got, want in zip(a.outputs[0].logprobs, c.outputs[0].logprobs):
            assert list(got) == list(want)
            assert [p.logprob for p in got.values()] == pytest.approx([p.logprob for p in want.values()], abs=1e-5)


def test_offload_with_prefix_caching_equals_device_pools(demo_dir):
    """Cached prefix blocks (shared rows, their slots in the row cache) and freed blocks reused by later
    requests (new rows over old ones: their cached copies must go) change nothing."""
    options = {"device": "cpu", "max_model_len": 512, "max_num_seqs": 2, "kv_cache_memory_bytes": 3_000_000}
    shared = "def parse(tokens):\n    return [t for t in tokens]\n" * 6
    rounds = [[shared + "x = 1\n", shared + "y = 2\n"], [shared + "z = 3\n"]]
    rounds += [[f"class C{i}:\n" + f"    def m{i}(self): return {i}\n" * 30] * 2 for i in range(4)]
    engines = {offload: LLM(str(demo_dir), **options, qsa_kv_offload=offload, qsa_row_cache_rows=97)
               for offload in (False, True)}
    blocks_used, block_size = 0, engines[True].engine.cache_plan.block_size
    for prompts in rounds:
        expected, got = (engines[offload].generate(prompts, PARAMS) for offload in (False, True))
        for a, b in zip(got, expected):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert [list(p.items()) for p in a.outputs[0].logprobs] == [list(p.items()) for p in b.outputs[0].logprobs]
            blocks_used += -(-(len(a.prompt_token_ids) + len(a.outputs[0].token_ids)) // block_size)
    assert blocks_used > engines[True].engine.cache_plan.num_blocks  # so freed blocks were handed out again
    stats = engines[True].engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.qsa_row_cache_hits > 0
