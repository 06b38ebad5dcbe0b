"""kernels/quant_linear: the packed format (compressed-tensors `pack-quantized`), the torch reference, and
the Triton kernel against the reference in fp32 and bf16 over every weight format and both forms (GEMV
for decode rows, split over K or not; tl.dot GEMM for prefill chunks).

Tolerance (bf16 and fp32 alike): both forms are compared with `exact`, the same computation in fp64 on
the same inputs (x, and the weight dequantized and rounded to x's dtype, which is what both forms
multiply by). The kernel may be off by at most twice the reference's own error, plus one unit of
roundoff of x's dtype at the output's largest magnitude (the final rounding may land on the
neighbouring value), plus one unit of fp32 roundoff at the largest sum of |products| (fp32 sums in
another order). In bf16 the middle term dominates, in fp32 the last. A wrong bit, group or scale is
off by orders of magnitude more.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
first imported), so every kernel case runs in one child process and each test reads its case's result.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreted import interpreted_json

from tierlm.kernels.quant_linear import naive, packing

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (name, bits, group_size): group_size None = one scale per output channel. INT6 in groups of whole 16-value
# runs takes the runs' form at decode rows (`six_bit_tile`), in groups of 8 the per-value gather
FORMATS = [("unquantized", None, None), ("int4-g32", 4, 32), ("int8-g64", 8, 64), ("int6-g32", 6, 32),
           ("int6-g8", 6, 8), ("int4-channel", 4, None)]
# (name, leading shape of x, K, N, min tiles per split): 1 row (K in 2 splits, the second tile part-full,
# groups smaller than a tile), 3 rows in a [3, 1] batch (no split, one scale per tile; packed 4/8 bits: a
# program of 4 rows, one masked), 20 rows (tl.dot); N never a multiple of the tile
SHAPES = [("decode-split", (1,), 320, 40, 1), ("decode", (3, 1), 192, 40, 4), ("prefill", (20,), 192, 72, 4)]
# smaller than the kernel's own, so these small K take several tiles
GEMV_BLOCK_K, PACKED_GEMV_BLOCK_K, DENSE_GEMV_BLOCK_K = {1: 256, 2: 128, 4: 64}, dict.fromkeys((1, 2, 4), 128), 256
SIX_BIT_GEMV_BLOCK_K = 128
# unquantized one-row GEMVs: a split of whole tiles, all loaded before the wait (`LaunchConfig.up_front_tiles`), and K not a
# whole number of tiles (the loop)
DENSE_SHAPES = [("decode-up-front", (1,), 512, 40, 4), ("decode-uneven-k", (1,), 1088, 24, 8)]
CASES = {f"{d}-{f[0]}-{s[0]}": (DTYPES[d], f, s) for d in DTYPES for f in FORMATS for s in SHAPES}
CASES |= {f"{d}-unquantized-{s[0]}": (DTYPES[d], FORMATS[0], s) for d in DTYPES for s in DENSE_SHAPES}
# packed 4/8 bits at 2 rows: a program of two rows side by side; at 3 rows the tl.dot GEMM a wide output takes
# (PACKED_GEMM_MIN_N_TILES set to 0 for it, so this narrow one does)
CASES |= {f"{d}-{f[0]}-decode-two-rows": (DTYPES[d], f, ("decode-two-rows", (2,), 192, 40, 4)) for d in DTYPES
          for f in FORMATS if f[1] in (4, 8)}
CASES |= {f"{d}-{f[0]}-decode-gemm": (DTYPES[d], f, ("decode-gemm", (3,), 192, 40, 4)) for d in DTYPES
          for f in FORMATS if f[1] in (4, 8)}


def make_case(name: str, seed: int = 0):
    """(x, weight_or_packed, kwargs, exact fp64 result, min tiles per split) for one case."""
    dtype, (_, bits, group), (_, lead, k, n, min_tiles) = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    if bits is None:
        weight, kwargs, w_used = w, {}, w
    else:
        weight, scales = packing.quantize(w, bits, group or k)
        kwargs = {"scales": scales, "bits": bits, "group_size": group}
        w_used = packing.dequantize(weight, scales, bits, k, dtype=dtype)
    exact = x.double() @ w_used.double().T
    magnitude = x.double().abs() @ w_used.double().abs().T
    return x, weight, kwargs, (exact, magnitude), min_tiles


def within_tolerance(out: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor
                     ) -> str | None:
    """None if `out` is as close to `exact` as the tolerance in the module docstring allows, else why not.
    magnitude: each output's sum of |products| (the scale of its summation error)."""
    reference_error = (reference.double() - exact).abs().max().item()
    bound = (2 * reference_error + torch.finfo(out.dtype).eps * exact.abs().max().item()
             + torch.finfo(torch.float32).eps * magnitude.max().item())
    error = (out.double() - exact).abs().max().item()
    if out.shape != exact.shape or out.dtype != reference.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(exact.shape)} {reference.dtype}"
    if not error <= bound:
        return f"max error {error:.3g} > bound {bound:.3g} (reference's own error {reference_error:.3g})"
    return None


