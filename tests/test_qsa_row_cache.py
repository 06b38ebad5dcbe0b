"""The QSA decode row cache (kernels/qsa_row_cache): cached reads equal reads of the pool, bit for bit;
the Triton kernels equal the reference; prefill staging through the arena equals reading the pool."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import run_interpreted

from tierlm.kernels.qsa_row_cache import (
    QSARowCache,
    attend_rows,
    decode_attention,
    plan_rows,
    read_rows,
    store_rows,
)
from tierlm.memory.host_pool import HostPool

NKV, HD, BLOCK_SIZE, NUM_BLOCKS = 2, 8, 16, 32
NUM_HEADS = 2 * NKV
SCALE = HD**-0.5
SCRATCH_ROW = (NUM_BLOCKS - 1) * BLOCK_SIZE  # the last block plays the scratch block padding points at
B, S = 3, 24


def empty_cache(num_slots: int, dtype=torch.float32) -> QSARowCache:
    arena = torch.randn(2, num_slots, NKV, HD).to(dtype)  # whatever the arena held before
    return QSARowCache(arena[0], arena[1])


class Workload:
    """Synthetic decode steps over a host pool: each step keeps ~70% of every request's rows, requests
    0 and 2 share rows (a shared prefix), ~10% of entries are padding, and rows are rewritten (the new
    token's row among them, so a row is both written and read in one step)."""

    def __init__(self, seed: int, dtype=torch.float32) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.host_k = self.randn(NUM_BLOCKS * BLOCK_SIZE).to(dtype)
        self.host_v = self.randn(NUM_BLOCKS * BLOCK_SIZE).to(dtype)
        self.rows = self.random_rows((B, S))

    def randn(self, n: int) -> torch.Tensor:
        return torch.randn(n, NKV, HD, generator=self.gen)

    def random_rows(self, shape) -> torch.Tensor:
        return torch.randint(0, SCRATCH_ROW, shape, generator=self.gen)

    def query(self) -> torch.Tensor:
        return torch.randn(B, NUM_HEADS, HD, generator=self.gen).to(self.host_k.dtype)

    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows written to the pool, rows [B, S], valid [B, S]) of the next step; one step in five,
        request 1's last 8 entries are all padding."""
        keep = torch.rand(B, S, generator=self.gen) < 0.7
        self.rows = torch.where(keep, self.rows, self.random_rows((B, S)))
        self.rows[2, :8] = self.rows[0, :8]
        written = torch.cat([self.random_rows((2,)), self.rows[0, -1:]])
        for pool in (self.host_k, self.host_v):
            pool[written] = self.randn(3).to(pool.dtype)
            pool[SCRATCH_ROW] = self.randn(1).to(pool.dtype)  # padding writes, never invalidated
        valid = torch.rand(B, S, generator=self.gen) > 0.1
        if torch.rand(1, generator=self.gen) < 0.2:
            valid[1, -8:] = False
        return written, torch.where(valid, self.rows, SCRATCH_ROW), valid

    def overwrite_arena(self, cache: QSARowCache) -> None:
        """A staged prefill used the arena: the slots' bytes change, then the cache forgets them."""
        cache.keys.copy_(self.randn(cache.num_slots).to(cache.keys.dtype))
        cache.values.copy_(self.randn(cache.num_slots).to(cache.values.dtype))
        cache.drop_slots(cache.num_slots)


def check_tags(cache: QSARowCache, work: Workload) -> None:
    """Every tag names the row its slot really holds, in the slot that row maps to."""
    slots = torch.nonzero(cache.tags >= 0).flatten()
    tags = cache.tags[slots]
    assert torch.equal(tags % cache.num_slots, slots)
    assert torch.equal(cache.keys[slots], work.host_k[tags])
    assert torch.equal(cache.values[slots], work.host_v[tags])
    assert not (cache.tags == SCRATCH_ROW).any()  # padding never enters the cache


