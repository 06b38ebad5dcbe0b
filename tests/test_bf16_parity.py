"""tierlm in bf16 stays as close to transformers' fp32 results as transformers' own bf16 run does.

Every check runs transformers in fp32 (the reference) and in bf16 on the same input, and tierlm in bf16,
and asserts

    error(tierlm bf16) <= FACTOR * error(transformers bf16) + one bf16 ulp of the largest reference value

(error = max |x - reference|; the ulp floor is what rounding the output to bf16 alone may cost), so the
tolerance follows transformers' own bf16 error on that input, not a fixed number.

- The depthwise convolutions (GDN's and PLE's dilated one) against `F.conv1d`, error in ulps.
- The whole model, one config per layer kind (GDN, PLE, hyper-connections, QSA with its indexer), on each
  path: one prefill of two requests, uneven chunks of two requests, eager decode steps, and the static
  decode path (`StaticDecodeRunner` in mode "eager": the fixed-shape batches CUDA graphs replay and
  torch.compile compiles, without either). These configs make no top-k choice that bf16 rounding could
  flip: num_experts == num_experts_per_tok, and the QSA budget covers the whole context (the indexer
  scores and sorts, every block is kept).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference_models import BASE, Runner, build_reference, prompt_ids, reference_logits

from tierlm.model.layers.gated_deltanet import causal_depthwise_conv
from tierlm.model.loader import load_model

FACTOR = 2.0


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_within_reference_error(ours: torch.Tensor, theirs: torch.Tensor, reference: torch.Tensor, what: str):
    """ours, theirs: bf16 results of tierlm and transformers; reference: transformers' fp32 result."""
    ours_error = (ours.float() - reference).abs().max().item()
    their_error = (theirs.float() - reference).abs().max().item()
    floor = bf16_ulp(reference.abs().max()).item()
    assert ours_error <= FACTOR * their_error + floor, (
        f"{what}: tierlm bf16 is {ours_error:.3g} from fp32, transformers bf16 {their_error:.3g} (floor {floor:.3g})"
    )


# ---- the depthwise convolutions ------------------------------------------------------------------------


@pytest.mark.parametrize("dilation", [1, 3])  # GDN's conv, PLE's (dilation = ngram_size)
@pytest.mark.parametrize("steps", [1, 37])  # a decode step's window, a prefill chunk
def test_depthwise_conv_rounds_once_like_conv1d(dilation, steps):
    """Error in ulps of the exact result: `F.conv1d` rounds once (<= 0.5 ulp); rounding every tap x weight
    product before the sum is off by hundreds of ulps where the products cancel."""
    gen = torch.Generator().manual_seed(dilation * 100 + steps)
    channels, kernel = 96, 4
    window = torch.randn(3, channels, (kernel - 1) * dilation + steps, generator=gen).bfloat16()
    weight = (torch.rand(channels, kernel, generator=gen) - 0.5).bfloat16()
    exact = F.conv1d(window.double(), weight.double()[:, None], dilation=dilation, groups=channels)
    theirs = F.conv1d(window, weight[:, None], dilation=dilation, groups=channels)
    ours = causal_depthwise_conv(window, weight, dilation)
    assert ours.dtype == torch.bfloat16 and ours.shape == exact.shape

    def ulps(x: torch.Tensor) -> float:
        return ((x.double() - exact).abs() / bf16_ulp(exact).double()).max().item()

    assert ulps(ours) <= FACTOR * ulps(theirs), (ulps(ours), ulps(theirs))


# ---- the whole model, per layer kind and path ----------------------------------------------------------

NO_CHOICE = {"num_experts": 2, "num_experts_per_tok": 2, "ple_layer_ids": None, "hc_count": 2}
LAYER_KIND_CONFIGS = {
    "gdn": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 4, "linear_num_value_heads": 4},
    "ple": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 3, "num_hidden_layers": 3,
            "ple_layer_ids": [1, 2, 3]},
    "hyper_connections": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 2, "num_hidden_layers": 2,
                          "hc_count": 4, "hc_lowrank": 48},
    "qsa": {**BASE, **NO_CHOICE, "layer_types": ["indexed_attention"] * 3, "num_hidden_layers": 3,
            "indexer_budget": 64},
}
PROMPT, STEPS = 16, 24  # decode paths: prefill PROMPT tokens, then STEPS single-token steps
LENGTH = PROMPT + STEPS
CHUNKS = ((5, 1, 13, 2, 19), (11, 3, 1, 17, 8))  # uneven chunks of the two requests, one forward per column


@pytest.fixture(scope="module", params=sorted(LAYER_KIND_CONFIGS))
def layer_kind(request, tmp_path_factory):
    """(tierlm bf16 model, its config, ids [2, LENGTH], transformers' fp32 and bf16 logits) of one config."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(LAYER_KIND_CONFIGS[request.param], folder)
    model, config = load_model(folder, dtype="bfloat16", device="cpu")
    ids = prompt_ids(config, 2, LENGTH, seed=5)
    reference_fp32 = reference_logits(reference, ids)
    reference_bf16 = reference_logits(copy.deepcopy(reference).to(torch.bfloat16), ids)
    return model, config, ids, reference_fp32, reference_bf16


def full_prefill(model, config, ids):
    runner = Runner(model, config, 2, torch.bfloat16)
    out = runner.step({0: ids[0].tolist(), 1: ids[1].tolist()})
    return torch.stack([out[0], out[1]])


def chunked_prefill(model, config, ids):
    runner = Runner(model, config, 2, torch.bfloat16)
    pieces, starts = ([], []), [0, 0]
    for sizes in zip(*CHUNKS):
        chunks = {r: ids[r, starts[r] : starts[r] + sizes[r]].tolist() for r in (0, 1)}
        for r, logits in runner.step(chunks).items():
            pieces[r].append(logits)
            starts[r] += sizes[r]
    assert starts == [LENGTH, LENGTH]
    return torch.stack([torch.cat(pieces[0]), torch.cat(pieces[1])])


def decode_steps(static_mode):
    def run(model, config, ids):
        runner = Runner(model, config, 2, torch.bfloat16, static_mode=static_mode)
        prefill = runner.step({0: ids[0, :PROMPT].tolist(), 1: ids[1, :PROMPT].tolist()})
        pieces = ([prefill[0]], [prefill[1]])
        for t in range(PROMPT, LENGTH):
            for r, logits in runner.step({0: [int(ids[0, t])], 1: [int(ids[1, t])]}).items():
                pieces[r].append(logits)
        return torch.stack([torch.cat(pieces[0]), torch.cat(pieces[1])])

    return run


PATHS = {
    "full_prefill": full_prefill,
    "chunked_prefill": chunked_prefill,
    "eager_decode": decode_steps(None),
    # the fixed-shape decode batches, run eagerly: the same code CUDA graphs capture, without a GPU
    "static_decode": decode_steps("eager"),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_model_bf16_within_transformers_bf16_error(layer_kind, path):
    model, config, ids, reference_fp32, reference_bf16 = layer_kind
    ours = PATHS[path](model, config, ids)
    assert ours.dtype == torch.bfloat16 and ours.shape == reference_fp32.shape
    assert_within_reference_error(ours, reference_bf16, reference_fp32, path)
