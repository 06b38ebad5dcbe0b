"""A Gated DeltaNet layer's decode step as Triton kernels (`decode_triton`) against its torch reference with
the same signature (`decode.gated_delta_decode`, the layer's path on CPU), under TRITON_INTERPRET=1 on CPU
at small shapes and compiled on a GPU at the target model's widths.

fp32: the two forms differ only by fp32 summation order (relative RMS < 1e-5 on the output and the states;
the conv windows are copies, equal). bf16: transformers' own decode step (its causal_conv1d_update,
recurrent rule and gated norm) run in fp32 is the truth, and the kernel's error per request must stay
within FACTOR x transformers' bf16 error on the same input plus half a bf16 ulp of the row's largest value
(tests/test_bf16_parity.py's bound), for the output row and the request's new state. Static decode's
padding rows (all on one scratch slot) are in every batch: they must leave every other slot as it was.

The kernel splits each value head into tiles of VALUE_TILE channels (one program each) and finishes a key
head's gated norms and q/k windows in whichever of its programs arrives last: the small cases run at
tiles that split their heads (TILES: two tiles, the second half empty, and two full ones; the layer test
one tile), the real widths at the module's default, and every check ends with the arrival counters back
at zero. The interpreter runs programs one after another; on a GPU, where they race, the same launch
repeated must give the same bits.

Triton's interpreter (3.9) truncates fp32 -> bf16 casts where the GPU rounds to nearest even; the child
processes patch it to round as the GPU does (`round_bf16_like_the_gpu`), so the kernel's roundings are
checked, not the interpreter's.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from interpreted import on_cuda_else_interpreted, run_interpreted

FACTOR = 2.0
# (key heads, value heads, Dk, Dv, conv kernel, real requests, padding rows); small ones run interpreted
SMALL = {"grouped": (2, 6, 16, 24, 4, 3, 2), "one_group_sigmoid": (2, 2, 32, 16, 4, 2, 1)}
REAL_WIDTHS = (16, 48, 128, 128, 4)  # the target model's GDN
GPU_BATCHES = {1: 0, 4: 1, 16: 5}  # batch size: padding rows among them
# the value tile each small case runs at: Dv 24 in 2 tiles (the second half empty), Dv 16 in 2 (the layer test: 1)
TILES = {"grouped": 16, "one_group_sigmoid": 8, "k1": 16, "k3_sigmoid": 8}


def round_bf16_like_the_gpu() -> None:
    """Make the interpreter's fp32 -> bf16 casts round to nearest even, as the GPU's do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float

    def rounded(values, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            x = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(-1).copy())
            return x.bfloat16().view(torch.int16).numpy().view(np.uint16).reshape(np.shape(values))
        return convert(values, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = rounded


def workload(hk, hv, dk, dv, kc, real, padding, dtype, device, seed=0, gate="silu"):
    """The in_proj outputs of a batch (real requests, then padding rows on the scratch slot), the layer's
    parameters and a cache with random contents, as the model would hold them in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    channels, n = 2 * hk * dk + hv * dv, real + padding
    proj = torch.randn(n, channels + hv * dv + 2 * hv, generator=gen)
    params = {
        "conv_weight": torch.randn(channels, kc, generator=gen) * 0.4,
        "A_log": torch.rand(hv, generator=gen).mul(15).add(0.01).log(),
        "dt_bias": torch.randn(hv, generator=gen),
        "norm_weight": 1 + 0.1 * torch.randn(dv, generator=gen),
    }
    slots_total = real + 3
    conv_pool = torch.randn(slots_total, channels, kc - 1, generator=gen)
    state_pool = torch.randn(slots_total, hv, dk, dv, generator=gen) * 0.3
    scratch = slots_total - 1
    slots = torch.cat([torch.randperm(scratch, generator=gen)[:real], torch.full((padding,), scratch)])
    as_dtype = {k: v.to(dtype).to(device) for k, v in params.items()}
    # the in_proj outputs are column slices of one projection (row stride > row width)
    mixed, z, b, a = proj.to(dtype).to(device).split([channels, hv * dv, hv, hv], dim=-1)
    return {"mixed": mixed, "z": z, "b": b, "a": a, **as_dtype, "conv_pool": conv_pool.to(dtype).to(device),
            "state_pool": state_pool.to(device), "slots": slots.to(device), "eps": 1e-6, "gate_activation": gate}


def run(step, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, conv pool, state pool) after one step on copies of the pools."""
    inputs = {**inputs, "conv_pool": inputs["conv_pool"].clone(), "state_pool": inputs["state_pool"].clone()}
    out = step(**inputs)
    return out, inputs["conv_pool"], inputs["state_pool"]


def transformers_step(inputs: dict, dtype: torch.dtype):
    """transformers' decode step (its own functions) in `dtype` for the first len(slots) rows (the real
    requests): (output, new states)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextRMSNormGated,
        causal_conv1d_update,
        torch_recurrent_gated_delta_rule,
    )

    x = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "state_pool" else v
         for k, v in inputs.items()}
    x.update({k: x[k][: len(x["slots"])] for k in ("mixed", "z", "b", "a")})
    hv, dk, dv = x["state_pool"].shape[1:]
    n, channels = x["mixed"].shape
    hk = (channels - hv * dv) // (2 * dk)
    conv_state = x["conv_pool"][x["slots"]].clone()
    conv = causal_conv1d_update(x["mixed"][:, :, None], conv_state, x["conv_weight"], None, "silu")
    q, k, v = conv.transpose(1, 2).split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (t.reshape(n, 1, hk, dk).repeat_interleave(hv // hk, dim=2) for t in (q, k))
    g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
    core, state = torch_recurrent_gated_delta_rule(
        q, k, v.reshape(n, 1, hv, dv), g=g[:, None], beta=x["b"].sigmoid()[:, None],
        initial_state=x["state_pool"][x["slots"]], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    norm = Qwen4ExpTextRMSNormGated(dv, x["eps"], x["gate_activation"]).to(device=q.device, dtype=dtype)
    norm.weight.data.copy_(x["norm_weight"])
    out = norm(core.reshape(-1, dv), x["z"].reshape(-1, dv)).reshape(n, hv * dv)
    return out, state


def yardstick_step(inputs: dict, dtype: torch.dtype):
    """`transformers_step`; where the installed transformers has no Qwen4-Exp (a GPU machine's older
    release), the torch reference's own step in `dtype` (itself within FACTOR x transformers' bf16 error:
    tests/test_bf16_parity.py)."""
    try:
        return transformers_step(inputs, dtype)
    except ImportError:
        pass
    from tierlm.kernels.gated_delta_rule.decode import gated_delta_decode

    x = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "state_pool" else v
         for k, v in inputs.items()}
    x.update({k: x[k][: len(x["slots"])] for k in ("mixed", "z", "b", "a")})
    out, _, state = run(gated_delta_decode, x)
    return out, state[x["slots"]]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_within_transformers_error(ours, theirs, truth, what: str) -> None:
    """Row by row (one request): max |ours - truth| <= FACTOR max |theirs - truth| + half a bf16 ulp."""
    ours, theirs, truth = (t.flatten(1).float().cpu() for t in (ours, theirs, truth))
    ours_error, their_error = (ours - truth).abs().amax(1), (theirs - truth).abs().amax(1)
    bound = FACTOR * their_error + bf16_ulp(truth.abs().amax(1)) / 2
    assert (ours_error <= bound).all(), f"{what}: errors {ours_error.tolist()} over bounds {bound.tolist()}"


@contextlib.contextmanager
def value_tile(tile: int | None):
    """The kernel's VALUE_TILE for the block (None: its default), and its arrival counters checked back at
    zero after it (each launch's last programs reset theirs)."""
    from tierlm.kernels.gated_delta_rule import decode_triton
    from tierlm.kernels.split_reduce import arrival_counters

    default = decode_triton.VALUE_TILE
    decode_triton.VALUE_TILE = tile or default
    try:
        yield
    finally:
        decode_triton.VALUE_TILE = default
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        assert not arrival_counters("gated_delta_rule_decode", device, 1).any(), "arrival counters left non-zero"


def compare(shape: tuple, device: str, gate: str = "silu", tile: int | None = None) -> None:
    """The kernel against the reference in fp32, and against transformers' bf16 error in bf16, on one
    batch with padding rows, at value tile `tile` (None: the kernel's default)."""
    with value_tile(tile):
        _compare(shape, device, gate)


def _compare(shape: tuple, device: str, gate: str) -> None:
    from tierlm.kernels.gated_delta_rule.decode import gated_delta_decode
    from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_decode as kernel

    hv, dv, real, padding = shape[1], shape[3], shape[5], shape[6]
    inputs = workload(*shape, torch.float32, device, gate=gate)
    slots = inputs["slots"][:real]
    untouched = torch.ones(inputs["conv_pool"].shape[0], dtype=torch.bool, device=device)
    untouched[inputs["slots"]] = False  # neither a request's slot nor the scratch slot
    out_ref, conv_ref, state_ref = run(gated_delta_decode, inputs)
    out, conv, state = run(kernel, inputs)
    assert torch.equal(conv[untouched], inputs["conv_pool"][untouched])
    assert torch.equal(state[untouched], inputs["state_pool"][untouched])
    assert torch.equal(conv[slots], conv_ref[slots])
    assert rel_rms(out[:real], out_ref[:real]) < 1e-5, rel_rms(out[:real], out_ref[:real])
    assert rel_rms(state[slots], state_ref[slots]) < 1e-5, rel_rms(state[slots], state_ref[slots])

    inputs = workload(*shape, torch.bfloat16, device, gate=gate)
    truth = yardstick_step({**inputs, "slots": slots}, torch.float32)
    theirs = yardstick_step({**inputs, "slots": slots}, torch.bfloat16)
    out, conv, state = run(kernel, inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (real + padding, hv * dv)
    assert torch.equal(conv[untouched], inputs["conv_pool"][untouched])
    assert torch.equal(state[untouched], inputs["state_pool"][untouched])
    assert torch.equal(conv[slots], run(gated_delta_decode, inputs)[1][slots])
    assert_within_transformers_error(out[:real], theirs[0], truth[0], "bf16 output")
    assert_within_transformers_error(state[slots], theirs[1], truth[1], "bf16 state")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("case", sorted(SMALL))
def test_decode_kernel_matches_the_reference(case):
    if not triton_available():
        pytest.skip("triton is not installed")
    gate = "sigmoid" if "sigmoid" in case else "silu"
    if torch.cuda.is_available():
        compare(SMALL[case], "cuda", gate, TILES[case])
        return
    run_interpreted(*decode_child(case))


def decode_child(case: str) -> tuple[str]:
    gate = "sigmoid" if "sigmoid" in case else "silu"
    return ((f"import test_gdn_decode_kernel as t; t.round_bf16_like_the_gpu(); "
             f"t.compare(t.SMALL[{case!r}], 'cpu', {gate!r}, t.TILES[{case!r}])"),)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real widths need a GPU")
@pytest.mark.parametrize("batch", sorted(GPU_BATCHES))
def test_decode_kernel_at_real_widths_on_gpu(batch):
    padding = GPU_BATCHES[batch]
    compare((*REAL_WIDTHS, batch - padding, padding), "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programs run concurrently only on a GPU")
def test_decode_kernel_is_the_same_every_launch_on_gpu():
    """Which program of a key head arrives last (and does its norms) changes from launch to launch; the
    result must not: the same step from the same pools, 50 times, bit for bit (a norm reading o tiles
    not yet visible, or a q/k window rewritten before a reader, would show as a differing launch)."""
    from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_decode as kernel

    with value_tile(None):
        inputs = workload(*REAL_WIDTHS, 16, 0, torch.bfloat16, "cuda")
        first = run(kernel, inputs)
        for _ in range(50):
            again = run(kernel, inputs)
            assert all(torch.equal(x, y) for x, y in zip(first, again))


def compare_layer(device: str) -> None:
    """GatedDeltaNet decode steps through the kernels against its torch path (the kill switch): the layer
    hands the kernels the right tensors. Three steps of a batch of 3 requests and 1 padding row."""
    from types import SimpleNamespace

    from tierlm.model.cache import GDNState
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.layers import gated_deltanet

    torch.manual_seed(0)
    config = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, linear_conv_kernel_dim=4, hidden_size=32, rms_norm_eps=1e-6,
                             output_gate_act="silu")
    layer = gated_deltanet.GatedDeltaNet(config)
    for p in layer.parameters():
        p.data = torch.randn_like(p) * 0.3
    layer = layer.to(device)
    batch = ForwardBatch.build([[2]] * 4, [9, 0, 3, 0], [3, 0, 1, 4], [[0], [1], [2], [3]], 128, device)
    conv0 = torch.randn(5, layer.conv_dim, layer.kernel - 1, device=device)
    rec0 = torch.randn(5, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device)
    states = {fused: GDNState(conv0.clone(), rec0.clone()) for fused in (False, True)}
    for _ in range(3):
        x = torch.randn(4, config.hidden_size, device=device)
        outs = {}
        for fused, state in states.items():
            with forced_decode_path(gated_deltanet, fused):
                outs[fused] = layer(x, batch, state)
        assert rel_rms(outs[True][:3], outs[False][:3]) < 1e-5
    assert torch.equal(states[True].conv[:4], states[False].conv[:4])
    assert rel_rms(states[True].recurrent[:4], states[False].recurrent[:4]) < 1e-5


class forced_decode_path:  # a context manager, named as one reads in a `with`
    """The layer's decode step through the kernels (fused) or torch, whatever the device."""

    def __init__(self, module, fused: bool) -> None:
        self.module, self.fused = module, fused

    def __enter__(self):
        self.saved = self.module.fused_decode_applies
        self.module.fused_decode_applies = lambda x: self.fused
        return self

    def __exit__(self, *exc):
        self.module.fused_decode_applies = self.saved


def test_layer_decode_through_the_kernels_equals_its_torch_path():
    on_cuda_else_interpreted(lambda: compare_layer("cuda"), INTERPRETED_EARLY,
                             "test_layer_decode_through_the_kernels_equals_its_torch_path")


def test_kill_switch_and_cpu_keep_the_torch_path(monkeypatch):
    from tierlm.model.layers.gated_deltanet import fused_decode_applies

    assert not fused_decode_applies(torch.zeros(1))
    if torch.cuda.is_available():
        assert fused_decode_applies(torch.zeros(1, device="cuda"))
        monkeypatch.setenv("TIERLM_NO_FUSED_GDN_DECODE", "1")
        assert not fused_decode_applies(torch.zeros(1, device="cuda"))


def test_kernel_refuses_bad_inputs():
    """Checked before any launch: an fp16 state pool, channels that do not split into heads, a z of the
    wrong width."""
    if not triton_available():
        pytest.skip("triton is not installed")
    from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_decode as kernel

    inputs = workload(*SMALL["grouped"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="state pool must be contiguous fp32"):
        kernel(**{**inputs, "state_pool": inputs["state_pool"].half()})
    with pytest.raises(ValueError, match="conv channels do not split"):
        kernel(**{**inputs, "mixed": inputs["mixed"][:, 1:]})
    with pytest.raises(ValueError, match="z must be"):
        kernel(**{**inputs, "z": inputs["z"][:, 1:]})


# ---- speculative verification: T rows per request, the state after each kept in its own slot ----------
VERIFY = {"k1": (2, 6, 16, 24, 4, 3, 2), "k3_sigmoid": (2, 2, 32, 16, 4, 2, 4)}  # ..., requests, rows per request


def verify_workload(hk, hv, dk, dv, kc, requests, width, dtype, device, gate="silu"):
    """`workload` with requests x width rows; slots 0..B-1 are the requests', then B*(width-1) position
    slots, then two untouched slots."""
    inputs = workload(hk, hv, dk, dv, kc, requests * width, 0, dtype, device, seed=1, gate=gate)
    gen = torch.Generator().manual_seed(2)
    total = requests * width + 2
    inputs["conv_pool"] = torch.randn(total, inputs["conv_pool"].shape[1], kc - 1, generator=gen).to(dtype).to(device)
    inputs["state_pool"] = (torch.randn(total, hv, dk, dv, generator=gen) * 0.3).to(device)
    inputs["slots"] = torch.arange(requests, device=device)
    after = requests + torch.arange(requests * (width - 1), device=device).view(requests, width - 1)
    inputs["state_slots"] = torch.cat([after, inputs["slots"][:, None]], dim=1)
    return inputs


def sequential_decode(inputs: dict) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The reference's one-token decode over each row in turn: (outputs [B*T, Hv*Dv], per row t the
    (conv, state) rows of every request after it)."""
    from tierlm.kernels.gated_delta_rule.decode import gated_delta_decode

    requests, width = inputs["state_slots"].shape
    conv_pool, state_pool = inputs["conv_pool"].clone(), inputs["state_pool"].clone()
    step = {k: v for k, v in inputs.items() if k != "state_slots"}
    outs, after = [], []
    for t in range(width):
        rows = torch.arange(requests, device=conv_pool.device) * width + t
        rows_in = {k: inputs[k][rows] for k in ("mixed", "z", "b", "a")}
        outs.append(gated_delta_decode(**{**step, **rows_in, "conv_pool": conv_pool, "state_pool": state_pool}))
        after.append((conv_pool[inputs["slots"]].clone(), state_pool[inputs["slots"]].clone()))
    return torch.stack(outs, dim=1).flatten(0, 1), after


def test_verify_reference_is_decode_row_after_row():
    """gated_delta_verify over T rows = T one-token decode steps: the same outputs, and slot state_slots[:, t]
    holds the conv window and state the decode had after row t (fp32 and bf16: the same roundings)."""
    from tierlm.kernels.gated_delta_rule.decode import gated_delta_verify

    for dtype in (torch.float32, torch.bfloat16):
        inputs = verify_workload(*VERIFY["k3_sigmoid"], dtype, "cpu", gate="sigmoid")
        out, conv, state = run(gated_delta_verify, inputs)
        expected, after = sequential_decode(inputs)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        for t, (conv_t, state_t) in enumerate(after):
            assert torch.equal(conv[inputs["state_slots"][:, t]], conv_t)
            torch.testing.assert_close(state[inputs["state_slots"][:, t]], state_t, rtol=1e-5, atol=1e-6)
        assert torch.equal(conv[-2:], inputs["conv_pool"][-2:]) and torch.equal(state[-2:], inputs["state_pool"][-2:])


def compare_verify(shape: tuple, device: str, gate: str = "silu", tile: int | None = None) -> None:
    """triton_gated_delta_verify against gated_delta_verify: fp32 to summation order; bf16 within FACTOR x
    the reference's own bf16 error (itself within 2x transformers': tests/test_bf16_parity.py) against the
    reference in fp32 on the same values, per request and row, for the output and every kept state; at
    value tile `tile` (None: the kernel's default)."""
    with value_tile(tile):
        _compare_verify(shape, device, gate)


def _compare_verify(shape: tuple, device: str, gate: str) -> None:
    from tierlm.kernels.gated_delta_rule.decode import gated_delta_verify
    from tierlm.kernels.gated_delta_rule.decode_triton import triton_gated_delta_verify as kernel

    inputs = verify_workload(*shape, torch.float32, device, gate=gate)
    out_ref, conv_ref, state_ref = run(gated_delta_verify, inputs)
    out, conv, state = run(kernel, inputs)
    assert torch.equal(conv, conv_ref)  # copies, every slot (the last two untouched)
    assert rel_rms(out, out_ref) < 1e-5 and rel_rms(state, state_ref) < 1e-5
    assert torch.equal(state[-2:], inputs["state_pool"][-2:])

    inputs = verify_workload(*shape, torch.bfloat16, device, gate=gate)
    as_fp32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    truth, theirs, ours = run(gated_delta_verify, as_fp32), run(gated_delta_verify, inputs), run(kernel, inputs)
    assert ours[0].dtype == torch.bfloat16 and torch.equal(ours[1], theirs[1])
    assert_within_transformers_error(ours[0], theirs[0], truth[0], "bf16 output")
    kept = inputs["state_slots"].flatten()
    assert_within_transformers_error(ours[2][kept], theirs[2][kept], truth[2][kept], "bf16 states")


@pytest.mark.parametrize("case", sorted(VERIFY))
def test_verify_kernel_matches_the_reference(case):
    if not triton_available():
        pytest.skip("triton is not installed")
    gate = "sigmoid" if "sigmoid" in case else "silu"
    if torch.cuda.is_available():
        compare_verify(VERIFY[case], "cuda", gate, TILES[case])
        return
    run_interpreted(*verify_child(case))


def verify_child(case: str) -> tuple[str]:
    gate = "sigmoid" if "sigmoid" in case else "silu"
    return ((f"import test_gdn_decode_kernel as t; t.round_bf16_like_the_gpu(); "
             f"t.compare_verify(t.VERIFY[{case!r}], 'cpu', {gate!r}, t.TILES[{case!r}])"),)


INTERPRETED_EARLY = {  # (long children: queued when collection ends, see tests/interpreted.py)
    "test_decode_kernel_matches_the_reference": decode_child,
    "test_verify_kernel_matches_the_reference": verify_child,
    "test_layer_decode_through_the_kernels_equals_its_torch_path": (
        "import test_gdn_decode_kernel as t; t.compare_layer('cpu')",),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real widths need a GPU")
@pytest.mark.parametrize("requests, width", [(1, 2), (4, 4)])
def test_verify_kernel_at_real_widths_on_gpu(requests, width):
    compare_verify((*REAL_WIDTHS, requests, width), "cuda")
