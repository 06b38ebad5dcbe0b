"""The gated delta rule (Gated DeltaNet's recurrence), in a per-token reference and a chunked form.

Shapes (shared by both forms): q, k [B, T, H, Dk] (already l2-normalised, q already scaled by Dk^-1/2),
v [B, T, H, Dv], g [B, T, H] (log decay <= 0), beta [B, T, H], initial_state [B, H, Dk, Dv] fp32.
Returns (o [B, T, H, Dv] fp32, final_state [B, H, Dk, Dv] fp32). Per head and token:
  S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.

The decode step also has a batched form with grouped key heads (`fused_recurrent`), and a layer's whole decode
step after its input projections (conv, norms, gates, rule, gated output norm: `decode.gated_delta_decode`, the
torch reference; `decode_triton`, one Triton launch, used on CUDA), and over T tokens per request keeping
the state after each (`decode.gated_delta_verify`, speculative verification; the same kernels). Prefill batches have a
varlen form over packed sequences with grouped key heads and states in a pool (`chunk.chunk_gated_delta_rule_varlen`,
the torch reference; `chunk_triton`, one Triton launch for the whole batch, used on CUDA).
"""

from tierlm.kernels.gated_delta_rule.chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_varlen
from tierlm.kernels.gated_delta_rule.decode import gated_delta_decode, gated_delta_verify
from tierlm.kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_step
from tierlm.kernels.gated_delta_rule.naive import recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_varlen",
    "fused_recurrent_gated_delta_rule_step",
    "gated_delta_decode",
    "gated_delta_verify",
    "recurrent_gated_delta_rule",
]
