"""kernels/fused_moe: the Triton experts against the torch reference (itself checked against the model's
`Experts`), in fp32 and bf16, unquantized and INT4 / INT6 / INT8 group-quantized, on the decode path
(GEMVs, the top-k sum in the down kernel or over several programs) and the prefill path (pairs sorted by expert into padded blocks, some experts with
several blocks, some with none); and the block alignment on its own.

Tolerance (as in test_quant_linear_kernel): both forms are compared with `exact`, the reference's
computation in fp64 on the same inputs (x, routing weights, the experts' weights as both forms multiply
by them: dequantized and rounded to x's dtype). The kernel may be off by at most twice the reference's
own error (in bf16: its rounded products, SiLU, and the expert-by-expert accumulation in bf16, as
transformers does), plus one unit of roundoff of x's dtype at the output's largest magnitude, plus one
unit of fp32 roundoff at the largest sum of |terms| of the down products and top-k sum (fp32 sums in
another order; the term that matters in fp32).

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
first imported), so every kernel case runs in one child process and each test reads its case's result.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from interpreted import interpreted_json

from tierlm.kernels.fused_moe import naive
from tierlm.kernels.quant_linear import packing

E, H, I = 8, 96, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FORMATS = {"unquantized": (None, None), "int4-g32": (4, 32), "int8-g16": (8, 16), "int6-g16": (6, 16)}
# H is not a whole number of K tiles (masked loads), I is (unmasked): see DECODE_BLOCK_K.
# (tokens, top-k, routing skewed towards expert 5, a down program's ranks): decode, 6 pairs, each token's
# top-k sum in the down kernel;
# decode-split, 9 pairs, the top-3 over two down programs (2 ranks and 1) and the partials summed after;
# prefill, 40 pairs in blocks of 16 (expert 5 takes 20 of them: two blocks), taken past DECODE_MAX_PAIRS
# (lowered to keep shapes tiny)
PATHS = {"decode": (3, 2, False, 2), "decode-split": (3, 3, False, 2), "prefill": (20, 2, True, 2)}
DECODE_MAX_PAIRS, PREFILL_BLOCK_M = 16, 16
# decode K tiles smaller than the kernels' own: gate_up's H in two tiles (the second part-full), down's I
# in two whole ones, so each GEMV runs over several tiles (each loaded while the one before computes);
DECODE_BLOCK_K = {"gate_up_block_k": 64, "down_block_k": 32}
# decode N tiles larger than the kernels' own (each program costs the interpreter the same, whatever its
# tile): gate_up's I = 64 in four whole tiles, the shared expert's S = 48 in three (its fourth program
# skips it), down's H = 96 in two (the second part-full: masked stores)
DECODE_BLOCK_N = {"gate_up_block_n": 16, "down_block_n": 64}
# packed 4/8-bit experts (`packed_decode`): each program one tile of words, H and I split over two programs
# each (H's second part-full for INT4 and INT8; the shared expert's S = 48 in two, the second part-full)
PACKED_BLOCK_W = {4: {"gate_up_block_w": 8, "down_block_w": 4}, 8: {"gate_up_block_w": 16, "down_block_w": 8}}
# the shared expert's K tiles: H in two (the second part-full), S = 48 in two (the second part-full)
SHARED_BLOCK_K = {"shared_gate_up_block_k": 64, "shared_down_block_k": 32}
CASES = {f"{d}-{f}-{p}": (DTYPES[d], FORMATS[f], PATHS[p]) for d in DTYPES for f in FORMATS for p in PATHS
         if p != "decode-split" or f in ("unquantized", "int4-g32")}  # (the split is format-independent)
# packed decode with each program's tile spanning all of H and all of I (no K split: gate_up finishes
# without the arrival counters)
CASES["bf16-int4-g32-decode-whole-k"] = (DTYPES["bf16"], FORMATS["int4-g32"], PATHS["decode"])
WHOLE_K = {"gate_up_block_w": 16, "down_block_w": 8}
# with the MoE block's shared expert (S columns, not a whole number of tiles) as one more expert of every
# token: in the routed experts' format, in another (INT6 beside packed INT4: the int4-mixed scheme; its
# gate_up and down in different groups), unquantized beside INT4 (the int4 scheme), and at prefill size
# (the last two in bf16 only: their fp32 arithmetic is the first two's)
S = 48
SHARED_FORMATS = {"unquantized": (None, None), "int6": (6, (32, 16))}
SHARED_CASES = {"unquantized-decode-split-shared": ("unquantized", "decode-split", "unquantized", DTYPES),
                "int4-g32-decode-split-shared-int6": ("int4-g32", "decode-split", "int6", DTYPES),
                "int4-g32-decode-shared-unquantized": ("int4-g32", "decode", "unquantized", ["bf16"]),
                "unquantized-prefill-shared": ("unquantized", "prefill", "unquantized", ["bf16"])}
for _case, (_routed, _path, _shared, _dtypes) in SHARED_CASES.items():
    CASES.update({f"{d}-{_case}": (DTYPES[d], FORMATS[_routed], PATHS[_path], _shared) for d in _dtypes})
# the packed decode form's v2 K loop (TIERLM_PACKED_MOE_VARIANT=v2, INT4: fused_moe.triton.PACKED_V2_TILES
# with DECODE_BLOCK_N and SHARED_BLOCK_K): each INT4 decode case again with gate_up looping over 2 tiles
# of one group (4 words) a program, so H's 12 words take two programs (the second's tile 2 wholly past H:
# masked), and down one tile a program (no loop, two programs); the whole-k case with 2 groups a tile, 5
# tiles a program (one program each: H and I, some tiles wholly masked)
V2_TILES = {"gate_up_block_w": 4, "down_block_w": 4, "gate_up_chunks": 2, "down_chunks": 1}
V2_WHOLE_K_TILES = {"gate_up_block_w": 8, "down_block_w": 8, "gate_up_chunks": 5, "down_chunks": 5}
CASES.update({f"{name}-v2": case for name, case in list(CASES.items())
              if "-int4-" in name and case[2] != PATHS["prefill"]})
# the decode forms load their first weights before their inputs (`decode_parts.early_weights`: the packed
# form's routed items, the unquantized / INT6 form's down items: its first EARLY_DOWN_TILES tiles, here one of
# I's two in fp32 and both in bf16); these cases take the other order (TIERLM_NO_EARLY_EXPERT_WEIGHTS=1):
# both packed K loops and both dtypes with the INT6 shared expert (INT8 experts share the v1 code); the
# unquantized / INT6 form's late order is its down_columns without tiles up front, which every case's
# shared expert takes
EARLY_DOWN_TILES = {torch.float32: 1, torch.bfloat16: 2}
CASES.update({f"{name}-weights-late": CASES[name] for name in
              ("fp32-int4-g32-decode-split-shared-int6", "bf16-int4-g32-decode-split-shared-int6-v2")})
# every other packed case runs its shared expert inside the packed decode launches (`run_kernel_cases`); at
# the decode path's 3 tokens packed experts run it apart by default (PACKED_SHARED_APART_TOKENS: the routed
# launches, then `quant_linear`'s, the outputs added): these cases keep that path
CASES.update({f"{name}-apart": CASES[name] for name in
              ("fp32-int4-g32-decode-split-shared-int6", "bf16-int4-g32-decode-split-shared-int6")})
# a group that does not nest with the packed tiles (3 words against v1's tiles of 8 and 4): one scale a word
# where every other case's tiles take one a group (`packed_decode._tile_weights`); experts ODD_GROUP_I wide
# (24 divides H, not I)
ODD_GROUP_I = 48
CASES["bf16-int4-g24-decode"] = (DTYPES["bf16"], (4, 24), PATHS["decode"])


def route(tokens: int, top_k: int, skewed: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing with renormalised weights (fp32). skewed: every token picks expert 5 and
    experts 0-2 are never picked."""
    logits = torch.randn(tokens, E, generator=gen)
    if skewed:
        logits[:, 5] += 10
        logits[:, :3] -= 10
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def make_shared(tokens: int, dtype: torch.dtype, shared_format: str, gen: torch.Generator
                ) -> tuple[naive.SharedExpert, naive.SharedExpert]:
    """(a shared expert of width S in `shared_format`, the same exactly in fp64 with the weights both
    forms multiply by); its gate the sigmoid of a random logit, in dtype."""
    bits, groups = SHARED_FORMATS[shared_format]
    w_gate_up = (torch.randn(2 * S, H, generator=gen) * H**-0.5).to(dtype)
    w_down = (torch.randn(H, S, generator=gen) * S**-0.5).to(dtype)
    gate = torch.sigmoid(torch.randn(tokens, 1, generator=gen)).to(dtype)
    if bits is None:
        shared, used = naive.SharedExpert(gate, w_gate_up, w_down), (w_gate_up, w_down)
    else:
        (gu, gu_scales), (down, down_scales) = (packing.quantize(w, bits, g) for w, g in zip((w_gate_up, w_down),
                                                                                               groups))
        shared = naive.SharedExpert(gate, gu, down, f"int{bits}", (gu_scales, down_scales))
        used = (packing.dequantize(gu, gu_scales, bits, H, dtype=dtype),
                packing.dequantize(down, down_scales, bits, S, dtype=dtype))
    return shared, naive.SharedExpert(gate.double(), used[0].double(), used[1].double())


