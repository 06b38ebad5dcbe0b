"""kernels/moe_router: the two-launch router (GEMV; softmax, top-k, renormalisation, shared gate) against
the torch reference, under TRITON_INTERPRET=1 on CPU at small shapes (compiled on a GPU, where the real
widths run too, and the kernel runs inside a CUDA graph).

Tolerances. fp32: both forms sum the same fp32 products in another order, so weights and gates agree to
a few fp32 ulps and the choices are the same (the inputs have clear top-k margins, asserted). bf16: as in
test_bf16_parity, the fp32 reference on the same (bf16-valued) inputs is the truth; the kernel's error
may be at most FACTOR x the reference's own bf16 error plus half a bf16 ulp of the row's largest value
(the last rounding may land on the neighbouring value), row by row.

Ties: `exact_tie_inputs` makes logits that every summation order computes exactly (small integers over
8), so many experts tie; the kernel must take, among equal probabilities, the lower expert ids: the
set CUDA's torch.topk returns (checked on the GPU), and a valid top-k of the reference's values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.moe_router import naive

FACTOR = 2.0
SMALL = {"tokens": 20, "hidden": 80, "experts": 40, "top_k": 6}  # 2 token blocks, 3 row blocks
REAL = {"hidden": 2560, "experts": 512, "top_k": 10}


def random_inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype, seed: int = 0, top_k: int = 10):
    """Random x and a router weight solved (least squares) so that each token's logits are 4.0, 3.75, ...
    on top_k + 1 random experts and about N(-1, 0.5^2) elsewhere: clear top-k margins (0.25 and more),
    whatever the seed. The gate row is random."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    logits = torch.randn(tokens, experts, generator=gen, dtype=torch.float64) * 0.5 - 1
    for row in logits:
        row[torch.randperm(experts, generator=gen)[: top_k + 1]] = 4.0 - 0.25 * torch.arange(top_k + 1.0).double()
    router = (torch.linalg.pinv(x) @ logits).T
    gate = torch.randn(1, hidden, generator=gen, dtype=torch.float64) / hidden**0.5
    return x.to(dtype), torch.cat([router, gate]).to(dtype)


