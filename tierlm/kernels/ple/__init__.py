"""PLE's decode step, between the n-gram ids and the residual streams (`model/layers/ple.py` owns the layer).

Signatures (every form):
  decode_embeddings(context [S, P] int64, slots [B], tokens [B], table [rows, dE], scale [1] fp32 or None,
      multipliers [P + 1] int64, sizes [heads] int64, offsets [heads] int64, heads_per_ngram, eos, dtype)
      -> the n-gram embeddings [B, heads * dE] in dtype: each request's n-gram context (its last P = ngram_size-1
      ids, then its new token; ids at or before an EOS read as EOS), hashed per head (`model/ngram_hash.py`:
      X_n = XOR_{i<n} t_i * m_i, row = X_n mod size + offset), the rows gathered (an fp8 table's times its
      scale, in fp32) and cast to dtype.
  decode_residual(streams [B, hc*H], key [B, hc*H], value [B, H], norm_key_weight, norm_query_weight,
      norm_conv_weight [hc*H], conv_weight [hc*H, K], conv_state [S, hc*H, (K-1)*dilation], slots [B], eps,
      dilation) -> streams + the PLE output, the conv history of each request's slot moved on by one:
      each stream's gate sigmoid(signed sqrt(<norm_key(key)_s, norm_query(streams)_s> / sqrt(H))), gv = gate * value,
      out = gv + silu(dilated causal conv over the history and norm_conv(gv)) (Gemma RMS norms per stream).
  advance_context(context [S, P] int64, slots [B], tokens [B]) -> None: each request's context moved past
      its new token, in place (once per forward, after every PLE layer read it).
  naive.py   plain torch, rounded where the layer's torch path rounds (the reference)
  triton.py  CUDA: decode_embeddings in one launch (a program per request and head: hash, row, gather);
             decode_residual in one (a program per request, stream and channel block: the stream's norms and
             gate from its whole row, then the block's conv, history update and residual add); no host
             syncs and fixed shapes, so a CUDA graph captures them; advance_context in one (a
             program per request)
"""

from tierlm.kernels.ple.naive import advance_context, decode_embeddings, decode_residual

__all__ = ["advance_context", "decode_embeddings", "decode_residual"]