def make_case(name: str, seed: int = 0):
    """(args, kwargs, exact fp64 output) of one case."""
    dtype, (bits, group), (tokens, top_k, skewed, _), *shared_format = CASES[name]
    inter = I if group is None or I % group == 0 else ODD_GROUP_I
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    w_gate_up = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(dtype)
    w_down = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(dtype)
    weights, ids = route(tokens, top_k, skewed, gen)
    weights = weights.to(dtype)
    if bits is None:
        args, kwargs, used = (x, w_gate_up, w_down, weights, ids), {}, (w_gate_up, w_down)
    else:
        (gu, gu_scales), (down, down_scales) = (packing.quantize(w, bits, group) for w in (w_gate_up, w_down))
        args = (x, gu, down, weights, ids)
        kwargs = {"format": f"int{bits}", "scales": (gu_scales, down_scales), "group_size": group}
        used = (packing.dequantize(gu, gu_scales, bits, H, dtype=dtype),
                packing.dequantize(down, down_scales, bits, inter, dtype=dtype))
    shared = exact_shared = None
    if shared_format:
        shared, exact_shared = make_shared(tokens, dtype, shared_format[0], gen)
        kwargs["shared"] = shared
    exact = naive.fused_moe(x.double(), used[0].double(), used[1].double(), weights.double(), ids,
                            shared=exact_shared)
    magnitude = torch.zeros_like(exact)
    for token in range(tokens):
        terms = [(w, used[0][e], used[1][e]) for e, w in zip(ids[token].tolist(), weights[token].double())]
        if exact_shared is not None:
            terms.append((exact_shared.gate[token, 0], exact_shared.w_gate_up, exact_shared.w_down))
        for w, w_gate_up, w_down in terms:
            gate, up = (x[token].double() @ w_gate_up.double().T).chunk(2)
            act = torch.nn.functional.silu(gate) * up
            magnitude[token] += w.abs() * (act.abs() @ w_down.double().abs().T)
    return args, kwargs, (exact, magnitude)