def test_cached_reads_equal_pool_reads_over_many_steps():
    work, cache = Workload(seed=0), empty_cache(num_slots=29)  # ~70 entries a step: many collisions
    never_planned = empty_cache(num_slots=29)
    valid_entries = 0
    for step in range(1000):
        if step == 500:
            work.overwrite_arena(cache)
        written, rows, valid = work.step()
        cache.invalidate(written)
        hit = plan_rows(cache, rows, valid)
        before = cache.keys.clone(), cache.values.clone(), cache.tags.clone()
        keys, values = read_rows(cache, work.host_k, work.host_v, rows, hit)

        assert torch.equal(keys, work.host_k[rows]) and torch.equal(values, work.host_v[rows])
        # the same step through attention: with the cache planned, and with nothing cached (never planned)
        q = work.query()
        uncached = decode_attention(never_planned, work.host_k, work.host_v, q, rows, valid,
                                    torch.zeros_like(valid), SCALE)
        assert torch.equal(attend_rows(q, keys, values, valid, SCALE), uncached)
        hit_slots = cache.hitmark == cache.epoch
        assert torch.equal(hit_slots.nonzero().flatten(), torch.unique(rows[hit] % cache.num_slots))
        for old, new in zip(before, (cache.keys, cache.values, cache.tags)):
            assert torch.equal(old[hit_slots], new[hit_slots])  # a slot being read is not written
        check_tags(cache, work)
        valid_entries += int(valid.sum())
    hits, misses = cache.counters()
    assert hits + misses == valid_entries
    assert hits / valid_entries > 0.2


def test_collisions_hits_keep_their_slot_and_the_highest_claim_wins():
    work, cache = Workload(seed=1), empty_cache(num_slots=4)
    cache.invalidate(torch.tensor([5]))  # step 1: row 5 goes into slot 1
    read_rows(cache, work.host_k, work.host_v, torch.tensor([[5]]), plan_rows(cache, torch.tensor([[5]]),
                                                                              torch.tensor([[True]])))
    assert cache.tags.tolist() == [-1, 5, -1, -1]

    cache.invalidate(torch.tensor([], dtype=torch.int64))
    rows = torch.tensor([[5, 9, 2, 6, 6, 10]])  # slot 1: 5 hits, 9 misses; slot 2: 2, 6, 10 miss
    valid = torch.tensor([[True, True, True, True, True, False]])  # 10 is padding: it claims nothing
    hit = plan_rows(cache, rows, valid)
    assert hit.tolist() == [[True, False, False, False, False, False]]
    keys, _ = read_rows(cache, work.host_k, work.host_v, rows, hit)
    assert torch.equal(keys, work.host_k[rows])
    assert cache.tags.tolist() == [-1, 5, 6, -1]  # 9 lost to the hit, 6 beat 2, 10 never claimed
    assert cache.counters() == (1, 5)

    cache.invalidate(torch.tensor([6, 7]))  # 6 rewritten: slot 2 empties; 7 was not cached
    assert cache.tags.tolist() == [-1, 5, -1, -1]
    cache.drop_slots(cache.num_slots)
    assert (cache.tags == -1).all()


def compare_triton_with_reference(steps: int, dtype: torch.dtype, split: int) -> None:
    """The Triton kernels and the reference, in lockstep on one workload: the same cache state after
    every step, attention outputs equal up to summation order, and the kernel's output through the cache
    equal bit for bit to its output with every row read from the pool.

    On CUDA the kernels run compiled and read the pool from registered host memory over UVA; without a
    GPU, Triton's interpreter runs them (TRITON_INTERPRET=1, set before triton is first imported).
    split: entries per program (8: each request's 24 entries take 3 programs per KV head, some with no
    valid entry; 1: 24 splits, merged 8 at a time).
    """
    import tierlm.kernels.qsa_row_cache.triton as kernels

    kernels.DECODE_SPLIT, kernels.DECODE_BLOCK_N, kernels.MERGE_CHUNK = split, 16, 8
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    work = Workload(seed=2, dtype=dtype)
    reference = empty_cache(num_slots=29, dtype=dtype)
    arena = torch.stack([reference.keys, reference.values]).to(device)
    kernel = QSARowCache(arena[0], arena[1])
    never_planned = QSARowCache(*torch.zeros(2, 29, NKV, HD, dtype=dtype, device=device))
    pools = [HostPool(work.host_k.shape, dtype, pin=device == "cuda") for _ in range(2)]
    for step in range(steps):
        if step == steps // 2:
            work.overwrite_arena(reference)
            kernel.keys.copy_(reference.keys)
            kernel.values.copy_(reference.values)
            kernel.drop_slots(kernel.num_slots)
        written, rows, valid = work.step()
        q = work.query()
        pools[0].tensor.copy_(work.host_k)
        pools[1].tensor.copy_(work.host_v)
        new_k, new_v = work.host_k[written], work.host_v[written]  # what the step wrote (the pools hold it)
        store_rows(reference, work.host_k, work.host_v, written, new_k, new_v)
        hit = plan_rows(reference, rows, valid)
        expected = decode_attention(reference, work.host_k, work.host_v, q, rows, valid, hit, SCALE)
        kernels.triton_store_rows(kernel, pools[0].tensor, pools[1].tensor, written.to(device), new_k.to(device),
                                  new_v.to(device))
        hit = kernels.triton_plan_rows(kernel, rows.to(device), valid.to(device))
        out = kernels.triton_decode_attention(kernel, pools[0].tensor, pools[1].tensor, q.to(device), rows.to(device),
                                              valid.to(device), hit, SCALE)
        all_from_pool = kernels.triton_decode_attention(  # hit None: never planned, every row from the pool
            never_planned, pools[0].tensor, pools[1].tensor, q.to(device), rows.to(device), valid.to(device), None,
            SCALE,
        )
        assert torch.equal(out, all_from_pool)
        torch.testing.assert_close(out.cpu(), expected, atol=tolerance, rtol=tolerance)
        if step == 0:  # the gate applied in the merge: as torch's out * sigmoid(gate) (rounded alike on a GPU)
            gate = torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(dtype).to(device)
            gated = kernels.triton_decode_attention(never_planned, pools[0].tensor, pools[1].tensor, q.to(device),
                                                    rows.to(device), valid.to(device), None, SCALE, gate)
            torch.testing.assert_close(gated, out * torch.sigmoid(gate), atol=tolerance, rtol=tolerance)
        for name in ("keys", "values", "tags", "hitmark", "claims", "epoch", "hits", "misses"):
            assert torch.equal(getattr(reference, name), getattr(kernel, name).cpu()), name
    assert (never_planned.tags == -1).all()
    for pool in pools:
        pool.close()


