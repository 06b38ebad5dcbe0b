"""The QSA decode row cache: K/V rows read from a host pool, kept in an idle VRAM arena for later steps.

At long context a QSA layer's K/V pool lives in pinned host RAM (`memory/host_pool`) and a decode step
reads only the rows its indexer selected (budget + tail per request) over PCIe. Consecutive steps select
mostly the same rows, so each layer keeps a direct-mapped cache of C slots in VRAM: row r may live only
in slot r % C, and a slot's tag says which row it holds. Output is bit-identical to reading the pool.

Shapes (shared by every form): cache slots keys, values [C, nkv, hd], tags [C] int64 (-1: empty);
host_keys, host_values [R, nkv, hd] (the paged pool [num_blocks, block_size, nkv, hd] viewed as rows);
rows [B, S] int64 physical rows in [0, R), R < 2**32; valid [B, S] bool (an invalid entry is padding:
it reads the pool and never enters the cache). Returns keys, values [B, S, nkv, hd].

One decode step, per layer (`QSARowCache` holds the state; `naive` has the plain torch forms):
  cache.invalidate(rows_written)   rows written to the pool since the last step lose their slot; the
                                   step's epoch advances (every written row must pass through here)
  hit = plan_rows(cache, rows, valid)
                                   a valid entry hits if tags[r % C] == r, and marks its slot with the
                                   epoch; a valid miss claims its slot with max(epoch << 32 | r)
  keys, values = read_rows(cache, host_keys, host_values, rows, hit)
                                   hits read the slot, the rest read the pool (one select); a miss
                                   fills its slot (data, then tag) only if its claim won and no entry
                                   hit that slot this step, so a slot being read is never written
  cache.drop_all()                 the arena was used for something else (a staged prefill)
The plan is the only point where all entries of a step must agree (in a kernel: the launch boundary).
"""

from tierlm.kernels.qsa_row_cache.naive import QSARowCache, plan_rows, read_rows

__all__ = ["QSARowCache", "plan_rows", "read_rows"]