def within_tolerance(out: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor
                     ) -> str | None:
    """None if `out` is as close to `exact` as the tolerance in the module docstring allows, else why not."""
    if out.shape != exact.shape or out.dtype != reference.dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype}, expected {tuple(exact.shape)} {reference.dtype}"
    reference_error = (reference.double() - exact).abs().max().item()
    bound = (2 * reference_error + torch.finfo(out.dtype).eps * exact.abs().max().item()
             + torch.finfo(torch.float32).eps * magnitude.max().item())
    error = (out.double() - exact).abs().max().item()
    if not error <= bound:
        return f"max error {error:.3g} > bound {bound:.3g} (reference's own error {reference_error:.3g})"
    return None


def run_kernel_cases(names: list[str]) -> dict[str, str | None]:
    """Each case through the Triton kernels vs the reference: {case: None if it passed, else why not}."""
    import tierlm.kernels.fused_moe.triton as kernels
    from tierlm.kernels.fused_moe import packed_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = {}
    saved = (kernels.DECODE_MAX_PAIRS, kernels.PREFILL_BLOCK_M, kernels.DECODE_TILES, kernels.PACKED_V2_TILES,
             kernels.EARLY_DOWN_TILES, packed_decode.PACKED_V2_EARLY_MIN_GROUP, kernels.PACKED_SHARED_APART_TOKENS)
    packed_decode.PACKED_V2_EARLY_MIN_GROUP = 0  # (v2 early at every group here: the cases' groups are 16-32)
    kernels.DECODE_MAX_PAIRS, kernels.PREFILL_BLOCK_M = DECODE_MAX_PAIRS, PREFILL_BLOCK_M
    try:
        for name in names:
            args, kwargs, exact = make_case(name)
            ids = args[4]
            ranks = CASES[name][2][3]
            kernels.DECODE_TILES = {
                bits: tiles._replace(**PACKED_BLOCK_W[bits]) if bits in PACKED_BLOCK_W else
                tiles._replace(down_ranks=ranks, **DECODE_BLOCK_K)
                for bits, tiles in saved[2].items()}
            kernels.DECODE_TILES = {bits: tiles._replace(**DECODE_BLOCK_N, **SHARED_BLOCK_K)
                                    for bits, tiles in kernels.DECODE_TILES.items()}
            if "whole-k" in name:
                kernels.DECODE_TILES[4] = kernels.DECODE_TILES[4]._replace(**WHOLE_K)
            kernels.PACKED_V2_TILES = saved[3]._replace(**DECODE_BLOCK_N, **SHARED_BLOCK_K,
                                                        **(V2_WHOLE_K_TILES if "whole-k" in name else V2_TILES))
            os.environ["TIERLM_PACKED_MOE_VARIANT"] = "v2" if "-v2" in name else "v1"
            kernels.EARLY_DOWN_TILES = EARLY_DOWN_TILES[CASES[name][0]]
            if name.endswith("-weights-late"):
                os.environ["TIERLM_NO_EARLY_EXPERT_WEIGHTS"] = "1"
            else:
                os.environ.pop("TIERLM_NO_EARLY_EXPERT_WEIGHTS", None)
            # the shared expert inside the packed launches, except in the -apart cases (as shipped)
            kernels.PACKED_SHARED_APART_TOKENS = saved[6] if name.endswith("-apart") else range(0)
            if name.endswith("-apart") and args[0].shape[0] not in saved[6]:
                results[name] = f"{args[0].shape[0]} tokens run the shared expert in the packed launches"
                continue
            prefill = CASES[name][2] == PATHS["prefill"]
            if (ids.numel() <= DECODE_MAX_PAIRS) == prefill:
                results[name] = f"{ids.numel()} pairs do not take the path of {name}"
                continue
            if prefill and not (ids == 5).sum() > PREFILL_BLOCK_M:
                results[name] = "expert 5 does not fill two blocks"
                continue
            reference = naive.fused_moe(*args, **kwargs)
            out = kernels.fused_moe(*(a.to(device) for a in args), **on_device(kwargs, device)).cpu()
            results[name] = within_tolerance(out, reference, *exact)
    finally:
        (kernels.DECODE_MAX_PAIRS, kernels.PREFILL_BLOCK_M, kernels.DECODE_TILES, kernels.PACKED_V2_TILES,
         kernels.EARLY_DOWN_TILES, packed_decode.PACKED_V2_EARLY_MIN_GROUP, kernels.PACKED_SHARED_APART_TOKENS) = saved
        os.environ.pop("TIERLM_PACKED_MOE_VARIANT", None)
        os.environ.pop("TIERLM_NO_EARLY_EXPERT_WEIGHTS", None)
    return results


