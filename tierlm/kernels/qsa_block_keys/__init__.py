"""The QSA indexer's decode-step key store: each request's new raw indexer key into its ring (the open
group of R tokens), and, where the key closes the group, the group's compressed key into the paged pool:
k_layernorm(mean of the R raw keys, in fp32 cast to the dtype), roped at the group's first position.

Shapes (shared by both forms): raw_keys [B, id]; ring [S, R, id] (per slot); index_keys [num_blocks,
block_size / R, id] (the pool); slots, context_lens [B] int64 (the new token's position is its context
length); block_tables [B, W] int64; weight [id] (the norm's w in x * (1 + w)); inv_freq [rd / 2] fp32
(1-D RoPE: an M-RoPE batch takes the layer's torch path). Written in place; nothing returned.

`naive.store_decode_block_keys` is the layer's torch code (a compressed key computed for every request and
written to the scratch block where its group is still open: static shapes, ~25 launches);
`triton.triton_store_decode_block_keys` is one launch, one program per request, that writes a compressed
key only where a group closes (the scratch block's contents are unspecified in both) and computes the
rotary angles itself. The ring is bit-identical; the keys differ only by the norm's summation order (the
kernel's products rounded as torch rounds them, see `kernels/norm_rope`). Where a group's key goes (its
row in the block table's block, or the scratch block's) is one definition for every QSA key store:
`naive.group_key_rows` (torch) and `triton.group_key_row` (kernels).
"""

from tierlm.kernels.qsa_block_keys.naive import store_decode_block_keys

__all__ = ["store_decode_block_keys"]
