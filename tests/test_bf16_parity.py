"""tierlm in bf16 stays as close to transformers' fp32 results as transformers' own bf16 run does.

Every check runs transformers in fp32 (the reference) and in bf16 on the same input, and tierlm in bf16,
and asserts

    error(tierlm bf16) <= FACTOR * error(transformers bf16) + half a bf16 ulp of the largest reference value

row by row (a token's logits, a token's MoE output; error = max |x - reference| over the row; the floor
is what rounding the output to bf16 alone may cost), so the tolerance follows transformers' own bf16
error on that very input, not a fixed number. Measured here: tierlm's error is within 1.04x
transformers' plus the floor (on most rows, the same as transformers').

- The depthwise convolutions (GDN's and PLE's dilated one) against `F.conv1d`, error in ulps.
- The MoE block (routing choices made) in its three expert forms, on tokens with clear top-k margins.
- The whole model, one config per layer kind (GDN, PLE, hyper-connections, QSA with its indexer), on each
  path: one prefill of two requests, uneven chunks of two requests, eager decode steps, and the static
  decode path (`StaticDecodeRunner` in mode "eager": the fixed-shape batches CUDA graphs replay and
  torch.compile compiles, without either).

Top-k choices (QSA blocks, MoE experts) are where bf16 can legitimately differ: a near-tie at the k-th
place flips, and the logits after it differ by far more than rounding. The inputs are chosen so that no
choice is close, and each test asserts it (`assert_clear_margins`, and transformers' bf16 run choosing
as its fp32 run does): a flip fails loudly as a near-tie, never as a loose tolerance. Configs where a
layer kind other than MoE dominates have num_experts == num_experts_per_tok (no routing choice); the QSA
config's indexer choices are made in layer 0, where bf16 has had the least room to drift.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference_models import BASE, Runner, build_reference, prompt_ids, reference_logits

from tierlm.model.layers import moe
from tierlm.model.layers.gated_deltanet import causal_depthwise_conv
from tierlm.model.layers.qsa_attention import QSAIndexer
from tierlm.model.loader import load_model

FACTOR = 2.0


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at each |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_within_reference_error(ours: torch.Tensor, theirs: torch.Tensor, reference: torch.Tensor, what: str):
    """ours, theirs: bf16 results of tierlm and transformers; reference: transformers' fp32 result."""
    ours_error = (ours.float() - reference).abs().amax(dim=-1)
    their_error = (theirs.float() - reference).abs().amax(dim=-1)
    floor = bf16_ulp(reference.abs().amax(dim=-1)) / 2
    worse = ours_error > FACTOR * their_error + floor
    assert not worse.any(), (
        f"{what}: {int(worse.sum())} rows; at the worst, tierlm bf16 is {ours_error[worse].max().item():.3g} from "
        f"fp32 where transformers bf16 is {their_error[worse][ours_error[worse].argmax()].item():.3g}"
    )


class ChoiceRecorder:
    """Records what each top-k choice of tierlm's model is made on, in order: router probabilities (MoE)
    and indexer block scores (QSA; -inf for blocks not visible yet), each with its k."""

    def __init__(self, monkeypatch) -> None:
        self.records: list[tuple[torch.Tensor, int]] = []
        route, choose = moe.route, QSAIndexer.choose

        def recording_route(logits, top_k, renormalize):
            self.records.append((torch.softmax(logits, dim=-1, dtype=torch.float32), top_k))
            return route(logits, top_k, renormalize)

        def recording_choose(indexer, scores, positions):
            self.records.append((scores.float(), min(indexer.block_topk, scores.shape[1])))
            return choose(indexer, scores, positions)

        monkeypatch.setattr(moe, "route", recording_route)
        monkeypatch.setattr(QSAIndexer, "choose", recording_choose)

    def take(self) -> list[tuple[torch.Tensor, int]]:
        records, self.records = self.records, []
        return records