def on_device(kwargs: dict, device: str) -> dict:
    """fused_moe's keyword arguments with every tensor (scales, the shared expert's) on `device`."""
    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, tuple):
            return type(value)(*map(move, value)) if hasattr(value, "_fields") else tuple(map(move, value))
        return value

    return {name: move(value) for name, value in kwargs.items()}


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, str | None]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        return run_kernel_cases(list(CASES))
    return interpreted_json(*INTERPRETED_EARLY["test_triton_kernels_match_reference"])


INTERPRETED_EARLY = {  # (a long child: started when collection ends, see tests/interpreted.py)
    "test_triton_kernels_match_reference": (
        ("import json, torch, test_fused_moe_kernel as t; torch.set_num_threads(1)\n"
         "print(json.dumps(t.run_kernel_cases(list(t.CASES))))"),),
}


@pytest.mark.parametrize("case", CASES)
def test_triton_kernels_match_reference(kernel_results, case):
    assert kernel_results[case] is None, kernel_results[case]


@pytest.mark.parametrize("dtype", DTYPES.values())
def test_reference_equals_the_model_experts(dtype):
    """The reference computes what `model/layers/moe.Experts` computes today (its expert loop)."""
    from tierlm.model.layers.moe import Experts

    gen = torch.Generator().manual_seed(4)
    experts = Experts(E, H, I).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=gen) * H**-0.5)
        experts.down_proj.copy_(torch.randn(E, H, I, generator=gen) * I**-0.5)
        x = torch.randn(20, H, generator=gen).to(dtype)
        weights, ids = route(20, 4, False, gen)
        expected = experts(x, weights.to(dtype), ids)  # 80 pairs: the loop over hit experts
        out = naive.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights.to(dtype), ids)
    assert torch.equal(out, expected)


