"""QSA decode attention over rows in a pinned host pool (UVA): all from host vs the VRAM row cache (GPU).

At the target model's QSA shapes (24 query heads over 2 KV heads, head_dim 256, bf16: 2 KiB of K+V per
row, budget 2048 + tail per step) it times, per layer and step, what a decode step runs there: the store of the new token's row, then the
decode attention
  - reading every selected row from host (the cache never planned: every row crosses PCIe), and
  - through the row cache (store + plan + attention), where consecutive steps share 0%, 72% or 100% of
    their rows,
each step replayed from a CUDA graph (as a captured decode step runs). It checks that the cached output
equals the all-from-host output bit for bit, and reports the pinned pool's requested vs resident bytes
(exact, not rounded up to a power of two).

    python bench/qsa_row_cache.py                   # needs CUDA and triton
"""

from __future__ import annotations

import argparse

import torch

from tierlm.kernels.qsa_row_cache import QSARowCache
from tierlm.kernels.qsa_row_cache.triton import triton_decode_attention, triton_plan_rows, triton_store_rows
from tierlm.memory.host_pool import HostPool


def selections(steps: int, rows: int, selected: int, overlap: float, seed: int) -> list[torch.Tensor]:
    """Row selections where each step keeps `overlap` of the previous one's rows."""
    gen = torch.Generator().manual_seed(seed)
    current = torch.randperm(rows, generator=gen)[:selected]
    out = [current]
    keep = round(overlap * selected)
    for _ in range(steps - 1):
        fresh = torch.randint(0, rows, (selected - keep,), generator=gen)
        current = torch.cat([current[torch.randperm(selected, generator=gen)[:keep]], fresh])
        out.append(current)
    return out


def time_steps(fn, steps: list[torch.Tensor]) -> float:
    """Mean GPU milliseconds of one step, fn replayed from a CUDA graph (so launch overhead, which a
    decode step captured in a graph does not pay, is out; each step's rows are copied in outside)."""
    rows_in = steps[0].clone()
    for rows in steps[:20]:  # warm-up (compilation, cache filling)
        rows_in.copy_(rows)
        fn(rows_in)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(rows_in)
    total = 0.0
    for rows in steps[20:]:
        rows_in.copy_(rows)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        total += start.elapsed_time(end)
    return total / (len(steps) - 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=262_144, help="rows in the pool (one layer)")
    parser.add_argument("--selected", type=int, default=2048 + 3, help="rows read per step (budget + tail)")
    parser.add_argument("--cache-rows", type=int, default=16_384, help="VRAM row-cache slots")
    parser.add_argument("--heads", type=int, default=24, help="query heads (over 2 KV heads of 256)")
    parser.add_argument("--steps", type=int, default=520)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = (args.context, 2, 256)
    pool_k, pool_v = HostPool(shape, torch.bfloat16, pin=True), HostPool(shape, torch.bfloat16, pin=True)
    gen = torch.Generator().manual_seed(0)
    for pool in (pool_k, pool_v):
        pool.tensor.copy_(torch.randn(shape, generator=gen).to(torch.bfloat16))
    print(f"pinned pool: requested {pool_k.nbytes:,} B, mapped {pool_k.mapped_bytes:,} B, "
          f"resident {pool_k.resident_bytes():,} B (x2 for K and V)")

    q = torch.randn(1, args.heads, 256, generator=gen).to(device=device, dtype=torch.bfloat16)
    scale = 256**-0.5
    valid = torch.ones(1, args.selected, dtype=torch.bool, device=device)
    never_planned = QSARowCache(*(torch.zeros(1, 2, 256, dtype=torch.bfloat16, device=device) for _ in range(2)))
    all_miss = torch.zeros(1, args.selected, dtype=torch.bool, device=device)
    # the step's new token: one row rewritten (with what it held, so that every step reads the same pool)
    written = torch.zeros(1, dtype=torch.int64, device=device)
    new_k, new_v = (pool.tensor[:1].to(device) for pool in (pool_k, pool_v))

    def from_host(rows: torch.Tensor):
        # claims stay -1 in a cache never planned: no write happens, every row is read from the pool
        triton_store_rows(never_planned, pool_k.tensor, pool_v.tensor, written, new_k, new_v)
        return triton_decode_attention(never_planned, pool_k.tensor, pool_v.tensor, q, rows, valid, all_miss, scale)

    print(f"{'overlap':>8}{'all from host (us)':>20}{'row cache (us)':>16}{'ratio':>8}{'hit rate':>10}{'exact':>7}")
    for overlap in (0.0, 0.72, 1.0):
        steps = [s.view(1, -1).to(device) for s in selections(args.steps, args.context, args.selected, overlap, 1)]
        arena = [torch.zeros(args.cache_rows, 2, 256, dtype=torch.bfloat16, device=device) for _ in range(2)]
        cache = QSARowCache(*arena)

        def cached(rows: torch.Tensor, cache=cache):
            triton_store_rows(cache, pool_k.tensor, pool_v.tensor, written, new_k, new_v)
            hit = triton_plan_rows(cache, rows, valid)
            return triton_decode_attention(cache, pool_k.tensor, pool_v.tensor, q, rows, valid, hit, scale)

        host_ms = time_steps(from_host, steps)
        hits_before, misses_before = cache.counters()
        cache_ms = time_steps(cached, steps)
        hits, misses = cache.counters()
        exact = all(torch.equal(cached(rows), from_host(rows)) for rows in steps[-5:])
        rate = (hits - hits_before) / max(1, hits - hits_before + misses - misses_before)
        print(f"{overlap:>8.0%}{host_ms * 1000:>20.1f}{cache_ms * 1000:>16.1f}{cache_ms / host_ms:>7.2f}x"
              f"{rate:>10.1%}{exact!s:>7}")


if __name__ == "__main__":
    main()
