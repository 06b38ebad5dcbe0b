"""A Gated DeltaNet layer's decode step after its input projections, as Triton kernels (CUDA; the
interpreter on CPU for tests). Same signature, shapes and roundings as `decode.gated_delta_decode`, the
torch reference: conv window update, conv + SiLU (fp32 products and sum, rounded once), q/k l2norm, the
gates, the delta rule on the fp32 state (read once, written once, in place in the pool by slot), the
output and the gated RMS norm, for every request of the batch. The same kernels take T rows per request
(`triton_gated_delta_verify`, speculative verification; decode is T = 1): a program loops over its
request's rows with the state in registers and stores the state and conv window after each row into that
row's slot.

One program owns one request's value head: its state [Dk, Dv] in registers, its Dv value channels' conv
windows, its gate and output. The Hv / Hk value heads of a key head all read that key head's q and k, so
the q/k conv windows have several readers; a program may write only what no other program reads, and the
q/k windows are rewritten by a second, tiny launch after the first (`_key_window_kernel`). Padding rows
of static decode all point at one scratch slot: their programs race on its contents, which nobody reads.

Measured on an H200 at the target widths (bench/results/gdn_decode_kernel*_nvidia-h200.txt), this
layout beat one launch with one program per (request, key head) looping over its 3 value heads (that
program owns its q/k windows): 8.4 vs 15.3 us at batch 1, 13.6 vs 17.9 at 4, 36.8 vs 34.8 at 16; the
torch path took 94, 162 and 348 us. At batch 1 the 48 programs are fewer than the SMs; splitting Dv
would need the gated norm's sum of squares across programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.gated_delta_rule.decode import GATE_ACTIVATIONS, decode_head_counts

# the main kernel's warps: on an H200 at the target widths (bench/gdn_decode_kernel.py --sweep), 4 beat
# 2, 8 and 16 at batches 1, 4 and 16 (batch 1: 35.5 / 8.1 / 10.1 / 13.1 us), though ptxas keeps ~170
# bytes a thread on the stack at 4 (a [128, 128] fp32 state tile is 128 registers a thread)
DECODE_WARPS = 4


@triton.jit
def _short_conv(mixed_rows, mixed_stride, t, conv_slot, window_slot, weight, channels, inside, KC: tl.constexpr,
                KP: tl.constexpr, WRITE_WINDOW: tl.constexpr):
    """silu(causal conv) at a request's row t (mixed_rows: its row 0) for `channels` ([BD] ids), as fp32
    values of the model dtype, the products and their sum in fp32, rounded once (as the reference). Tap j
    reads row t - (Kc-1) + j, or before row 0 the slot's window (Kc-1 past inputs, oldest first). With
    WRITE_WINDOW the window after row t (its last Kc-1 inputs) goes to window_slot, after every thread
    has read (window_slot may be conv_slot)."""
    taps = tl.arange(0, KP)
    source = t - (KC - 1) + taps  # the row each tap reads; < 0: the slot's window
    from_rows = (source >= 0) & (taps < KC)
    x = tl.load(mixed_rows + source[None, :] * mixed_stride + channels[:, None],
                mask=inside[:, None] & from_rows[None, :], other=0.0)
    past = tl.load(conv_slot + channels[:, None] * (KC - 1) + (t + taps)[None, :],
                   mask=inside[:, None] & (source < 0)[None, :], other=0.0)
    window = tl.where(from_rows[None, :], x, past)  # [BD, KP]
    w = tl.load(weight + channels[:, None] * KC + taps[None, :], mask=inside[:, None] & (taps < KC)[None, :],
                other=0.0)
    conv = tl.sum(window.to(tl.float32) * w.to(tl.float32), 1).to(x.dtype).to(tl.float32)
    if WRITE_WINDOW:
        tl.debug_barrier()  # the window is read (by every thread holding a copy) before it is overwritten
        tl.store(window_slot + channels[:, None] * (KC - 1) + taps[None, :] - 1, window,
                 mask=inside[:, None] & (taps >= 1)[None, :] & (taps < KC)[None, :])
    return (conv / (1.0 + tl.exp(-conv))).to(x.dtype).to(tl.float32)


@triton.jit
def _decode_kernel(mixed, mixed_stride, z, z_stride, b, b_stride, a, a_stride, weight, A_log, dt_bias,
                   norm_weight, conv_pool, state_pool, slots, state_slots, out, eps,
                   HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, KC: tl.constexpr, KP: tl.constexpr, T: tl.constexpr,
                   SILU_GATE: tl.constexpr):
    """One program per (request, value head), over the request's T rows: everything but the q/k conv
    window updates."""
    request, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    key_head = head // (HV // HK)
    slot_stride = (2 * HK * DK + HV * DV) * (KC - 1)
    conv_slot = conv_pool + tl.load(slots + request).to(tl.int64) * slot_stride
    mixed_rows = mixed + request * T * mixed_stride
    dk, dv = tl.arange(0, BK), tl.arange(0, BV)
    k_inside, v_inside = dk < DK, dv < DV
    state_offsets = head * DK * DV + dk[:, None] * DV + dv[None, :]
    state_mask = k_inside[:, None] & v_inside[None, :]
    state = tl.load(state_pool + tl.load(slots + request).to(tl.int64) * HV * DK * DV + state_offsets,
                    mask=state_mask, other=0.0)
    decay_rate = -tl.exp(tl.load(A_log + head).to(tl.float32))
    bias = tl.load(dt_bias + head).to(tl.float32)
    model_dtype = out.dtype.element_ty
    for t in tl.static_range(T):  # unrolled: T = 1 is the plain decode step
        row = request * T + t
        target = tl.load(state_slots + row).to(tl.int64)  # the slot that keeps the state after this row
        q = _short_conv(mixed_rows, mixed_stride, t, conv_slot, conv_slot, weight, key_head * DK + dk, k_inside,
                        KC, KP, False)
        k = _short_conv(mixed_rows, mixed_stride, t, conv_slot, conv_slot, weight, (HK + key_head) * DK + dk,
                        k_inside, KC, KP, False)
        v = _short_conv(mixed_rows, mixed_stride, t, conv_slot, conv_pool + target * slot_stride, weight,
                        2 * HK * DK + head * DV + dv, v_inside, KC, KP, True)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (DK ** -0.5)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)

        b_in = tl.load(b + row * b_stride + head)
        beta = (1.0 / (1.0 + tl.exp(-b_in.to(tl.float32)))).to(b_in.dtype).to(tl.float32)
        x = tl.load(a + row * a_stride + head).to(tl.float32) + bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        g = decay_rate * softplus

        # S' = e^g S + k u^T with u = beta (v - e^g S^T k), and o = S'^T q = e^g S^T q + (k.q) u: both
        # products with S in one pass over it, S' formed as it is stored
        decay = tl.exp(g)
        update = (v - decay * tl.sum(k[:, None] * state, 0)) * beta
        o = decay * tl.sum(q[:, None] * state, 0) + tl.sum(k * q, 0) * update
        state = decay * state + k[:, None] * update[None, :]
        tl.store(state_pool + target * HV * DK * DV + state_offsets, state, mask=state_mask)

        o = o.to(model_dtype).to(tl.float32)
        normed = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(model_dtype).to(tl.float32)
        y = (normed * tl.load(norm_weight + dv, mask=v_inside, other=0.0).to(tl.float32)).to(model_dtype)
        gate = tl.load(z + row * z_stride + head * DV + dv, mask=v_inside, other=0.0).to(tl.float32)
        if SILU_GATE:
            gate = gate / (1.0 + tl.exp(-gate))
        else:
            gate = 1.0 / (1.0 + tl.exp(-gate))
        tl.store(out + row * HV * DV + head * DV + dv, (y.to(tl.float32) * gate).to(model_dtype), mask=v_inside)


@triton.jit
def _key_window_kernel(mixed, mixed_stride, weight, conv_pool, slots, state_slots, HK: tl.constexpr,
                       HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
                       KP: tl.constexpr, T: tl.constexpr):
    """One program per (request, q or k, key head): that head's q or k conv window after each of the
    request's T rows, into the row's state slot."""
    request, which, key_head = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    slot_stride = (2 * HK * DK + HV * DV) * (KC - 1)
    conv_slot = conv_pool + tl.load(slots + request).to(tl.int64) * slot_stride
    dk = tl.arange(0, BK)
    for t in tl.static_range(T):  # unrolled: T = 1 is the plain decode step
        target = tl.load(state_slots + request * T + t).to(tl.int64)
        _short_conv(mixed + request * T * mixed_stride, mixed_stride, t, conv_slot, conv_pool + target * slot_stride,
                    weight, (which * HK + key_head) * DK + dk, dk < DK, KC, KP, True)


def _row_major(name: str, x: torch.Tensor, rows: int, columns: int) -> None:
    if x.dim() != 2 or x.shape != (rows, columns) or x.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, {columns}] with unit column stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")


def triton_gated_delta_decode(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    eps: float,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """As `decode.gated_delta_decode` (shapes there), in two launches; the pools are updated in place."""
    return triton_gated_delta_verify(mixed, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool,
                                     slots, slots[:, None], eps, gate_activation)


def triton_gated_delta_verify(
    mixed: torch.Tensor,
    z: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    state_slots: torch.Tensor,
    eps: float,
    gate_activation: str = "silu",
) -> torch.Tensor:
    """As `decode.gated_delta_verify` (T rows per request, the state after each into state_slots [B, T]),
    in two launches; the pools are updated in place."""
    num_key_heads, num_value_heads, head_k_dim, head_v_dim = decode_head_counts(mixed, state_pool)
    n, channels = mixed.shape
    requests, width = state_slots.shape
    kernel = conv_weight.shape[-1]
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError(f"the state pool must be contiguous fp32, got {state_pool.dtype}")
    if conv_pool.shape[1:] != (channels, kernel - 1) or not conv_pool.is_contiguous():
        raise ValueError(f"conv pool {tuple(conv_pool.shape)} is not a contiguous [S, {channels}, {kernel - 1}]")
    if gate_activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gate activation {gate_activation!r}: choose one of {sorted(GATE_ACTIVATIONS)}")
    if n != requests * width or slots.shape != (requests,):
        raise ValueError(f"{n} rows do not make {requests} requests x {width} (state_slots {tuple(state_slots.shape)},"
                         f" slots {tuple(slots.shape)})")
    for name, x, columns in (("mixed", mixed, channels), ("z", z, num_value_heads * head_v_dim),
                             ("b", b, num_value_heads), ("a", a, num_value_heads)):
        _row_major(name, x, n, columns)
    out = torch.empty(n, num_value_heads * head_v_dim, dtype=mixed.dtype, device=mixed.device)
    if n == 0:
        return out
    conv_weight = conv_weight.reshape(channels, kernel).contiguous()
    slots, state_slots = slots.contiguous(), state_slots.contiguous()
    shapes = {"HK": num_key_heads, "HV": num_value_heads, "DK": head_k_dim, "DV": head_v_dim,
              "BK": triton.next_power_of_2(head_k_dim), "KC": kernel, "KP": triton.next_power_of_2(kernel),
              "T": width}
    _decode_kernel[(requests, num_value_heads)](
        mixed, mixed.stride(0), z, z.stride(0), b, b.stride(0), a, a.stride(0), conv_weight, A_log, dt_bias,
        norm_weight, conv_pool, state_pool, slots, state_slots, out, eps, BV=triton.next_power_of_2(head_v_dim),
        SILU_GATE=gate_activation == "silu", **shapes, num_warps=DECODE_WARPS,
    )
    _key_window_kernel[(requests, 2, num_key_heads)](mixed, mixed.stride(0), conv_weight, conv_pool, slots,
                                                      state_slots, **shapes, num_warps=1)
    return out
