"""A Gated DeltaNet layer's decode step after its input projections, as one Triton kernel (CUDA; the
interpreter on CPU for tests). Same signature, shapes and roundings as `decode.gated_delta_decode`, the
torch reference: conv window update, conv + SiLU (fp32 products and sum, rounded once), q/k l2norm, the
gates, the delta rule on the fp32 state (read once, written once, in place in the pool by slot), the
output and the gated RMS norm, for every request of the batch. The same kernel takes T rows per request
(`triton_gated_delta_verify`, speculative verification; decode is T = 1): a program loops over its
request's rows with its state tile in registers and stores the tile and conv window after each row into
that row's slot.

The grid: one program per (request, value head, tile of VALUE_TILE value channels), as flash-linear-
attention's fused_recurrent splits the value dim. A program holds its [Dk, tile] slice of the state, the
conv windows of its tile's v channels, and recomputes its key head's q and k in full (a few KB, L2 hits
after the first). The delta rule is independent per value column (S^T k and S^T q sum over the key dim
only), so the state splits along values with no communication; two things do not:
  - the gated RMS norm averages o over the whole head (Dv channels, several tiles);
  - a key head's q/k conv windows are read by all its Hv/Hk x tiles programs and must be rewritten only
    after every one of them has read them.
Both go to the last program to finish among a key head's Hv/Hk x tiles programs. Each program stores its
o tile (rounded to the model dtype, as the reference rounds it before the norm) straight into `out`, then
increments the (request, key head) arrival counter; the program that sees it reach the count reads the
group's o back (from L2), applies the norm and the gate in place, writes the q/k windows after each row,
and sets the counter back to zero. There is no waiting: nobody spins, so the scheme holds whatever number
of programs is resident, and the sum of squares is taken by one program in a fixed order (deterministic).
The counters are `split_reduce.arrival_counters`: a zeroed int32 workspace per device kept for the
process's life (each launch leaves it zeroed); launches of this kernel on one device must not run concurrently (one
stream, as the engine runs them). Padding rows of static decode all point at one scratch slot: their
programs race on its contents, which nobody reads (their counters are their own).

Why: at the target widths (16 key / 48 value heads of 128, a 3 MB fp32 state per request) the previous
layout, one program per (request, value head), ran 48 programs at batch 1 on 132 SMs, each holding a
[128, 128] fp32 tile, plus a second launch for the q/k windows. The bench timed it at 8.1 us at batch 1
(H200, commit e8cb6ab); the model's kernel listing at f26380f shows 41 us per layer. Compiled for sm_90a
on a CPU (Triton 3.9's ptxas, cuobjdump --dump-resource-usage, pointers 16-byte aligned), f26380f's
kernel at 4 warps uses 255 registers and 808 bytes of stack a thread and moves its whole state tile
through 16 KB of shared memory (its [BD, 4] conv windows anchored a second layout for the tile), where
the same kernel before speculative verification (47aba87) needed no stack. This kernel at tile 32 and 4
warps: 80 registers, no stack, no tile through shared memory (`_conv_silu`: 1-D taps).

Launched with programmatic dependent launch (`kernels/dependent_launch`): a program loads its weights (the
conv taps of its q, k and v channels, as 1-D vectors: `_conv_taps`; its head's A_log and dt_bias) before
it waits for the kernel before it, and so are its slot and its state tile: no kernel of a step but this
one writes the recurrent state (each program its own tile, after its wait; resets, restores and
rollbacks are copies made before the step's chain begins), and the slots are the step's staged inputs (a
speculative step's `finish_step` rewrites them for the next replay). The conv windows and the inputs are
loaded after the wait. Two dependent round trips (the slot, then the 16 KB state tile) leave the path
after the wait: H100, the 4-layer bf16 stack, one process a tree
(bench/results/decode_roofline_nvidia-h100_s22.txt), one stream 1,009.4 -> 1,013.3 tok/s at ctx 512 and
985.3 -> 991.8 at 8192, four streams unchanged. Compiled for sm_90 (triton 3.6, real widths, tile 32,
2 warps): 166 registers at T = 1 and 242 at T = 3, no spills (155 and 241 before, when each row's conv
loaded its taps again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tierlm.kernels.dependent_launch import allow_dependents, launch_options, wait_for_inputs
from tierlm.kernels.gated_delta_rule.decode import GATE_ACTIVATIONS, decode_head_counts
from tierlm.kernels.split_reduce import arrival_counters

# value channels per program (a power of 2; heads narrower than it take one tile) and the kernel's warps:
# tuned on the GPU with bench/gdn_decode_kernel.py --tiles ... --warps ... (H200, real widths, state not in L2:
# tile 32 x 2 warps 8.1 / 13.0 / 40.4 us at batch 1 / 4 / 16, the best or within 6% of it at each batch)
VALUE_TILE = 32
DECODE_WARPS = 2


@triton.jit
def _conv_window(mixed_rows, mixed_stride, t, conv_slot, channels, inside, KC: tl.constexpr, KP: tl.constexpr):
    """The conv inputs of `channels` ([BD] ids) at a request's row t (mixed_rows: its row 0), [BD, KP] in
    the model dtype: tap j is the input at row t - (Kc-1) + j, or, before row 0, the slot's window (Kc-1
    past inputs, oldest first); taps >= Kc are 0. Only copied into a slot (`_store_window`)."""
    taps = tl.arange(0, KP)
    source = t - (KC - 1) + taps  # the row each tap reads; < 0: the slot's window
    from_rows = (source >= 0) & (taps < KC)
    x = tl.load(mixed_rows + source[None, :] * mixed_stride + channels[:, None],
                mask=inside[:, None] & from_rows[None, :], other=0.0)
    past = tl.load(conv_slot + channels[:, None] * (KC - 1) + (t + taps)[None, :],
                   mask=inside[:, None] & (source < 0)[None, :], other=0.0)
    return tl.where(from_rows[None, :], x, past)


@triton.jit
def _conv_taps(weight, channels, inside, KC: tl.constexpr):
    """The conv weights of `channels` ([BD] ids), a tuple of Kc [BD] vectors (tap j: weight[:, j])."""
    taps = ()
    for j in tl.static_range(KC):
        taps += (tl.load(weight + channels * KC + j, mask=inside, other=0.0),)
    return taps


@triton.jit
def _conv_silu(mixed_rows, mixed_stride, t: tl.constexpr, conv_slot, taps, channels, inside, KC: tl.constexpr):
    """silu(causal conv) of `channels` ([BD] ids, their weights `taps` from `_conv_taps`) at a request's row
    t, as fp32 values of the model dtype: the products and their sum in fp32, rounded once (as the
    reference), then SiLU, rounded. Tap by tap, [BD] vectors only: small 1-D loads never anchor a layout,
    so the compiler lays these values out to suit the state tile they multiply (a [BD, KP] window here
    once made it move the whole tile through shared memory instead)."""
    conv = tl.zeros(channels.shape, dtype=tl.float32)
    for j in tl.static_range(KC):
        if t - (KC - 1) + j >= 0:  # a row of this call
            x = tl.load(mixed_rows + (t - (KC - 1) + j) * mixed_stride + channels, mask=inside, other=0.0)
        else:  # before row 0: the slot's window
            x = tl.load(conv_slot + channels * (KC - 1) + t + j, mask=inside, other=0.0)
        conv += x.to(tl.float32) * taps[j].to(tl.float32)
    conv = conv.to(x.dtype).to(tl.float32)
    return (conv / (1.0 + tl.exp(-conv))).to(x.dtype).to(tl.float32)


@triton.jit
def _store_window(window_slot, window, channels, inside, KC: tl.constexpr, KP: tl.constexpr):
    """The window after a `_conv_window`'s row (its last Kc-1 taps) into window_slot. Call it after a
    barrier: another thread may still read the old window there."""
    taps = tl.arange(0, KP)
    tl.store(window_slot + channels[:, None] * (KC - 1) + taps[None, :] - 1, window,
             mask=inside[:, None] & (taps >= 1)[None, :] & (taps < KC)[None, :])


@triton.jit
def _finish_key_head(mixed_rows, mixed_stride, z, z_stride, norm_weight, conv_pool, conv_slot, slot_stride,
                     state_slots, out, eps, request, key_head, HK: tl.constexpr, HV: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, GP: tl.constexpr,
                     KC: tl.constexpr, KP: tl.constexpr, T: tl.constexpr, SILU_GATE: tl.constexpr):
    """A key head's work once all its programs have stored their o tiles and read its q/k windows: per
    row, the q and k conv windows after the row into the row's slot, and the gated RMS norm of the key
    head's Hv/Hk value heads ([GP, BH] at once: one round trip to L2), in place in `out`."""
    c, d, h = tl.arange(0, 2 * BK), tl.arange(0, BH), tl.arange(0, GP)
    # the key head's q channels, then its k channels (one window tile: one round trip, not two)
    qk_channels = tl.where(c < BK, key_head * DK + c, (HK + key_head) * DK + c - BK)
    qk_inside = c % BK < DK
    heads_inside = (h < HV // HK)[:, None] & (d < DV)[None, :]
    columns = (key_head * (HV // HK) + h)[:, None] * DV + d[None, :]  # the group's heads' channels
    weight = tl.load(norm_weight + d, mask=d < DV, other=0.0).to(tl.float32)
    model_dtype = out.dtype.element_ty
    for t in tl.static_range(T):
        row = request * T + t
        # o was written by other programs: read from L2 (.cg), past this SM's L1
        o = tl.load(out + row * HV * DV + columns, mask=heads_inside, other=0.0, cache_modifier=".cg")
        gate = tl.load(z + row * z_stride + columns, mask=heads_inside, other=0.0).to(tl.float32)
        window_slot = conv_pool + tl.load(state_slots + row).to(tl.int64) * slot_stride
        window = _conv_window(mixed_rows, mixed_stride, t, conv_slot, qk_channels, qk_inside, KC, KP)
        tl.debug_barrier()  # the last row's window_slot is conv_slot: read before overwritten
        _store_window(window_slot, window, qk_channels, qk_inside, KC, KP)
        o = o.to(tl.float32)
        normed = (o * tl.rsqrt(tl.sum(o * o, 1) / DV + eps)[:, None]).to(model_dtype).to(tl.float32)
        y = (normed * weight[None, :]).to(model_dtype).to(tl.float32)
        if SILU_GATE:
            gate = gate / (1.0 + tl.exp(-gate))
        else:
            gate = 1.0 / (1.0 + tl.exp(-gate))
        tl.store(out + row * HV * DV + columns, (y * gate).to(model_dtype), mask=heads_inside)


@triton.jit
def _decode_kernel(mixed, mixed_stride, z, z_stride, b, b_stride, a, a_stride, weight, A_log, dt_bias,
                   norm_weight, conv_pool, state_pool, slots, state_slots, out, arrivals, eps,
                   HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, NV: tl.constexpr, BH: tl.constexpr, GP: tl.constexpr, KC: tl.constexpr,
                   KP: tl.constexpr, T: tl.constexpr, EVEN: tl.constexpr, SILU_GATE: tl.constexpr,
                   PDL: tl.constexpr):
    """One program per (value head x NV tiles of BV channels, request), over the request's T rows; the
    last of a key head's programs to finish also runs `_finish_key_head`. EVEN: Dk = BK and BV divides Dv
    (the state tile needs no mask). PDL: its weights (the conv taps of its q, k and v channels, A_log and
    dt_bias of its head), its slot and its state tile are loaded before `wait_for_inputs` (module
    docstring); the norm weight, read only by the finishing program, after it."""
    allow_dependents(PDL)
    head_tile, request = tl.program_id(0), tl.program_id(1).to(tl.int64)
    head, tile = head_tile // NV, head_tile % NV
    key_head = head // (HV // HK)
    slot_stride = (2 * HK * DK + HV * DV) * (KC - 1)
    dk, dv = tl.arange(0, BK), tile * BV + tl.arange(0, BV)
    k_inside, v_inside = dk < DK, dv < DV
    q_channels, k_channels, v_channels = key_head * DK + dk, (HK + key_head) * DK + dk, 2 * HK * DK + dv + head * DV
    q_taps = _conv_taps(weight, q_channels, k_inside, KC)
    k_taps = _conv_taps(weight, k_channels, k_inside, KC)
    v_taps = _conv_taps(weight, v_channels, v_inside, KC)
    decay_rate = -tl.exp(tl.load(A_log + head).to(tl.float32))
    bias = tl.load(dt_bias + head).to(tl.float32)
    # the request's slot and its state tile: only this kernel writes the state (each program its own tile,
    # after its wait), and the slots are the step's staged inputs, so both load before the wait
    slot = tl.load(slots + request).to(tl.int64)
    state_offsets = head * DK * DV + dk[:, None] * DV + dv[None, :]
    state_mask = k_inside[:, None] & v_inside[None, :]
    if EVEN:  # unmasked: 16-byte loads and stores
        state = tl.load(state_pool + slot * HV * DK * DV + state_offsets)
    else:
        state = tl.load(state_pool + slot * HV * DK * DV + state_offsets, mask=state_mask, other=0.0)
    wait_for_inputs(PDL)
    conv_slot = conv_pool + slot * slot_stride
    mixed_rows = mixed + request * T * mixed_stride
    model_dtype = out.dtype.element_ty
    # ptxas would issue the state tile's loads only after the first conv's taps arrive (two memory
    # latencies in a row); it keeps loads on their side of a barrier, which waits for none of them. (With
    # PDL the wait already does: sm_90, triton 3.6, the same 51 loads before it with or without this
    # barrier; it is kept for PDL off, where the wait is no instruction.)
    tl.debug_barrier()
    for t in tl.static_range(T):  # unrolled: T = 1 is the plain decode step
        row = request * T + t
        target = tl.load(state_slots + row).to(tl.int64)  # the slot that keeps the state after this row
        q = _conv_silu(mixed_rows, mixed_stride, t, conv_slot, q_taps, q_channels, k_inside, KC)
        k = _conv_silu(mixed_rows, mixed_stride, t, conv_slot, k_taps, k_channels, k_inside, KC)
        v = _conv_silu(mixed_rows, mixed_stride, t, conv_slot, v_taps, v_channels, v_inside, KC)
        v_window = _conv_window(mixed_rows, mixed_stride, t, conv_slot, v_channels, v_inside, KC, KP)
        tl.debug_barrier()  # this tile's v window is read (by every thread holding a copy) before overwritten
        _store_window(conv_pool + target * slot_stride, v_window, v_channels, v_inside, KC, KP)
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
        if EVEN:
            tl.store(state_pool + target * HV * DK * DV + state_offsets, state)
        else:
            tl.store(state_pool + target * HV * DK * DV + state_offsets, state, mask=state_mask)
        # o rounded (as the reference before its norm); `_finish_key_head` normalises it in place
        tl.store(out + row * HV * DV + head * DV + dv, o.to(model_dtype), mask=v_inside)

    # every thread's stores and q/k window reads are done before one thread releases them at GPU scope
    tl.debug_barrier()
    counter = arrivals + request * HK + key_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == (HV // HK) * NV - 1:  # the last: acquires
        tl.debug_barrier()  # (the atomic's result reaches the other threads through a barrier already)
        _finish_key_head(mixed_rows, mixed_stride, z, z_stride, norm_weight, conv_pool, conv_slot, slot_stride,
                         state_slots, out, eps, request, key_head, HK, HV, DK, DV, BK, BH, GP, KC, KP, T,
                         SILU_GATE)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


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
    """As `decode.gated_delta_decode` (shapes there), in one launch; the pools are updated in place."""
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
    in one launch; the pools are updated in place."""
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
    if VALUE_TILE < 1 or VALUE_TILE & (VALUE_TILE - 1):
        raise ValueError(f"VALUE_TILE must be a power of 2, got {VALUE_TILE}")
    for name, x, columns in (("mixed", mixed, channels), ("z", z, num_value_heads * head_v_dim),
                             ("b", b, num_value_heads), ("a", a, num_value_heads)):
        _row_major(name, x, n, columns)
    out = torch.empty(n, num_value_heads * head_v_dim, dtype=mixed.dtype, device=mixed.device)
    if n == 0:
        return out
    conv_weight = conv_weight.reshape(channels, kernel).contiguous()
    slots, state_slots = slots.contiguous(), state_slots.contiguous()
    head_block = triton.next_power_of_2(head_v_dim)
    tile = min(VALUE_TILE, head_block)
    tiles = triton.cdiv(head_v_dim, tile)
    arrivals = arrival_counters("gated_delta_rule_decode", mixed.device, requests * num_key_heads)
    _decode_kernel[(num_value_heads * tiles, requests)](
        mixed, mixed.stride(0), z, z.stride(0), b, b.stride(0), a, a.stride(0), conv_weight, A_log, dt_bias,
        norm_weight, conv_pool, state_pool, slots, state_slots, out, arrivals, eps,
        HK=num_key_heads, HV=num_value_heads, DK=head_k_dim, DV=head_v_dim, BK=triton.next_power_of_2(head_k_dim),
        BV=tile, NV=tiles, BH=head_block, GP=triton.next_power_of_2(num_value_heads // num_key_heads),
        KC=kernel, KP=triton.next_power_of_2(kernel), T=width,
        EVEN=head_k_dim == triton.next_power_of_2(head_k_dim) and head_v_dim % tile == 0,
        SILU_GATE=gate_activation == "silu",
        num_warps=DECODE_WARPS, **launch_options(mixed.device),
    )
    return out