def run_kernel_cases(names: list[str]) -> dict[str, str | None]:
    """Each case through the Triton kernel vs the reference: {case: None if it passed, else why not}."""
    import tierlm.kernels.quant_linear.triton as kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    saved = (kernels.GEMV_MIN_TILES_PER_SPLIT, kernels.GEMV_BLOCK_K, kernels.PACKED_GEMV_BLOCK_K,
             kernels.DENSE_GEMV_BLOCK_K, kernels.SIX_BIT_GEMV_BLOCK_K, kernels.PACKED_GEMM_MIN_N_TILES)
    kernels.GEMV_BLOCK_K, kernels.PACKED_GEMV_BLOCK_K = GEMV_BLOCK_K, PACKED_GEMV_BLOCK_K
    kernels.DENSE_GEMV_BLOCK_K, kernels.SIX_BIT_GEMV_BLOCK_K = DENSE_GEMV_BLOCK_K, SIX_BIT_GEMV_BLOCK_K
    try:
        for name in names:
            x, weight, kwargs, exact, min_tiles = make_case(name)
            kernels.GEMV_MIN_TILES_PER_SPLIT = min_tiles
            kernels.PACKED_GEMM_MIN_N_TILES = 0 if name.endswith("decode-gemm") else saved[-1]
            rows = x.numel() // x.shape[-1]
            cfg = kernels.launch_config(rows, weight.shape[0], x.shape[-1], kwargs.get("bits"), x.element_size())
            if name.endswith("decode-gemm") and not cfg.use_dot:
                results[name] = f"expected the tl.dot GEMM at {rows} rows, got {cfg}"
                continue
            if name.endswith("decode-split") and cfg.splits < 2:
                results[name] = f"expected a split over K, got {cfg.splits}"
                continue
            if (name.endswith("up-front") and cfg.up_front_tiles != 2) or (name.endswith("uneven-k")
                                                                           and cfg.up_front_tiles != 1):
                results[name] = f"{cfg.up_front_tiles} tiles loaded up front"
                continue
            reference = naive.quant_linear(x, weight, **kwargs)
            on_device = {key: v.to(device) if torch.is_tensor(v) else v for key, v in kwargs.items()}
            out = kernels.quant_linear(x.to(device), weight.to(device), **on_device).cpu()
            results[name] = within_tolerance(out, reference, *exact)
    finally:
        (kernels.GEMV_MIN_TILES_PER_SPLIT, kernels.GEMV_BLOCK_K, kernels.PACKED_GEMV_BLOCK_K,
         kernels.DENSE_GEMV_BLOCK_K, kernels.SIX_BIT_GEMV_BLOCK_K, kernels.PACKED_GEMM_MIN_N_TILES) = saved
    return results


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, str | None]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return run_kernel_cases(list(CASES))
    return interpreted_json(*INTERPRETED_EARLY["test_triton_kernel_matches_reference"])


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_triton_kernel_matches_reference": ((
        "import json, torch, test_quant_linear_kernel as t; torch.set_num_threads(1)\n"
        "print(json.dumps(t.run_kernel_cases(list(t.CASES))))"),),
}


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(kernel_results, case):
    assert kernel_results[case] is None, kernel_results[case]


