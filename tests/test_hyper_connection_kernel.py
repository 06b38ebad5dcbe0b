"""kernels/hyper_connection: mix (two launches) and combine (one) against the torch reference, under
TRITON_INTERPRET=1 on CPU at small shapes (compiled on a GPU, where the real widths run too, inside a CUDA
graph, and the whole model runs with the fused router and hyper-connections against the unfused path).

Tolerances. fp32: the kernel sums the same products in another order, and applies each stream's 1/rms
after the down projection instead of before (the norm is linear once the rms is known): a few fp32 ulps.
bf16: the fp32 reference on the same (bf16-valued) inputs is the truth, and the kernel may be off by at
most FACTOR x the reference's own bf16 error plus half a bf16 ulp of the row's largest value (as in
test_bf16_parity). combine rounds exactly where the reference does: in bf16 equal bit for bit; in fp32
within one rounding (the compiler may fuse the multiply and the add). combine_and_mix (combine folded into
the mix's first launch) is held to the mix's tolerances on all three outputs.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.hyper_connection import naive
from tierlm.kernels.quant_linear.packing import quantize

FACTOR = 2.0
EPS = 1e-6
# 2 token blocks; the interpreted child's tiles cover H and r unevenly
SMALL = {"tokens": 20, "hc": 4, "hidden": 48, "lowrank": 24}
REAL = {"hc": 4, "hidden": 2560, "lowrank": 320}


def inputs(tokens: int, hc: int, hidden: int, lowrank: int, with_inject: bool, seed: int = 0):
    """(streams, norm weight, down|inject weight, up weight) in fp32, each stream at its own scale."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(tokens, hc, 1, generator=gen) * 4 + 0.25
    streams = (torch.randn(tokens, hc, hidden, generator=gen) * scales).flatten(1)
    norm = torch.randn(hc * hidden, generator=gen) * 0.2
    down = torch.randn(lowrank + (hc if with_inject else 0), hc * hidden, generator=gen) * (4 / (hc * hidden) ** 0.5)
    up = torch.randn(hc * hidden, lowrank, generator=gen) * (2 / lowrank**0.5)
    return streams, norm, down, up


def assert_within_reference_error(ours, theirs, reference, what: str) -> None:
    ours_error = (ours.float() - reference).abs().amax(dim=-1)
    their_error = (theirs.float() - reference).abs().amax(dim=-1)
    _, exponent = torch.frexp(reference.abs().amax(dim=-1))
    floor = torch.ldexp(torch.ones_like(ours_error), exponent - 8) / 2
    worse = ours_error > FACTOR * their_error + floor
    assert not worse.any(), (
        f"{what}: kernel off by {ours_error.max().item():.3g}, reference bf16 {their_error.max().item():.3g}"
    )


def int8_inputs(tokens: int, hc: int, hidden: int, lowrank: int, seed: int = 0):
    """`inputs` with injection, the down|inject and up weights INT8 per channel (packed words, scales):
    (streams, norm, down words, up words, down scales, up scales)."""
    streams, norm, down, up = inputs(tokens, hc, hidden, lowrank, True, seed)
    (down_words, down_scales), (up_words, up_scales) = (quantize(w, 8, w.shape[1]) for w in (down, up))
    return streams, norm, down_words, up_words, down_scales, up_scales


