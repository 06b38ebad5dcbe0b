"""engine/rejection_sampler.py: greedy verification gives exactly the tokens of decoding without drafts,
and sampled verification gives tokens distributed exactly as the target's (chi-square over many seeded
draws of a small vocabulary), whatever the draft distribution."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from tierlm.engine.rejection_sampler import rejection_sample

ALPHA = 1e-4  # each chi-square test's false-alarm rate (the draws are seeded: the outcome is fixed)

# target distributions p_0..p_2 (token 5 impossible at position 0) and draft distributions q_0, q_1 that
# differ from them everywhere, so acceptance, recovery and the bonus token are all exercised
TARGET = torch.tensor([
    [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
    [0.10, 0.10, 0.40, 0.10, 0.20, 0.10],
    [0.05, 0.35, 0.10, 0.20, 0.10, 0.20],
], dtype=torch.float64)
DRAFT = torch.tensor([
    [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
    [0.40, 0.05, 0.05, 0.20, 0.20, 0.10],
], dtype=torch.float64)
GREEDY_DRAFTS = [0, 2]  # a greedy draft's fixed tokens (q one-hot), likely under the target


def chi2_critical(df: int, alpha: float) -> float:
    """The chi-square (1 - alpha) quantile, Wilson-Hilferty approximation (accurate to ~1% here)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` against `probs` over the cells of non-zero probability, and its
    degrees of freedom; a token of zero probability fails the test outright."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=probs.shape[0]).double()
    assert counts[probs == 0].sum() == 0, "a token of zero target probability was produced"
    cells = probs > 0
    expected = probs[cells] * len(tokens)
    return float(((counts[cells] - expected) ** 2 / expected).sum()), int(cells.sum()) - 1


def sampled_outputs(draft_probs: torch.Tensor | None, trials: int, seed: int) -> list[list[int]]:
    """`trials` independent verifications of K = 2 drafts: drafts drawn from DRAFT (or, without draft
    probabilities, GREEDY_DRAFTS) against TARGET."""
    gen = torch.Generator().manual_seed(seed)
    if draft_probs is None:
        drafts = torch.tensor(GREEDY_DRAFTS).expand(trials, -1).clone()
    else:
        drafts = torch.stack([torch.multinomial(q, trials, replacement=True, generator=gen) for q in DRAFT], dim=1)
    return rejection_sample(
        TARGET.float().expand(trials, -1, -1), drafts,
        None if draft_probs is None else draft_probs.float().expand(trials, -1, -1),
        [2] * trials, [False] * trials, [None] * trials, torch.Generator().manual_seed(seed + 1),
    )


@pytest.mark.parametrize("with_draft_probs", [True, False], ids=["draft_probs", "greedy_draft"])
def test_output_follows_the_target_distribution(with_draft_probs):
    outputs = sampled_outputs(DRAFT if with_draft_probs else None, trials=40_000, seed=20)
    assert all(1 <= len(out) <= 3 for out in outputs)
    # the j-th output token exists when the first j drafts were accepted; it then follows p_j
    for position in range(3):
        tokens = [out[position] for out in outputs if len(out) > position]
        statistic, df = chi2_statistic(tokens, TARGET[position])
        assert statistic < chi2_critical(df, ALPHA), (position, statistic, len(tokens))
    if with_draft_probs:  # the test can tell distributions apart: the draft's is rejected at this size
        first = [out[0] for out in outputs]
        counts = torch.bincount(torch.tensor(first), minlength=6).double()
        expected = DRAFT[0] * len(first)
        assert float(((counts - expected) ** 2 / expected).sum()) > 10 * chi2_critical(5, ALPHA)
    # acceptance happens as often as the theory says: sum_x min(p_0, q_0) (= 0.55 here)
    accept_rate = sum(len(out) > 1 for out in outputs) / len(outputs)
    if with_draft_probs:
        expected_rate = float(torch.minimum(TARGET[0], DRAFT[0]).sum())
    else:
        expected_rate = float(TARGET[0, GREEDY_DRAFTS[0]])
    assert abs(accept_rate - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / len(outputs))


def test_drafts_from_a_reduced_vocabulary_keep_the_target_distribution():
    """A draft head with a speculative token map proposes from part of the vocabulary only (q is zero on
    tokens 3-5, which the target can still produce): those tokens come from the recovery step at their
    target rate, and the drafted ones are accepted at sum_x min(p, q)."""
    reduced = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [0.1, 0.5, 0.4, 0.0, 0.0, 0.0]], dtype=torch.float64)
    gen, trials = torch.Generator().manual_seed(31), 40_000
    drafts = torch.stack([torch.multinomial(q, trials, replacement=True, generator=gen) for q in reduced], dim=1)
    outputs = rejection_sample(TARGET.float().expand(trials, -1, -1), drafts, reduced.float().expand(trials, -1, -1),
                               [2] * trials, [False] * trials, [None] * trials, torch.Generator().manual_seed(32))
    for position in range(3):
        tokens = [out[position] for out in outputs if len(out) > position]
        statistic, df = chi2_statistic(tokens, TARGET[position])
        assert statistic < chi2_critical(df, ALPHA), (position, statistic, len(tokens))
    accept_rate = sum(len(out) > 1 for out in outputs) / trials
    expected_rate = float(torch.minimum(TARGET[0], reduced[0]).sum())  # 0.30 + 0.25 + 0.20 = 0.75
    assert abs(accept_rate - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / trials)


def test_greedy_accepts_while_drafts_are_the_argmax():
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 6, 4, 50
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    best = logits.argmax(dim=-1)
    drafts = best[:, :k].clone()
    matching = [0, 1, 2, 4, 4, 3]  # request i's drafts match for this many positions, then one differs
    num_drafts = [4, 4, 4, 4, 2, 3]
    for i, j in enumerate(matching):
        if j < k:
            drafts[i, j] = (best[i, j] + 1 + i) % vocab
    outputs = rejection_sample(logits, drafts, None, num_drafts, [True] * batch, [None] * batch,
                               torch.Generator().manual_seed(1))
    for i in range(batch):
        kept = min(matching[i], num_drafts[i])
        assert outputs[i] == best[i, : kept + 1].tolist(), i
    # probabilities instead of logits, and draft probabilities given: the same tokens
    probs = torch.softmax(logits, dim=-1)
    again = rejection_sample(probs, drafts, torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1),
                             num_drafts, [True] * batch, [None] * batch, torch.Generator().manual_seed(2))
    assert again == outputs


def test_seeded_requests_are_reproducible_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 5, 3, 40
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen), dim=-1)
    drafts = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    greedy = [False, True, False, False, False]

    def run(rows: list[int], seeds: dict[int, int]) -> dict[int, list[int]]:
        generators = [torch.Generator().manual_seed(seeds[i]) if i in seeds else None for i in rows]
        out = rejection_sample(target[rows], drafts[rows], draft[rows], [k] * len(rows), [greedy[i] for i in rows],
                               generators, torch.Generator().manual_seed(99))
        return dict(zip(rows, out))

    together = run(list(range(batch)), {0: 11, 2: 12, 4: 13})
    assert run([2], {2: 12})[2] == together[2]
    assert run([4, 0], {0: 11, 4: 13}) == {0: together[0], 4: together[4]}
    # other seeds give other outputs for some request (over 20 seeds, not a coincidence of one draw)
    others = {tuple(run([0], {0: s})[0]) for s in range(20)}
    assert len(others) > 1


@pytest.mark.parametrize("k", [2, 0])
def test_no_drafts_samples_the_bonus_token_alone(k):
    """A request with no drafts this step (n = 0 of K, or K = 0): one token drawn from p_0."""
    trials = 20_000
    target = TARGET[: k + 1].float().expand(trials, -1, -1)
    outputs = rejection_sample(target, torch.zeros(trials, k, dtype=torch.int64), None, [0] * trials,
                               [False] * trials, [None] * trials, torch.Generator().manual_seed(5))
    assert all(len(out) == 1 for out in outputs)
    statistic, df = chi2_statistic([out[0] for out in outputs], TARGET[0])
    assert statistic < chi2_critical(df, ALPHA)


def test_bad_shapes_are_named():
    target = torch.rand(2, 3, 10)
    with pytest.raises(ValueError, match="draft_tokens: expected shape"):
        rejection_sample(target, torch.zeros(2, 3, dtype=torch.int64), None, [2, 2], [True, True], [None, None],
                         torch.Generator())
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sample(target, torch.zeros(2, 2, dtype=torch.int64), None, [3, 2], [True, True], [None, None],
                         torch.Generator())