def test_one_unquantized_row_takes_the_dense_gemv_tiles():
    """One row of an unquantized weight (the model's dense decode projections): BLOCK_N 4, 4 warps, BLOCK_K
    512 below K 4096 and 1024 from it (the H200 sweep). INT6 at one row, and unquantized rows at 2 to 4,
    keep the shared GEMV tiles; packed 4/6/8 bits their own (6 bits: a K tile that divides K)."""
    import tierlm.kernels.quant_linear.triton as kernels

    def tiles(m, n, k, bits=None):
        cfg = kernels.launch_config(m, n, k, bits)
        return cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.use_dot

    assert tiles(1, 16384, 2560) == (1, 4, 512, 4, False)
    assert tiles(1, 12800, 2560) == (1, 4, 512, 4, False)
    assert tiles(1, 2560, 6144) == (1, 4, 1024, 4, False)
    assert tiles(1, 2560, 4096) == (1, 4, 1024, 4, False)
    assert tiles(1, 2560, 4095) == (1, 4, 512, 4, False)
    assert tiles(1, 1280, 2560, 6) == (1, 16, 512, 4, False)
    assert tiles(1, 2560, 6144, 6) == (1, 16, 512, 4, False)
    assert tiles(1, 2560, 640, 6) == (1, 16, 128, 4, False)
    assert tiles(4, 2560, 640, 6) == (1, 16, 128, 4, False)
    assert tiles(4, 16384, 2560) == (4, 8, 256, 4, False)
    assert tiles(1, 2560, 6144, 4) == (1, 32, 256, 4, False)
    assert tiles(2, 248320, 2560, 8) == (2, 32, 256, 4, False)  # packed 4/8 bits: every row in each program
    assert tiles(3, 2560, 6144, 4) == (4, 32, 512, 4, False)  # narrow output: the GEMV at any GEMV row count
    assert tiles(4, 10240, 2560, 8) == (4, 32, 512, 4, False)
    assert tiles(3, 248320, 2560, 8) == (16, 128, 64, 4, True)  # wide, above PACKED_GEMV_MAX_ROWS: the GEMM
    wide = kernels.PACKED_GEMM_MIN_N_TILES * kernels.GEMM_TILES[4][0]  # the narrowest output that fills the tiles
    assert tiles(3, wide, 2560, 4)[-1] and not tiles(3, wide - kernels.GEMM_TILES[4][0], 2560, 4)[-1]
    assert not tiles(3, 2560, 640, 6)[-1] and not tiles(3, 16384, 2560)[-1]  # 6 bits, unquantized: the GEMV
    assert tiles(20, 2560, 6144)[-1]  # prefill: tl.dot


def test_unquantized_gemv_loads_whole_splits_up_front(monkeypatch):
    """An unquantized GEMV program loads all its split's K tiles before it waits where they are whole and
    hold at most DENSE_GEMV_UP_FRONT_MAX_VALUES (the real widths' K 2560 at one row); packed weights, larger or
    ragged splits and TIERLM_NO_GEMV_UP_FRONT=1 load one and loop over the rest."""
    import tierlm.kernels.quant_linear.triton as kernels

    def up_front(m, n, k, bits=None):
        return kernels.launch_config(m, n, k, bits).up_front_tiles

    assert up_front(1, 16480, 2560) == up_front(1, 12800, 2560) == 5
    assert up_front(1, 2560, 6144) == 1  # 6 tiles of 4 x 1024
    assert up_front(1, 2560, 1000) == 1  # ragged
    assert up_front(1, 2560, 2560, 4) == up_front(1, 2560, 2560, 8) == 1
    monkeypatch.setenv("TIERLM_NO_GEMV_UP_FRONT", "1")
    assert up_front(1, 16480, 2560) == 1


