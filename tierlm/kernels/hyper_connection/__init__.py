"""Hyper-connections' two ops on the multi-stream state (hc streams of width H, stream-major [N, hc*H]).

Signatures (every form):
  mix(streams [N, hc*H], norm_weight [hc*H], down_weight [r (+ hc), hc*H], up_weight [hc*H, r], hc_count,
      eps, down_scale=None, up_scale=None) -> (block input [N, H], injection gates [N, hc] or None): a
      grouped (per stream) Gemma RMSNorm, a low-rank sigmoid mixer silu(W_down xn / hc) -> sigmoid(W_up .) [hc*H], the mean over streams of
      gate * xn; with the hc injection rows packed after W_down's r rows (`block_inject_weight`) also
      2 sigmoid(W_inj xn / hc). Everything rounded to the streams' dtype where transformers' module
      rounds it (`Qwen4ExpTextGatedResidual`; the layer `model/layers/hyper_connection.py` is the same
      math through its quant methods). A weight given with its scale is INT8 per channel, as int4-mixed
      checkpoints hold the mixers: int32 words [N, K / 4] in compressed-tensors' packing and scales [N, 1]
      (`naive.int8_weight_shape`); the reference dequantizes it to the streams' dtype as the layer does,
      the kernels read the words in place and scale each row's fp32 dot product.
  combine(streams [N, hc*H], block_output [N, H], inject [N, hc]) -> streams + inject[:, s] * block_output
      on each stream s.
  combine_and_mix(streams, block_output, inject, norm_weight, down_weight, up_weight, hc_count, eps,
      down_scale=None, up_scale=None) -> (combine's new streams, then mix's block input and gates on them):
      a decoder layer's attention residual and its MoE block's mix (the kernels save combine's launch).
  naive.py   plain torch (the reference)
  triton.py  decode batches (up to MAX_TOKENS tokens): mix in two launches (the norm folded into the down
             projection; each row block's last program applies the streams' rms and the mixer's
             activations to its rows, or at one token every up program does; then the up projection,
             the gates and the mean over streams),
             combine in one (or folded into the next mix: combine_and_mix); every program reads one tile of weights with all its loads up front, by
             tl.dot from 16 tokens a program and as a GEMV (broadcast multiply + sum) below (MIX_TILES);
             INT8 words read packed and split in registers; the streams read in place (no copies)
"""

from tierlm.kernels.hyper_connection.naive import combine, combine_and_mix, mix

__all__ = ["combine", "combine_and_mix", "mix"]