def assert_clear_margins(fp32_records, bf16_records) -> int:
    """No top-k choice of the bf16 run can differ from the fp32 run's: in every row with a choice, the gap
    between the k-th and (k+1)-th fp32 values exceeds twice the row's largest bf16-vs-fp32 difference, so
    no unchosen value can overtake a chosen one. Returns how many choices were checked."""
    assert len(fp32_records) == len(bf16_records)
    checked = 0
    for (reference, k), (values, _) in zip(fp32_records, bf16_records):
        visible = torch.isfinite(reference)
        assert torch.equal(visible, torch.isfinite(values))
        rows = visible.sum(dim=-1) > k  # rows that choose
        if not rows.any():
            continue
        ranked = reference.sort(dim=-1, descending=True).values
        gap = (ranked[:, k - 1] - ranked[:, k])[rows]
        drift = torch.where(visible, values - reference, 0).abs().amax(dim=-1)[rows]
        assert (gap > 2 * drift).all(), (
            f"near-tie at the k-th place (gap {gap.min().item():.3g}, bf16 drift up to {drift.max().item():.3g}): "
            "choose another seed"
        )
        checked += int(rows.sum())
    return checked


class ReferenceChoices:
    """The choices transformers' model makes in its forwards: each token's set of experts (ids sorted; top-k
    orders them by weight), indexer selection masks."""

    def __init__(self, model) -> None:
        from transformers.models.qwen4_exp.modeling_qwen4_exp import (
            Qwen4ExpTextQSAIndexer,
            Qwen4ExpTextTopKRouter,
        )

        self.choices: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, Qwen4ExpTextTopKRouter):
                module.register_forward_hook(lambda _m, _i, out: self.choices.append(out[2].sort(dim=-1).values))
            elif isinstance(module, Qwen4ExpTextQSAIndexer):
                module.register_forward_hook(lambda _m, _i, out: self.choices.append(out))


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
    "gdn": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 3, "num_hidden_layers": 3},
    "ple": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 2, "num_hidden_layers": 2,
            "ple_layer_ids": [1, 2]},
    "hyper_connections": {**BASE, **NO_CHOICE, "layer_types": ["linear_attention"] * 2, "num_hidden_layers": 2,
                          "hc_count": 4, "hc_lowrank": 48},
    # budget 8 of up to 7 blocks of 4 tokens: from position 11 on, each query keeps 2 blocks
    "qsa": {**BASE, **NO_CHOICE, "layer_types": ["indexed_attention", "linear_attention"], "num_hidden_layers": 2},
}
WEIGHT_SEED, PROMPT_SEED = 1, 3  # seeds where every QSA block choice is clear (asserted in each test)
PROMPT, STEPS = 12, 4  # decode paths: prefill PROMPT tokens, then STEPS single-token steps (a block closes)
LENGTH = PROMPT + STEPS
CHUNKS = ((5, 1, 7, 2, 1), (7, 3, 1, 4, 1))  # uneven chunks of the two requests, one forward per column


