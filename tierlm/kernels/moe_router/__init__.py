"""The MoE router with the shared expert's gate: one GEMV over the packed router weight, softmax, top-k,
renormalisation and the gate's sigmoid.

Signature (every form): route_and_gate(x [N, H], weight [E + 1, H], top_k, renormalize) ->
(weights [N, k] in x's dtype, expert ids [N, k] int64, shared gate [N, 1] in x's dtype). weight holds the
router's E rows, then the shared expert gate's row (as `moe.SparseMoeBlock.router` packs them). The
math is transformers' (`Qwen4ExpTextTopKRouter`): logits = x W^T in x's dtype; probabilities = softmax
in fp32; the k largest, in descending order; divided by their sum when `renormalize` (norm_topk_prob);
cast to x's dtype. The gate is sigmoid(x w_gate) in x's dtype.

Ties: an exact tie at the k-th place is broken towards the lower expert id, which is the set CUDA's
torch.topk returns (it takes the values above the k-th, then equal ones in index order); torch.topk on
the CPU may take any of the tied experts, so `naive` (which calls it) is only defined up to that there.
  naive.py   F.linear, torch.softmax, torch.topk (the reference; what the CPU runs)
  triton.py  two launches for the batch: programs over (expert rows, K splits, token blocks) each store a
             partial of the logits; then a one-warp program per token sums them and does softmax, top-k,
             renormalisation and the gate
"""

from tierlm.kernels.moe_router.naive import route, route_and_gate

__all__ = ["route", "route_and_gate"]