def exact_tie_inputs(tokens: int, hidden: int, experts: int, seed: int = 0):
    """x in {-1, 0, 1}, weight in {-1, 0, 1} / 8 over at most 64 nonzero columns: every logit is an
    integer / 8 of magnitude <= 8, exact in bf16 and in any summation order; many experts tie."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (tokens, hidden), generator=gen).float()
    x[:, 64:] = 0
    weight = torch.randint(-1, 2, (experts + 1, hidden), generator=gen).float() / 8
    return x, weight


def lower_id_top_k(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """The expert ids the tie rule takes: probabilities descending, equal ones in ascending id."""
    probs = torch.softmax(F.linear(x.float(), weight.float())[:, :-1], dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


def assert_clear_margins(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> None:
    """The k-th and (k+1)-th fp32 logits of every token differ by far more than any rounding: the choice is
    unambiguous in fp32 and in bf16."""
    ranked = F.linear(x.float(), weight.float())[:, :-1].sort(dim=-1, descending=True).values
    gap = ranked[:, top_k - 1] - ranked[:, top_k]
    assert (gap > 0.1).all(), f"near-tie (gap {gap.min().item():.3g})"


def assert_within_reference_error(ours, theirs, reference, what: str) -> None:
    ours_error = (ours.float() - reference).abs().amax(dim=-1)
    their_error = (theirs.float() - reference).abs().amax(dim=-1)
    _, exponent = torch.frexp(reference.abs().amax(dim=-1))
    floor = torch.ldexp(torch.ones_like(ours_error), exponent - 8) / 2
    worse = ours_error > FACTOR * their_error + floor
    assert not worse.any(), (
        f"{what}: kernel off by {ours_error.max().item():.3g}, reference bf16 {their_error.max().item():.3g}"
    )


def compare(device: str, tokens: int, hidden: int, experts: int, top_k: int, seed: int = 1) -> None:
    from tierlm.kernels.moe_router.triton import route_and_gate

    for renormalize in (True, False):
        x, weight = random_inputs(tokens, hidden, experts, torch.float32, seed, top_k)
        assert_clear_margins(x, weight, top_k)
        truth = naive.route_and_gate(x, weight, top_k, renormalize)
        got = [t.cpu() for t in route_and_gate(x.to(device), weight.to(device), top_k, renormalize)]
        assert torch.equal(got[1], truth[1])
        torch.testing.assert_close(got[0], truth[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[2], truth[2], rtol=1e-5, atol=1e-7)

        xb, wb = x.bfloat16(), weight.bfloat16()
        truth = naive.route_and_gate(xb.float(), wb.float(), top_k, renormalize)  # fp32 on bf16-valued inputs
        theirs = naive.route_and_gate(xb, wb, top_k, renormalize)
        got = [t.cpu() for t in route_and_gate(xb.to(device), wb.to(device), top_k, renormalize)]
        assert got[0].dtype == got[2].dtype == torch.bfloat16 and got[1].dtype == torch.int64
        assert torch.equal(got[1], truth[1]) and torch.equal(theirs[1], truth[1])
        assert_within_reference_error(got[0], theirs[0], truth[0], "bf16 routing weights")
        assert_within_reference_error(got[2], theirs[2], truth[2], "bf16 shared gate")


def compare_ties(device: str, tokens: int, hidden: int, experts: int, top_k: int) -> None:
    from tierlm.kernels.moe_router.triton import route_and_gate

    x, weight = exact_tie_inputs(tokens, hidden, experts)
    logits = F.linear(x, weight)[:, :-1]
    kth = logits.sort(dim=-1, descending=True).values[:, top_k - 1]
    assert ((logits == kth[:, None]).sum(-1) > 1).sum() >= tokens // 2  # ties at the k-th place are common
    expected = lower_id_top_k(x, weight, top_k)
    for dtype in (torch.float32, torch.bfloat16):
        weights, ids, _ = route_and_gate(x.to(device, dtype), weight.to(device, dtype), top_k, True)
        assert torch.equal(ids.cpu(), expected)  # the order too: descending, equal ones by ascending id
        reference = naive.route_and_gate(x.to(dtype), weight.to(dtype), top_k, True)
        # a valid top-k: the same values in the same order (to fp32 roundoff; in bf16 the last rounding may
        # land on the neighbouring value)
        torch.testing.assert_close(weights.cpu(), reference[0], rtol=1e-5 if dtype == torch.float32 else 2**-8,
                                   atol=0)
        if device == "cuda":  # CUDA's torch.topk takes the same set
            cuda_ids = torch.topk(torch.softmax(F.linear(x, weight).cuda()[:, :-1], -1), top_k).indices
            assert torch.equal(cuda_ids.sort(-1).values.cpu(), expected.sort(-1).values)


def interpreted_case(function: str) -> tuple[str]:
    """A child running `function` of this module at SMALL, with small tiles so the small shapes take
    several K slices (the last one part-full)."""
    args = ", ".join(f"{k}={v}" for k, v in SMALL.items())
    return (("import tierlm.kernels.moe_router.triton as k; k.BLOCK_K = 32\n"
             f"import test_moe_router_kernel as t; t.{function}('cpu', {args})"),)


INTERPRETED_EARLY = {  # (queued when collection ends, see tests/interpreted.py)
    "test_kernel_matches_reference": interpreted_case("compare"),
    "test_kernel_breaks_ties_towards_lower_ids": interpreted_case("compare_ties"),
}


def test_kernel_matches_reference():
    on_cuda_else_interpreted(lambda: compare("cuda", **SMALL), INTERPRETED_EARLY, "test_kernel_matches_reference")


def test_kernel_breaks_ties_towards_lower_ids():
    on_cuda_else_interpreted(lambda: compare_ties("cuda", **SMALL), INTERPRETED_EARLY,
                             "test_kernel_breaks_ties_towards_lower_ids")


def test_reference_is_the_layer_router():
    """SparseMoeBlock.route (what the CPU runs) is the reference, for a dense router weight."""
    from reference_models import BASE

    from tierlm.config import ModelConfig
    from tierlm.model.layers.moe import SparseMoeBlock

    config = ModelConfig.from_dict({**BASE, "num_experts": 16, "num_experts_per_tok": 3})
    block = SparseMoeBlock(config)
    x, weight = random_inputs(5, config.hidden_size, 16, torch.float32, top_k=3)
    block.router.weight.data.copy_(weight)
    for got, expected in zip(block.route(x), naive.route_and_gate(x, weight, 3, True)):
        assert torch.equal(got, expected)


def test_bad_arguments_are_named():
    x, weight = random_inputs(2, 8, 4, torch.float32, top_k=2)
    with pytest.raises(ValueError, match="top_k 5"):
        naive.route_and_gate(x, weight, 5, True)
    with pytest.raises(ValueError, match="must be"):
        naive.route_and_gate(x[:, :4], weight, 2, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("tokens", [1, 4, 16, 64])
def test_kernel_at_real_widths_on_gpu(tokens):
    compare("cuda", tokens=tokens, seed=tokens, **REAL)
    compare_ties("cuda", tokens=tokens, **REAL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_replays_in_a_cuda_graph():
    """Replays of the captured launches (and launches after them) route as eager launches do."""
    from tierlm.kernels.moe_router.triton import route_and_gate

    x, weight = random_inputs(4, REAL["hidden"], REAL["experts"], torch.bfloat16)
    x, weight = x.cuda(), weight.cuda()
    static_x = x.clone()
    route_and_gate(static_x, weight, REAL["top_k"], True)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = route_and_gate(static_x, weight, REAL["top_k"], True)
    for seed in range(3):
        new_x, _ = random_inputs(4, REAL["hidden"], REAL["experts"], torch.bfloat16, seed=10 + seed)
        static_x.copy_(new_x)
        graph.replay()
        eager = route_and_gate(static_x, weight, REAL["top_k"], True)
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)
