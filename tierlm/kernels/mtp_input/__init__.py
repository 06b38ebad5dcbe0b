"""The MTP draft head's layer input (`model/mtp.py` `layer_input`): token t+1's embedding e [N, H] and the
target's streams h [N, hc*H] at t -> streams [N, hc*H], stream s = fc_hidden(norm_h(h))_s + fc_embedding(norm_e(e)).
norm_e is a Gemma RMS norm over H, norm_h one over the whole hc*H vector (not one per stream), both in fp32
and rounded to the activations' dtype; fc_hidden [H, H] is shared by the streams; each product is rounded
to the dtype before the sum (as the module's torch ops round them).

`naive.mtp_layer_input`: those torch ops on dense weights; `triton.mtp_layer_input`: one launch of the same
arithmetic (accumulation order aside): on CUDA, decode-sized batches (`model/mtp.py` says when;
TIERLM_NO_FUSED_MTP_INPUT=1 turns it off), in place of ~20 small kernels (two norms of ~10 ops in bf16,
two GEMVs, the sum).
"""

from tierlm.kernels.mtp_input.naive import mtp_layer_input

__all__ = ["mtp_layer_input"]