def check_mix(device: str, hc: int, args, what: str) -> None:
    """kernels.mix against naive.mix on args (streams, norm, down, up[, down scale, up scale]): in fp32
    within a few ulps; in bf16 (floats rounded to bf16, packed words as they are) within FACTOR x the
    reference's own bf16 error of the fp32 truth."""
    from tierlm.kernels.hyper_connection import triton as kernels

    def run(mix, tensors, dtype, where="cpu"):
        cast = [t.to(where, dtype if t.is_floating_point() else t.dtype) for t in tensors]
        return mix(*cast[:4], hc, EPS, *cast[4:])

    expected, got = run(naive.mix, args, torch.float32), run(kernels.mix, args, torch.float32, device)
    with_inject = expected[1] is not None
    assert (got[1] is None) == (not with_inject)
    torch.testing.assert_close(got[0].cpu(), expected[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    if with_inject:
        torch.testing.assert_close(got[1].cpu(), expected[1], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")

    as_bf16 = [t.bfloat16() if t.is_floating_point() else t for t in args]
    truth, theirs = run(naive.mix, as_bf16, torch.float32), run(naive.mix, as_bf16, torch.bfloat16)
    got = run(kernels.mix, as_bf16, torch.bfloat16, device)
    assert got[0].dtype == torch.bfloat16
    assert_within_reference_error(got[0].cpu(), theirs[0], truth[0], f"{what}, bf16 block input")
    if with_inject:
        assert_within_reference_error(got[1].cpu(), theirs[1], truth[1], f"{what}, bf16 injection gates")


def check_combine_and_mix(device: str, tokens: int, hc: int, hidden: int, lowrank: int) -> None:
    """kernels.combine_and_mix (the down programs add the previous block's output as they read the streams)
    against naive.combine_and_mix: every output within a few ulps in fp32, within FACTOR x the reference's
    own bf16 error in bf16."""
    from tierlm.kernels.hyper_connection import triton as kernels

    streams, norm, down, up = inputs(tokens, hc, hidden, lowrank, True, seed=2)
    gen = torch.Generator().manual_seed(3)
    args = (streams, torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, hc, generator=gen) * 2, norm,
            down, up)

    def run(fn, tensors, dtype, where="cpu"):
        return fn(*(t.to(where, dtype) for t in tensors), hc, EPS)

    expected, got = run(naive.combine_and_mix, args, torch.float32), run(kernels.combine_and_mix, args,
                                                                       torch.float32, device)
    for name, ours, theirs in zip(("streams", "block input", "injection gates"), got, expected):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    as_bf16 = [t.bfloat16() for t in args]
    truth, theirs = run(naive.combine_and_mix, as_bf16, torch.float32), run(naive.combine_and_mix, as_bf16,
                                                                           torch.bfloat16)
    got = run(kernels.combine_and_mix, as_bf16, torch.bfloat16, device)
    for name, ours, their, true in zip(("streams", "block input", "injection gates"), got, theirs, truth):
        assert_within_reference_error(ours.cpu(), their, true, f"bf16 combine_and_mix, {name}")


def compare(device: str, tokens: int, hc: int, hidden: int, lowrank: int) -> None:
    from tierlm.kernels.hyper_connection import triton as kernels

    for with_inject in (True, False):
        check_mix(device, hc, inputs(tokens, hc, hidden, lowrank, with_inject, seed=tokens),
                  f"dense, inject {with_inject}")
    check_combine_and_mix(device, tokens, hc, hidden, lowrank)

    gen = torch.Generator().manual_seed(1)
    streams = inputs(tokens, hc, hidden, lowrank, True)[0]
    block_output, inject = torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, hc, generator=gen) * 2
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in (streams, block_output, inject)]
        # the block output a row of a wider buffer (the kernel reads rows in place)
        wide = torch.zeros(tokens, hidden + 8, dtype=dtype)
        wide[:, :hidden] = args[1]
        got = kernels.combine(args[0].to(device), wide.to(device)[:, :hidden], args[2].to(device)).cpu()
        if dtype == torch.bfloat16:  # the kernel rounds once (fp32 inside); the reference after every op
            truth = naive.combine(*(t.float() for t in args))
            assert_within_reference_error(got, naive.combine(*args), truth, "bf16 combine")
        else:
            torch.testing.assert_close(got, naive.combine(*args), rtol=2**-23, atol=1e-6)


def test_kernels_match_reference():
    def on_cuda():
        compare("cuda", **SMALL)
        compare("cuda", **dict(SMALL, tokens=1))
        compare("cuda", **dict(SMALL, tokens=2))  # MIX_TILES' own entry for two tokens
        check_mix("cuda", SMALL["hc"], int8_inputs(**dict(SMALL, tokens=3)), "int8")

    on_cuda_else_interpreted(on_cuda, INTERPRETED_EARLY, "test_kernels_match_reference")


