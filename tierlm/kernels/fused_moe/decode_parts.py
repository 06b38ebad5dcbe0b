"""Pieces the two decode forms of `fused_moe` share (`triton._decode` and `packed_decode`): `SharedArgs`,
a checked `SharedExpert` as both forms' launches take it (its tensors; `SharedShape`, what its
compile-time constants depend on, hashable so the forms cache their launch constants by it); `round_as`.
Then, for the unquantized / INT6 form: one expert's SwiGLU columns and down columns for one row of input, by
`quant_linear.triton.gemv_loop` in any weight format (down's first tiles optionally before the program's
wait: `early_weights`); the order a down program takes a token's experts in
(`expert_ranks`); and the end of a down program whose token's experts are split over several programs
(the last to arrive adds the splits' fp32 partials in split order and rounds the output once:
`split_reduce` arrival counters), in the same launch.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import wait_for_inputs
from tierlm.kernels.fused_moe.naive import SharedExpert, check_shared_args
from tierlm.kernels.quant_linear.triton import (
    check_whole_word_groups,
    gemv_loop,
    gemv_steps,
    gemv_sum,
    gemv_tiles_ahead,
    gemv_zeros,
    quant_linear,
    round_to,
)


@triton.jit
def expert_ranks(ids_ptr, token, TOP_K: tl.constexpr, SLOTS: tl.constexpr):
    """A token's top-k slots (SLOTS: TOP_K rounded up to a power of 2), which of them are real (< TOP_K),
    and each slot's expert's rank among the token's by ascending id (the ids are distinct): the order a down
    program sums its experts in."""
    slots = tl.arange(0, SLOTS)
    valid = slots < TOP_K
    ids = tl.load(ids_ptr + token * TOP_K + slots, mask=valid, other=0)
    rank = tl.sum(((ids[None, :] < ids[:, None]) & valid[None, :]).to(tl.int32), axis=1)
    return slots, valid, rank


@triton.jit
def swiglu_columns(x_ptr, x_row, w_ptr, s_ptr, width, offs_n, stride_wn, stride_sn, K, BITS: tl.constexpr,
                   GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """silu(x W[n]) * (x W[width + n]) in fp32, [1, BLOCK_N], for columns offs_n of one expert's gate_up
    (W: `width` gate rows then `width` up rows over K inputs, at w_ptr / its scales at s_ptr) and one row
    of x (int64 offset x_row from x_ptr); columns past `width` are garbage (callers mask the store)."""
    n_mask = offs_n < width
    x_rows = x_row + tl.zeros((1,), dtype=tl.int64)
    one_row = tl.full((1,), 1, tl.int1)
    gate = gemv_loop(gemv_zeros(1, BLOCK_N, BLOCK_K, BITS), x_ptr, x_rows, one_row, w_ptr, s_ptr, 0, K, offs_n, n_mask,
                     stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K, PRECISION)
    up = gemv_loop(gemv_zeros(1, BLOCK_N, BLOCK_K, BITS), x_ptr, x_rows, one_row, w_ptr + width * stride_wn,
                   s_ptr + width * stride_sn, 0, K, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K,
                   EVEN_K, PRECISION)
    gate_sum, up_sum = gemv_sum(gate, BITS), gemv_sum(up, BITS)
    return gate_sum / (1.0 + tl.exp(-gate_sum)) * up_sum


@triton.jit
def down_columns(act_ptr, act_row, w_ptr, s_ptr, offs_n, n_mask, stride_wn, stride_sn, K, BITS: tl.constexpr,
                 GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr, UP_FRONT: tl.constexpr, PDL: tl.constexpr):
    """act's row (int64 offset act_row) times the down rows offs_n (masked by n_mask) over K inputs, in
    fp32, [BLOCK_N]. UP_FRONT > 0 (at most K's tiles): the program has not waited for its inputs yet; the
    first UP_FRONT tiles of weights are loaded, then it waits (`wait_for_inputs`), then reads act."""
    act_rows, one_row = act_row + tl.zeros((1,), dtype=tl.int64), tl.full((1,), 1, tl.int1)
    acc = gemv_zeros(1, BLOCK_N, BLOCK_K, BITS)
    if UP_FRONT > 0:
        tiles = gemv_tiles_ahead(w_ptr, s_ptr, 0, offs_n, n_mask, stride_wn, stride_sn, K, BITS, GROUP_SIZE, BLOCK_K,
                                 EVEN_K, act_ptr.dtype.element_ty, PRECISION, UP_FRONT)
        wait_for_inputs(PDL)
        acc = gemv_steps(acc, tiles, act_ptr, act_rows, one_row, 0, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K, UP_FRONT)
    acc = gemv_loop(acc, act_ptr, act_rows, one_row, w_ptr, s_ptr, UP_FRONT * BLOCK_K, K, offs_n, n_mask, stride_wn,
                    stride_sn, K, BITS, GROUP_SIZE, BLOCK_K, EVEN_K, PRECISION)
    return tl.reshape(gemv_sum(acc, BITS), (BLOCK_N,))


@triton.jit
def finish_down(result, out_ptr, partial_ptr, counter_ptr, token, pid_n, n_blocks, split, offs_n, n_mask, H,
                SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    """A down program's end: result [BLOCK_N] (fp32) is split `split` of SPLITS of token's output
    columns offs_n (column block pid_n of n_blocks). One split: out[token] rounded to out's dtype. Several: stored in fp32 at
    partial[token * SPLITS + split], then the program counts itself in (one counter per token and column
    block, `split_reduce.arrival_counters`); the last to arrive adds the splits in order, rounds
    out[token] once and sets the counter back to zero."""
    if SPLITS == 1:
        tl.store(out_ptr + token * H + offs_n, round_to(result, out_ptr.dtype.element_ty, PRECISION), mask=n_mask)
    else:
        tl.store(partial_ptr + (token * SPLITS + split) * H + offs_n, result, mask=n_mask)
        counter = counter_ptr + token * n_blocks + pid_n
        tl.debug_barrier()  # every thread's stores are issued before the program counts itself in
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            total = tl.zeros_like(result)
            for s in tl.static_range(SPLITS):
                total += tl.load(partial_ptr + (token * SPLITS + s) * H + offs_n, mask=n_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + token * H + offs_n, round_to(total, out_ptr.dtype.element_ty, PRECISION), mask=n_mask)
            tl.atomic_xchg(counter, 0)  # ready for the next launch


def early_weights() -> bool:
    """Whether a decode form's routed items load their expert's first weights before they wait for their
    inputs (`packed_decode`'s "Early weights", and the unquantized / INT6 form's down items); with
    TIERLM_NO_EARLY_EXPERT_WEIGHTS=1 they wait first, as every other kernel."""
    return not os.environ.get("TIERLM_NO_EARLY_EXPERT_WEIGHTS")


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}  # `round_as`'s DTYPE


@triton.jit
def round_as(x, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 x rounded to x's dtype (`DTYPE_NAMES`: "bf16", "fp16" or "fp32"), kept in fp32."""
    if DTYPE == "bf16":
        x = round_to(x, tl.bfloat16, PRECISION).to(tl.float32)
    elif DTYPE == "fp16":
        x = round_to(x, tl.float16, PRECISION).to(tl.float32)
    return x


class SharedShape(NamedTuple):
    """What the decode launches' shapes and constants take of a shared expert (hashable: the decode forms
    cache their launch constants by it); present 0: none."""
    present: int  # 1 or 0 (the kernels' HAS_SHARED)
    bits: int  # 0 when unquantized
    width: int  # S
    gate_up_group: int
    down_group: int

    def constants(self, gate_up_block_k: int, down_block_k: int, h: int) -> dict:
        """The decode kernels' compile-time constants for it: its format, groups and K tiles (at most the
        given ones, and whether H and S are whole numbers of them); fixed stand-ins without a shared
        expert (no extra compiled variants)."""
        gate_up_k, down_k = 16, 16
        if self.present:
            gate_up_k, down_k = (min(block, triton.next_power_of_2(k)) for block, k in
                                 ((gate_up_block_k, h), (down_block_k, self.width)))
        return {"HAS_SHARED": self.present, "SHARED_BITS": self.bits, "GU_SHARED_GROUP_SIZE": self.gate_up_group,
                "GU_SHARED_BLOCK_K": gate_up_k, "GU_SHARED_EVEN_K": not self.present or h % gate_up_k == 0,
                "DN_SHARED_GROUP_SIZE": self.down_group, "DN_SHARED_BLOCK_K": down_k,
                "DN_SHARED_EVEN_K": not self.present or self.width % down_k == 0}


class SharedArgs(NamedTuple):
    """A `SharedExpert` checked, as the decode launches take it: tensors contiguous, gate flat [T],
    bits 0 when unquantized (then the scales are the weights: unused). Without one (present 0) every
    tensor is a stand-in (x) the kernels never read."""
    present: int  # 1 or 0 (the kernels' HAS_SHARED)
    gate: torch.Tensor
    w_gate_up: torch.Tensor
    gate_up_scales: torch.Tensor
    w_down: torch.Tensor
    down_scales: torch.Tensor
    bits: int
    width: int  # S
    gate_up_group: int
    down_group: int

    @classmethod
    def of(cls, x: torch.Tensor, shared: SharedExpert | None) -> SharedArgs:
        if shared is None:
            return cls(0, x, x, x, x, x, 0, 0, 0, 0)
        bits, width, gate_up_group, down_group = check_shared_args(x, shared)
        for group in (gate_up_group, down_group):
            check_whole_word_groups(bits, group)
        w_gate_up, w_down = shared.w_gate_up.contiguous(), shared.w_down.contiguous()
        gate_up_scales, down_scales = (w_gate_up, w_down) if bits is None else (s.contiguous() for s in shared.scales)
        return cls(1, shared.gate.reshape(-1).contiguous(), w_gate_up, gate_up_scales, w_down, down_scales, bits or 0,
                   width, gate_up_group, down_group)

    @property
    def shape(self) -> SharedShape:
        return SharedShape(self.present, self.bits, self.width, self.gate_up_group, self.down_group)

    def separately(self, x: torch.Tensor) -> torch.Tensor:
        """gate x the shared expert's SwiGLU through `quant_linear` launches (a GEMM for prefill rows), in
        x's dtype step by step, as the model's layers compute it."""
        def linear(a, w, scales, group):
            if not self.bits:
                return quant_linear(a, w)
            return quant_linear(a, w, scales=scales, bits=self.bits, group_size=group)

        gate, up = linear(x, self.w_gate_up, self.gate_up_scales, self.gate_up_group).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, self.w_down, self.down_scales, self.down_group)
        return self.gate[:, None].to(x.dtype) * y