@pytest.fixture(scope="module", params=sorted(LAYER_KIND_CONFIGS))
def layer_kind(request, tmp_path_factory):
    """(tierlm's model in bf16 and fp32, its config, ids [2, LENGTH], transformers' fp32 and bf16 logits)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build_reference(LAYER_KIND_CONFIGS[request.param], folder, seed=WEIGHT_SEED)
    models = {torch.bfloat16: load_model(folder, dtype="bfloat16", device="cpu")[0]}
    models[torch.float32], config = load_model(folder, dtype="float32", device="cpu")
    ids = prompt_ids(config, 2, LENGTH, seed=PROMPT_SEED)
    reference_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    fp32_choices, bf16_choices = ReferenceChoices(reference), ReferenceChoices(reference_bf16)
    reference_fp32_logits, reference_bf16_logits = reference_logits(reference, ids), reference_logits(reference_bf16, ids)
    assert len(fp32_choices.choices) == len(bf16_choices.choices)
    assert all(torch.equal(a, b) for a, b in zip(fp32_choices.choices, bf16_choices.choices)), (
        "transformers' bf16 run chose other experts or blocks than its fp32 run: choose another seed"
    )
    return models, config, ids, reference_fp32_logits, reference_bf16_logits


def full_prefill(model, config, ids, dtype):
    runner = Runner(model, config, 2, dtype)
    out = runner.step({0: ids[0].tolist(), 1: ids[1].tolist()})
    return torch.stack([out[0], out[1]])


def chunked_prefill(model, config, ids, dtype):
    runner = Runner(model, config, 2, dtype)
    pieces, starts = ([], []), [0, 0]
    for sizes in zip(*CHUNKS):
        chunks = {r: ids[r, starts[r] : starts[r] + sizes[r]].tolist() for r in (0, 1)}
        for r, logits in runner.step(chunks).items():
            pieces[r].append(logits)
            starts[r] += sizes[r]
    assert starts == [LENGTH, LENGTH]
    return torch.stack([torch.cat(pieces[0]), torch.cat(pieces[1])])


def decode_steps(static_mode):
    def run(model, config, ids, dtype):
        runner = Runner(model, config, 2, dtype, static_mode=static_mode)
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
def test_model_bf16_within_transformers_bf16_error(layer_kind, path, monkeypatch):
    models, config, ids, reference_fp32, reference_bf16 = layer_kind
    recorder = ChoiceRecorder(monkeypatch)
    ours = PATHS[path](models[torch.bfloat16], config, ids, torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == reference_fp32.shape
    bf16_choices = recorder.take()
    if any(values.shape[-1] > k for values, k in bf16_choices):  # top-k choices here: the same run in fp32
        PATHS[path](models[torch.float32], config, ids, torch.float32)
        assert assert_clear_margins(recorder.take(), bf16_choices) > 0
    assert_within_reference_error(ours, reference_bf16, reference_fp32, path)


# ---- the MoE block, with routing choices ---------------------------------------------------------------

MOE_CONFIG = {**BASE, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 1,
              "layer_types": ["linear_attention"], "ple_layer_ids": None}
MOE_FORMS = {"grouped": (32, False), "per_pair": (8, False), "static": (32, True)}  # tokens, static


@pytest.fixture(scope="module", params=[True, False], ids=["renormalized", "softmax_weights"])
def moe_blocks(request, tmp_path_factory):
    """tierlm's MoE block in bf16, transformers' in fp32 and bf16 (same weights)."""
    folder = tmp_path_factory.mktemp("moe")
    reference = build_reference({**MOE_CONFIG, "norm_topk_prob": request.param}, folder, seed=WEIGHT_SEED)
    ours = load_model(folder, dtype="bfloat16", device="cpu")[0].model.layers[0].mlp
    theirs = reference.model.layers[0].mlp
    return ours, theirs, copy.deepcopy(theirs).to(torch.bfloat16)


def clear_routing_tokens(ours, theirs_fp32, theirs_bf16, count: int) -> torch.Tensor:
    """`count` bf16 tokens [count, H] whose top-k experts neither bf16 router can change: the gap between
    the k-th and (k+1)-th fp32 probabilities exceeds twice either router's bf16 drift (as in
    `assert_clear_margins`). Picked from random candidates, most of which must qualify."""
    candidates = torch.randn(8 * count, theirs_fp32.gate.hidden_dim, generator=torch.Generator().manual_seed(7))
    candidates = candidates.bfloat16()
    k = theirs_fp32.gate.top_k
    with torch.no_grad():
        reference = torch.softmax(theirs_fp32.gate(candidates.float())[0], dim=-1)
        bf16_runs = [torch.softmax(theirs_bf16.gate(candidates)[0], dim=-1, dtype=torch.float32),
                     torch.softmax(ours.router(candidates)[0], dim=-1, dtype=torch.float32)]
    ranked = reference.sort(dim=-1, descending=True).values
    gap = ranked[:, k - 1] - ranked[:, k]
    drift = torch.stack([(run - reference).abs().amax(dim=-1) for run in bf16_runs]).amax(dim=0)
    clear = gap > 2 * drift
    assert clear.float().mean() > 0.5, "the bf16 routers drift as far as most top-k margins"
    assert reference[clear][:count].topk(k).indices.unique().numel() >= 6  # the choices vary
    return candidates[clear][:count]


@pytest.mark.parametrize("form", sorted(MOE_FORMS))
def test_moe_block_bf16_within_transformers_bf16_error(moe_blocks, form):
    """The three expert forms: tokens grouped by expert (prefill), a loop over (token, expert) pairs (a
    small eager decode batch), the gathered batched product (static decode batches)."""
    ours, theirs_fp32, theirs_bf16 = moe_blocks
    count, static = MOE_FORMS[form]
    x = clear_routing_tokens(ours, theirs_fp32, theirs_bf16, count)
    with torch.no_grad():
        got = ours(x, static)
        reference = theirs_fp32(x.float()[None])[0]
        theirs = theirs_bf16(x[None])[0]
    assert got.dtype == torch.bfloat16 and got.shape == reference.shape
    assert_within_reference_error(got, theirs, reference, f"MoE {form}")