def test_align_pairs_to_blocks():
    from tierlm.kernels.fused_moe.triton import align_pairs_to_blocks

    gen = torch.Generator().manual_seed(5)
    expert_of_pair = torch.cat([torch.full((21,), 3), torch.randint(4, 9, (30,), generator=gen)])
    expert_of_pair = expert_of_pair[torch.randperm(51, generator=gen)]
    pair_ids, block_expert = align_pairs_to_blocks(expert_of_pair, num_experts=12, block_m=8)
    blocks = pair_ids.view(-1, 8)
    assert blocks.shape[0] == block_expert.numel() == -(-(51 + 12 * 7) // 8)  # the bound, no host sync
    real = pair_ids[pair_ids < 51]
    assert torch.equal(real.sort().values, torch.arange(51, dtype=torch.int32))  # every pair once
    used = block_expert >= 0
    assert (pair_ids.view(-1, 8)[~used] == 51).all()  # blocks past the last run: padding only
    counts = torch.bincount(expert_of_pair, minlength=12)
    expected_blocks = [e for e in range(12) for _ in range(-(-int(counts[e]) // 8))]
    assert block_expert[used].tolist() == expected_blocks  # ascending, each run in whole blocks
    assert used[: len(expected_blocks)].all() and not used[len(expected_blocks):].any()
    for block, expert in zip(blocks[used], block_expert[used]):
        members = block[block < 51].long()
        assert (expert_of_pair[members] == expert).all() and len(members) > 0
        assert torch.equal(members, members.sort().values)  # token order kept within an expert


def test_bad_arguments_name_the_problem():
    x = torch.randn(2, H)
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    weights, ids = route(2, 2, False, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="format must be one of"):
        naive.fused_moe(x, gate_up, down, weights, ids, format="int3")
    with pytest.raises(ValueError, match="needs scales"):
        naive.fused_moe(x, gate_up, down, weights, ids, format="int4")
    with pytest.raises(ValueError, match="take no scales"):
        naive.fused_moe(x, gate_up, down, weights, ids, group_size=32)
    with pytest.raises(ValueError, match=r"\[T=2, k\]"):
        naive.fused_moe(x, gate_up, down, weights[:1], ids[:1])
    with pytest.raises(ValueError, match="must lie in"):
        naive.fused_moe(x, gate_up, down, weights, ids + E)
    with pytest.raises(ValueError, match=r"w_down \[E, H, I=64\]"):
        naive.fused_moe(x, gate_up, down[..., :32], weights, ids)
    (gu, gu_s), (dn, dn_s) = packing.quantize(gate_up, 4, 32), packing.quantize(down, 4, 16)
    with pytest.raises(ValueError, match="group"):
        naive.fused_moe(x, gu, dn, weights, ids, format="int4", scales=(gu_s, dn_s))


def test_packed_variant_is_checked(monkeypatch):
    """The INT4 K loop: v2 by default where its tiles are whole groups, but v1 where v1 measured faster (g32);
    TIERLM_PACKED_MOE_VARIANT forces one (INT8 keeps v1); v2's tiles must be whole groups; and which load their
    weights early."""
    from tierlm.kernels.fused_moe.decode_parts import SharedShape
    from tierlm.kernels.fused_moe.packed_decode import (
        PackedDecodeTiles,
        _packed_launch,
        packed_early,
        packed_variant,
    )
    from tierlm.kernels.fused_moe.triton import PACKED_V2_TILES

    sixteen_words = PACKED_V2_TILES._replace(gate_up_block_w=16, down_block_w=16)

    def variant(bits, group, v2_tiles=sixteen_words):
        return packed_variant(bits, group, v2_tiles)

    monkeypatch.delenv("TIERLM_PACKED_MOE_VARIANT", raising=False)
    # 16-word v2 tiles: 128 INT4 values, whole groups up to g128 (g96: 12 words a group, not a power of two)
    defaults = {(4, 32): "v1", (4, 128): "v2", (4, 64): "v2", (4, 256): "v1", (4, 96): "v1", (4, 4): "v1",
                (8, 128): "v1"}
    assert {key: variant(*key) for key in defaults} == defaults
    assert variant(4, 256, PACKED_V2_TILES._replace(gate_up_block_w=32, down_block_w=32)) == "v2"  # the tiles'
    monkeypatch.setenv("TIERLM_PACKED_MOE_VARIANT", "v2")
    assert (variant(4, 32), variant(8, 32)) == ("v2", "v1")
    monkeypatch.setenv("TIERLM_PACKED_MOE_VARIANT", "v1")
    assert variant(4, 128) == "v1"
    monkeypatch.setenv("TIERLM_PACKED_MOE_VARIANT", "v3")
    with pytest.raises(ValueError, match="choose one of v1, v2"):
        variant(4, 32)
    # early weights: v1 at every group, v2 from g128, neither under TIERLM_NO_EARLY_EXPERT_WEIGHTS=1
    monkeypatch.delenv("TIERLM_NO_EARLY_EXPERT_WEIGHTS", raising=False)
    assert [packed_early(*key) for key in (("v1", 32), ("v2", 32), ("v2", 128))] == [True, False, True]
    monkeypatch.setenv("TIERLM_NO_EARLY_EXPERT_WEIGHTS", "1")
    assert not packed_early("v1", 32) and not packed_early("v2", 128)
    # 8 and 4 words a tile: 2 and 1 groups of 32 INT4 values; H = 256: 32 words, in 2 x 8 a v2 program
    tiles = PackedDecodeTiles(16, 8, 4, 64, 4, 4, gate_up_chunks=2)
    args = (1, 256, 64, 2, 4, 32, tiles, 1, SharedShape(0, 0, 0, 0, 0), "bf16", "ieee")
    assert _packed_launch(*args, "v2", True).constants["GU_SPLITS"] == 2
    with pytest.raises(ValueError, match="v1 reads one tile a program"):
        _packed_launch(*args, "v1", True)
    assert _packed_launch(*args[:6], tiles._replace(gate_up_chunks=1), *args[7:], "v1", True).constants["GU_SPLITS"] == 4
    with pytest.raises(ValueError, match="whole groups of 16 words"):
        _packed_launch(*args[:5], 128, *args[6:], "v2", True)  # 8 words: half a group of 128
    assert _packed_launch(*args[:6], tiles._replace(gate_up_block_w=12, gate_up_chunks=1), *args[7:], "v1", True)
    with pytest.raises(ValueError, match="gate_up_block_w 12 must be a power of two"):
        _packed_launch(*args[:6], tiles._replace(gate_up_block_w=12), *args[7:], "v2", True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("experts_format", ["bf16", "int4", "int4-v2"])
def test_dependent_launch_is_bit_identical_in_a_cuda_graph(monkeypatch, tokens, experts_format):
    """A decode chain GEMV -> router -> MoE -> GEMV -> router -> MoE (the router's and the MoE's input
    the GEMV's output, the MoE's experts and shared gate the router kernel's output, all launched with
    programmatic dependent launch), 64 experts of 1024 -> 256 top-8 with a shared expert (bf16 experts
    and a bf16 shared expert; INT4 g128 experts and an INT6 one: int4-mixed, beside them at 4 tokens),
    captured with PDL and without (TIERLM_NO_PDL=1): 16 replays on new inputs, so new routing, give
    bit-identical outputs, equal to eager calls (a program that read its input, or which expert it runs,
    before the kernel that writes it has finished would race it: the packed form's items read the
    router's output before their own wait, `packed_decode`'s early weights)."""
    from test_quant_linear_kernel import replay_with_and_without_pdl

    from tierlm.kernels.fused_moe.triton import fused_moe
    from tierlm.kernels.moe_router.triton import route_and_gate
    from tierlm.kernels.quant_linear.triton import quant_linear

    if experts_format.startswith("int4"):  # the packed form's K loop (`packed_decode.packed_variant`)
        monkeypatch.setenv("TIERLM_PACKED_MOE_VARIANT", "v2" if experts_format == "int4-v2" else "v1")
    experts, hidden, inter, top_k = 64, 1024, 256, 8
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5

    gate_up, down = weight(experts, 2 * inter, hidden), weight(experts, hidden, inter)
    shared_gate_up, shared_down = weight(2 * inter, hidden), weight(hidden, inter)
    projection = weight(hidden, hidden).bfloat16()
    router = weight(experts + 1, hidden).bfloat16()  # (the experts' rows, then the shared gate's)
    x = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    shared_gate = torch.empty(tokens, 1, device="cuda", dtype=torch.bfloat16)  # (replaced by the router's)
    if experts_format == "bf16":
        args, kwargs = (gate_up.bfloat16(), down.bfloat16()), {}
        shared = naive.SharedExpert(shared_gate, shared_gate_up.bfloat16(), shared_down.bfloat16())
    else:
        (gu, gu_scales), (dn, dn_scales) = (packing.quantize(w, 4, 128) for w in (gate_up, down))
        args = (gu, dn)
        kwargs = {"format": "int4", "scales": (gu_scales.bfloat16(), dn_scales.bfloat16()), "group_size": 128}
        (sgu, sgu_scales), (sdn, sdn_scales) = (packing.quantize(w, 6, 32) for w in (shared_gate_up, shared_down))
        shared = naive.SharedExpert(shared_gate, sgu, sdn, "int6", (sgu_scales.bfloat16(), sdn_scales.bfloat16()))

    def step():
        y = x
        for _ in range(2):
            h = quant_linear(y, projection)
            routing, ids, gate = route_and_gate(h, router, top_k, True)
            y = fused_moe(h, *args, routing, ids, **kwargs, shared=shared._replace(gate=gate))
        return y

    def set_inputs(i):
        x.copy_(torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(100 + i)))

    with_pdl, without = replay_with_and_without_pdl(monkeypatch, step, set_inputs)
    for i, (a, b) in enumerate(zip(with_pdl, without)):
        set_inputs(i)
        assert torch.equal(a, b) and torch.equal(a, step()), f"replay {i}"
        assert a.abs().max() > 0
