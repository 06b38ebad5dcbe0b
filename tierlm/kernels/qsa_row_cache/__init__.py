"""The QSA decode row cache: K/V rows read from a host pool, kept in an idle VRAM arena for later steps.

At long context a QSA layer's K/V pool lives in pinned host RAM (`memory/host_pool`) and a decode step
reads only the rows its indexer selected (budget + tail per request) over PCIe. Consecutive steps select
mostly the same rows, so each layer keeps a direct-mapped cache of C slots in VRAM (the layer's staging
arena, idle between prefills): row r may live only in slot r % C, and a slot's tag says which row it
holds. Output is bit-identical to reading the pool.

Shapes (shared by every form): cache slots keys, values [C, nkv, hd], tags [C] int64 (-1: empty);
host_keys, host_values [R, nkv, hd] (the paged pool [num_blocks, block_size, nkv, hd] viewed as rows);
rows [B, S] int64 physical rows in [0, R), R < 2**32; valid [B, S] bool (an invalid entry is padding:
it reads the pool and never enters the cache).

One decode step, per layer (`QSARowCache` holds the state; `naive` has the plain torch forms):
  store_rows(cache, host_keys, host_values, rows_written, keys, values)
                                   new rows into the pool; those rows lose their slot; the step's epoch
                                   advances (every row written to the pool must pass through here)
  hit = plan_rows(cache, rows, valid)
                                   a valid entry hits if tags[r % C] == r, and marks its slot with the
                                   epoch; a valid miss claims its slot with max(epoch << 32 | r)
  out = decode_attention(cache, host_keys, host_values, q, rows, valid, hit, scale, gate)
                                   attention of each request's query q [B, nh, hd] over its rows
                                   (times sigmoid(gate [B, nh, hd]) when given; hit None: all False):
                                   hits read the slot, the rest read the pool (one pointer select); a
                                   miss fills its slot (data, then tag) only if its claim won and no
                                   entry hit that slot this step, so a slot being read is never written
                                   (`read_rows` is that read alone, in the reference)
  cache.drop_slots(n)              a staged prefill overwrote the arena's first n rows
The plan is the only point where all entries of a step must agree (in a kernel: the launch boundary).
The Triton attention kernel splits each request's entries over several programs and merges their
softmax partials afterwards (flash-decoding), so one request's 2k rows keep many SMs busy.
"""

from tierlm.kernels.qsa_row_cache.naive import (
    QSARowCache,
    attend_rows,
    decode_attention,
    plan_rows,
    read_rows,
    store_rows,
)

__all__ = ["QSARowCache", "attend_rows", "decode_attention", "plan_rows", "read_rows", "store_rows"]
