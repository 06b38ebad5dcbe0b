"""Gemma RMS norm then partial NeoX rotary, per head: what QSA does to its queries and keys and the indexer
to its queries and compressed keys (four places, ~15 elementwise launches each on the torch path).

Shapes (shared by both forms): x [N, heads, D] (the last dim contiguous; the first two may be strided, as
the query half of QSA's [query | gate] projection is), weight [D] (the norm's w in x * (1 + w)), cos,
sin [N, rd] in x's dtype (rd <= D, even), eps -> [N, heads, D] contiguous, in x's dtype.

`naive.norm_rope` is the layers' own torch code (`RMSNorm` then `apply_rotary`). `triton.triton_norm_rope`
is one launch, one program per (token, head): the norm in fp32 rounded to x's dtype, then each rotary
product and sum rounded to x's dtype as the torch ops round them, so the two differ only where the
kernel's fp32 sum of squares (another summation order) rounds the normed value differently.

Two more forms take a text batch's positions [N] int64 and the inverse frequencies inv_freq [rd / 2] fp32
instead of cos/sin (the kernel computes the angles as `naive.rotary_cos_sin` does, so no table is
launched): `norm_rope_at` (the same output) and `norm_rope_kv_write` (QSA's new keys normed and roped
straight into their K/V pool rows, the values beside them: pools [R, nkv, hd], rows [N] int64).
"""

from tierlm.kernels.norm_rope.naive import norm_rope, norm_rope_at, norm_rope_kv_write

__all__ = ["norm_rope", "norm_rope_at", "norm_rope_kv_write"]