INTERPRETED_EARLY = {  # (a child: started when collection ends, see tests/interpreted.py)
    # small tiles: several slices per stream, row blocks and column blocks, uneven; tl.dot at 20 tokens (two
    # token blocks), the broadcast form at 1 token (through combine_and_mix) and at 3 (one block of 4) with
    # INT8 mixers (tl.dot over INT8: the GPU tests)
    "test_kernels_match_reference": ((
        "import tierlm.kernels.hyper_connection.triton as k\n"
        "k.MIX_TILES = ((1, k.MixTiles(1, 16, 16, 4, 8, 4)), (4, k.MixTiles(4, 16, 16, 4, 8, 4)),\n"
        "               (k.MAX_TOKENS, k.MixTiles(16, 16, 16, 4, 16, 4)))\n"
        "import test_hyper_connection_kernel as t; t.compare('cpu', **t.SMALL)\n"
        "t.check_combine_and_mix('cpu', **dict(t.SMALL, tokens=1))\n"
        "t.check_mix('cpu', t.SMALL['hc'], t.int8_inputs(**dict(t.SMALL, tokens=3)), 'int8')\n"
        # hc 3: the GEMV form's up tile holds hc x BLOCK_H rows padded to a power of 2 of streams (masked)
        "t.check_mix('cpu', 3, t.inputs(3, 3, 48, 24, True, seed=7), 'hc 3')\n"
        # up_finish: the up programs sum the down projection's slices (4 at 1 token: a whole stream a slice;
        # 12 at 2-4 tokens, uneven) and apply the activations; column block 0's store the injection gates
        "k.MIX_TILES = ((1, k.MixTiles(1, 16, 64, 4, 8, 4, True)), (4, k.MixTiles(4, 8, 16, 4, 16, 4, True)))\n"
        "t.compare('cpu', **dict(t.SMALL, tokens=1))\n"
        "t.check_mix('cpu', t.SMALL['hc'], t.int8_inputs(**dict(t.SMALL, tokens=3)), 'int8, up_finish')\n"
        "t.check_mix('cpu', 3, t.int8_inputs(1, 3, 48, 24, seed=7), 'hc 3, int8, up_finish')"),),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layer(dtype):
    """HyperConnection.mix / combine / combine_and_mix (what the CPU runs) are the reference, for dense
    weights."""
    from tierlm.model.layers.hyper_connection import HyperConnection

    hc, hidden, lowrank = 4, 32, 8
    for with_inject in (True, False):
        layer = HyperConnection(hidden, hc, lowrank, EPS, with_inject).to(dtype)
        streams, norm, down, up = (t.to(dtype) for t in inputs(3, hc, hidden, lowrank, with_inject))
        layer.hc_norm.weight.data.copy_(norm)
        layer.down_and_inject.weight.data.copy_(down)
        layer.input_mix_weight_up.weight.data.copy_(up)
        got, expected = layer.mix(streams), naive.mix(streams, norm, down, up, hc, EPS)
        assert torch.equal(got[0], expected[0])
        assert (got[1] is None and expected[1] is None) or torch.equal(got[1], expected[1])
    block_output, inject = torch.randn(3, hidden).to(dtype), torch.rand(3, hc).to(dtype)
    assert torch.equal(HyperConnection.combine(streams, block_output, inject),
                       naive.combine(streams, block_output, inject))
    got = layer.combine_and_mix(streams, block_output, inject)
    expected = naive.combine_and_mix(streams, block_output, inject, norm, down, up, hc, EPS)
    assert all(torch.equal(g, e) for g, e in zip(got[:2], expected[:2])) and got[2] is expected[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_mixer_reference_is_the_layer(dtype):
    """With its mixer weights INT8 per channel (as the int4-mixed scheme stores them) the layer hands the
    kernels its packed words and scales, and its torch path (what the CPU runs) is naive.mix on them."""
    from tierlm.model.layers.hyper_connection import HyperConnection, kernel_weight
    from tierlm.model.quantization.compressed_tensors import PackQuantizedFormat

    hc, hidden, lowrank = 4, 32, 8
    streams, norm, down_words, up_words, down_scales, up_scales = int8_inputs(3, hc, hidden, lowrank)
    layer = HyperConnection(hidden, hc, lowrank, EPS, True)
    for linear, words, scales in ((layer.down_and_inject, down_words, down_scales),
                                  (layer.input_mix_weight_up, up_words, up_scales)):
        linear.set_format(PackQuantizedFormat(8, None))
        linear.to(dtype)
        linear.weight_packed.data.copy_(words)
        linear.weight_scale.data.copy_(scales)
        packed = kernel_weight(linear)
        assert packed[0] is linear.weight_packed and packed[1] is linear.weight_scale
    layer.hc_norm.to(dtype).weight.data.copy_(norm)
    streams = streams.to(dtype)
    got = layer.mix(streams)
    expected = naive.mix(streams, norm.to(dtype), down_words, up_words, hc, EPS, layer.down_and_inject.weight_scale,
                         layer.input_mix_weight_up.weight_scale)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_shapes_are_named():
    streams, norm, down, up = inputs(2, 4, 8, 4, True)
    with pytest.raises(ValueError, match="weights must be"):
        naive.mix(streams, norm, down[:, :-1], up, 4, EPS)
    with pytest.raises(ValueError, match="hc = 3"):
        naive.mix(streams[:, :-1], norm, down, up, 3, EPS)
    pytest.importorskip("triton")
    from tierlm.kernels.hyper_connection.triton import MixTiles, check_tiles

    with pytest.raises(ValueError, match="at least 16 and no up_finish when block_n is"):
        check_tiles(MixTiles(16, 8, 512, 4, 16, 4), False)  # (tl.dot over 8 rows)
    with pytest.raises(ValueError, match="no up_finish when block_n is"):
        check_tiles(MixTiles(16, 16, 512, 4, 16, 4, True), False)  # (the GEMV form only)
    check_tiles(MixTiles(4, 8, 512, 4, 16, 4, True), True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_kernels_at_real_widths_on_gpu(tokens):
    compare("cuda", tokens=tokens, **REAL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_int8_kernels_at_real_widths_on_gpu(tokens):
    check_mix("cuda", REAL["hc"], int8_inputs(tokens, **REAL, seed=tokens), "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("up_finish", [False, True])
def test_one_token_tiles_at_real_widths_on_gpu(monkeypatch, up_finish):
    """One token with the down projection finished by the down launch's last programs and by every up
    program, whichever MIX_TILES picks: dense and INT8 mixers, with and without injection, combine_and_mix."""
    from tierlm.kernels.hyper_connection import triton as kernels

    tiles = kernels.mix_tiles(1)._replace(up_finish=up_finish)
    if not up_finish:
        tiles = tiles._replace(block_k=min(tiles.block_k, 512))
    monkeypatch.setattr(kernels, "MIX_TILES", ((1, tiles),))
    compare("cuda", tokens=1, **REAL)
    check_mix("cuda", REAL["hc"], int8_inputs(1, **REAL, seed=5), "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mix_replays_in_a_cuda_graph():
    from tierlm.kernels.hyper_connection import triton as kernels

    streams, norm, down, up = (t.cuda().bfloat16() for t in inputs(4, **REAL, with_inject=True))
    kernels.mix(streams, norm, down, up, REAL["hc"], EPS)  # counters made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.mix(streams, norm, down, up, REAL["hc"], EPS)
    for seed in range(3):
        streams.copy_(inputs(4, **REAL, with_inject=True, seed=10 + seed)[0])
        graph.replay()
        eager = kernels.mix(streams, norm, down, up, REAL["hc"], EPS)
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_model_matches_unfused_on_gpu(tmp_path, monkeypatch):
    """The tiny reference model in fp32 on the GPU: a prefill, then decode steps (eager, and replayed from
    CUDA graphs) give the same logits with the fused router, hyper-connections and PLE as without them."""
    from reference_models import build_reference

    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.loader import load_model
    from tierlm.model.model_cache import ModelCache
    from tierlm.model.static_decode import StaticDecodeRunner

    build_reference("hc4_ple", tmp_path)
    model, config = load_model(tmp_path, dtype="float32", device="cuda")
    block, width, requests = 8, 16, 3
    tables = [list(range(i * width, (i + 1) * width)) for i in range(requests)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in (21, 5, 12)]
    steps = [[int(t) for t in torch.randint(2, config.vocab_size, (requests,), generator=gen)] for _ in range(6)]

    def run(fused: bool, mode: str) -> list[torch.Tensor]:
        for name in ("TIERLM_NO_FUSED_ROUTER", "TIERLM_NO_FUSED_HC", "TIERLM_NO_FUSED_PLE"):
            if fused:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, "1")
        cache = ModelCache(config, requests, requests * width, block, torch.float32, "cuda")
        for slot in range(requests):
            cache.reset_slot(slot)
        batch = ForwardBatch.build(prompts, [0] * requests, list(range(requests)), tables, block, device="cuda")
        logits = [model(batch, cache)]
        runner = StaticDecodeRunner(model, cache, requests, width, mode)
        for i, tokens in enumerate(steps):
            positions = [len(p) + i for p in prompts]
            batch = ForwardBatch.build([[t] for t in tokens], positions, list(range(requests)), tables, block,
                                       device="cuda")
            logits.append(runner.run(batch).clone())
        return logits

    for mode in ("eager", "cuda_graph"):
        for fused, unfused in zip(run(True, mode), run(False, mode)):
            torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-4)