def test_packing_layout_is_lsb_first_and_dense():
    """Value k of a row sits at bits [k * bits, (k + 1) * bits) of the row's bit stream (compressed-tensors'
    pack_to_int32 with packed_dim=1); the words are int32, so a high top value makes a word negative."""
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 9]])
    packed = packing.pack(values, 4)
    assert packed.shape == (1, 2) and packed.dtype == torch.int32
    assert packed[0, 0].item() == 0xF7654321 - (1 << 32) and packed[0, 1].item() == 9
    six = packing.pack(torch.tensor([[63, 0, 0, 0, 0, 0b101011]]), 6)  # the 6th value straddles words 0-1
    assert six.shape == (1, 2)
    assert six[0, 0].item() == (63 | 0b11 << 30) - (1 << 32) and six[0, 1].item() == 0b1010
    assert packing.packed_width(100, 6) == 19 and packing.packed_width(64, 8) == 16


@pytest.mark.parametrize("bits", packing.SUPPORTED_BITS)
def test_pack_unpack_and_dequantize_round_trip(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randint(0, 1 << bits, (3, 5, 70), generator=gen)  # 70: not a whole number of words
    packed = packing.pack(values, bits)
    assert packed.shape == (3, 5, packing.packed_width(70, bits))
    assert torch.equal(packing.unpack(packed, bits, 70), values.to(torch.int32))
    scales = torch.rand(3, 5, 7, generator=gen).to(torch.bfloat16)
    w = packing.dequantize(packed, scales, bits, 70, group_size=10, dtype=torch.float32)
    expected = (values - (1 << (bits - 1))).float() * scales.float().repeat_interleave(10, dim=-1)
    assert torch.equal(w, expected)


@pytest.mark.parametrize("bits", packing.SUPPORTED_BITS)
def test_quantize_rounds_to_nearest_within_half_a_step(bits):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    packed, scales = packing.quantize(w, bits, 32)
    assert scales.shape == (6, 2)
    back = packing.dequantize(packed, scales, bits, 64, dtype=torch.float32)
    step = scales.float().repeat_interleave(32, dim=-1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    q = packing.unpack(packed, bits, 64)
    assert q.max() <= (1 << bits) - 1 and q.min() >= 1  # symmetric: the most negative code stays unused


def test_bad_arguments_name_the_problem():
    x = torch.randn(2, 64)
    packed, scales = packing.quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match="bits must be one of"):
        naive.quant_linear(x, packed, scales=scales, bits=5)
    with pytest.raises(ValueError, match="words per row"):
        naive.quant_linear(x, packed[:, :4], scales=scales, bits=4)
    with pytest.raises(ValueError, match="group_size 16 does not|needs 4"):
        naive.quant_linear(x, packed, scales=scales, bits=4, group_size=16)
    with pytest.raises(ValueError, match="both bits and scales"):
        naive.quant_linear(x, packed, bits=4)
    with pytest.raises(ValueError, match="do not match packed weight"):
        naive.quant_linear(x, packed, scales=scales[:4], bits=4)
    with pytest.raises(ValueError, match="differs from x dtype"):
        naive.quant_linear(x, torch.randn(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"is not \[N, K=64\]"):
        naive.quant_linear(x, torch.randn(8, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bits", [6, 4])
def test_split_gemv_replays_in_a_cuda_graph(bits):
    """A decode GEMV split over K (the INT6 shared expert's gate_up: 1280 x 2560) finishes in one launch
    through arrival counters, which every launch leaves at zero: replayed from a CUDA graph it equals
    eager calls, call after call."""
    import tierlm.kernels.quant_linear.triton as kernels

    gen = torch.Generator().manual_seed(0)
    weight, scales = packing.quantize(torch.randn(1280, 2560, generator=gen), bits, 32)
    weight, scales = weight.cuda(), scales.bfloat16().cuda()
    x = torch.randn(1, 2560, generator=gen).bfloat16().cuda()
    assert kernels.launch_config(1, 1280, 2560, bits).splits > 1
    eager = kernels.quant_linear(x, weight, scales=scales, bits=bits)  # counters made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.quant_linear(x, weight, scales=scales, bits=bits)
    for seed in range(3):
        x.copy_(torch.randn(1, 2560, generator=torch.Generator().manual_seed(10 + seed)).bfloat16())
        graph.replay()
        eager = kernels.quant_linear(x, weight, scales=scales, bits=bits)
        assert torch.equal(captured, eager)
    assert within_tolerance(eager.cpu(), naive.quant_linear(x, weight, scales=scales, bits=bits).cpu(),
                            *exact_of(x.cpu(), packing.dequantize(weight, scales, bits, 2560).cpu())) is None


def exact_of(x: torch.Tensor, w: torch.Tensor):
    """(x W^T in fp64, the sums of |products|): `within_tolerance`'s exact result for dequantized W."""
    return x.double() @ w.double().T, x.double().abs() @ w.double().abs().T


def replay_with_and_without_pdl(monkeypatch, step, set_inputs, replays: int = 16) -> list[list[torch.Tensor]]:
    """step() captured in a CUDA graph with programmatic dependent launch, and again with TIERLM_NO_PDL=1
    (each warmed up eagerly first: compiles, arrival counters); replayed `replays` times each after
    set_inputs(i) writes replay i's inputs into the captured buffers. Returns [with PDL, without]: each
    a list of replay outputs (step's result, cloned)."""
    from tierlm.kernels.dependent_launch import pdl_enabled

    assert pdl_enabled(torch.device("cuda")), "the device has no programmatic dependent launch (compute capability < 9)"
    outputs = []
    for no_pdl in (False, True):
        if no_pdl:
            monkeypatch.setenv("TIERLM_NO_PDL", "1")
        else:
            monkeypatch.delenv("TIERLM_NO_PDL", raising=False)
        set_inputs(0)
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = step()
        runs = []
        for i in range(replays):
            set_inputs(i)
            graph.replay()
            runs.append(result.clone())
        outputs.append(runs)
    return outputs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("bits", [None, 4])
def test_dependent_launch_is_bit_identical_in_a_cuda_graph(monkeypatch, rows, bits):
    """A chain of decode GEMVs, each reading the one before it (the model's 2560 -> 16384, 16384 -> 2560,
    2560 -> 6144, 6144 -> 2560 widths: split over K and not; bf16 or INT4 g128), captured with
    programmatic dependent launch (each GEMV's first weight tile loaded before it waits) and without:
    16 replays on new inputs give bit-identical outputs, equal to eager calls (a kernel that read its
    input before the wait would race the one before it)."""
    import tierlm.kernels.quant_linear.triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for n, k in ((16384, 2560), (2560, 16384), (6144, 2560), (2560, 6144)):
        w = torch.randn(n, k, generator=gen, device="cuda") * k**-0.5
        if bits is None:
            layers.append((w.bfloat16(), {}))
        else:
            packed, scales = packing.quantize(w, bits, 128)
            layers.append((packed, {"scales": scales.bfloat16(), "bits": bits, "group_size": 128}))
    x = torch.empty(rows, 2560, device="cuda", dtype=torch.bfloat16)

    def step():
        y = x
        for weight, kwargs in layers * 2:
            y = kernels.quant_linear(y, weight, **kwargs)
        return y

    def set_inputs(i):
        x.copy_(torch.randn(rows, 2560, generator=torch.Generator(device="cuda").manual_seed(100 + i), device="cuda"))

    with_pdl, without = replay_with_and_without_pdl(monkeypatch, step, set_inputs)
    for i, (a, b) in enumerate(zip(with_pdl, without)):
        set_inputs(i)
        assert torch.equal(a, b) and torch.equal(a, step()), f"replay {i}"
        assert a.abs().max() > 0