def compare_row_moves(device: str) -> None:
    """Storing new rows into the pools (their slots emptied) and gathering rows out (prefill staging):
    the kernels vs the reference."""
    from tierlm.kernels.qsa_row_cache.triton import triton_gather_rows, triton_store_rows

    gen = torch.Generator().manual_seed(3)
    pools = [HostPool((64, NKV, HD), torch.bfloat16, pin=device == "cuda") for _ in range(2)]
    expected = [torch.randn(64, NKV, HD, generator=gen).to(torch.bfloat16) for _ in range(2)]
    for pool, start in zip(pools, expected):
        pool.tensor.copy_(start)
    reference = empty_cache(num_slots=29, dtype=torch.bfloat16)
    reference.tags.copy_(torch.arange(29) + 29 * (torch.arange(29) % 2))  # every slot holds a row
    kernel = QSARowCache(reference.keys.to(device), reference.values.to(device))
    kernel.tags.copy_(reference.tags)
    rows = torch.randperm(64, generator=gen)[:20]
    new = [torch.randn(20, NKV, HD, generator=gen).to(torch.bfloat16) for _ in range(2)]
    store_rows(reference, *expected, rows, *new)
    triton_store_rows(kernel, pools[0].tensor, pools[1].tensor, rows.to(device), new[0].to(device), new[1].to(device))
    if device == "cuda":
        torch.cuda.synchronize()
    assert all(torch.equal(pool.tensor, want) for pool, want in zip(pools, expected))
    assert torch.equal(kernel.tags.cpu(), reference.tags) and torch.equal(kernel.epoch.cpu(), reference.epoch)
    assert (reference.tags == -1).sum() > 0
    out = torch.zeros(24, NKV, HD, dtype=torch.bfloat16, device=device)
    wanted = torch.randint(0, 64, (17,), generator=gen)
    triton_gather_rows(out, pools[0].tensor, wanted.to(device))
    assert torch.equal(out[:17].cpu(), expected[0][wanted]) and not out[17:].any()
    for pool in pools:
        pool.close()


def test_triton_kernels_equal_the_reference():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        for dtype, split in ((torch.bfloat16, 8), (torch.float32, 1)):
            compare_triton_with_reference(steps=2000, dtype=dtype, split=split)
        compare_row_moves("cuda")
        return
    run_interpreted(*INTERPRETED_EARLY["test_triton_kernels_equal_the_reference"])


INTERPRETED_EARLY = {  # (a long child: started when collection ends, see tests/interpreted.py)
    "test_triton_kernels_equal_the_reference": (
        ("import torch, test_qsa_row_cache as t; t.compare_row_moves('cpu')\n"
        "t.compare_triton_with_reference(steps=8, dtype=torch.bfloat16, split=8)\n"
        "t.compare_triton_with_reference(steps=4, dtype=torch.float32, split=1)"),),
}
