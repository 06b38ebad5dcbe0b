"""A request's decode cost follows its own context, not max_model_len: a static decode step of a 200-token
request runs the same ops on the same shapes at max_model_len 8k and 262k; eager decode batches score
each request's visible blocks only; the top-k block choice equals a stable full sort."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from reference_models import build_reference
from torch.utils._python_dispatch import TorchDispatchMode

from tierlm.model.cache import QSAIndexerState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.qsa_attention import QSAIndexer, top_blocks
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner, prepared_widths

BLOCK_SIZE, CONTEXT = 16, 200


class OpTrace(TorchDispatchMode):
    """Every aten op run inside, with the shapes of its tensor arguments and results (of a view, only
    the result: it reads nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        touched = out if func.is_view else (args, kwargs, out)
        shapes = tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(touched) if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out

    @property
    def elements(self) -> int:
        """Elements of every tensor every op touched: a stand-in for the step's work."""
        return sum(math.prod(shape) for _, shapes in self.ops for shape in shapes)


@pytest.fixture(scope="module")
def prefilled(tmp_path_factory):
    """The reference model with one 200-token request prefilled in slot 0."""
    folder = tmp_path_factory.mktemp("context_cost")
    build_reference("hc4_ple", folder)
    model, config = load_model(folder, dtype="float32", device="cpu")
    cache = ModelCache(config, 2, 32, BLOCK_SIZE, torch.float32, "cpu")
    cache.reset_slot(0)
    prompt = torch.randint(2, config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(math.ceil((CONTEXT + 1) / BLOCK_SIZE)))
    model(ForwardBatch.build([prompt], [0], [0], [table], BLOCK_SIZE), cache)
    step = ForwardBatch.build([[7]], [CONTEXT], [0], [table], BLOCK_SIZE)
    return model, cache, step


def traced_step(prefilled, max_model_len: int, widths=None) -> tuple[torch.Tensor, OpTrace]:
    model, cache, step = prefilled
    runner = StaticDecodeRunner(model, copy.deepcopy(cache), 1, math.ceil(max_model_len / BLOCK_SIZE), "eager",
                                widths=widths)
    with OpTrace() as trace:
        logits = runner.run(step)
    return logits, trace


def test_a_short_request_decodes_with_the_same_ops_at_8k_and_262k(prefilled):
    short_logits, short = traced_step(prefilled, 8192)
    long_logits, long = traced_step(prefilled, 262_144)
    assert short.ops == long.ops  # every op, every shape
    assert torch.equal(short_logits, long_logits)
    # what the step did before: one block-table width, max_model_len's, scored and copied every step
    full_logits, full = traced_step(prefilled, 262_144, widths=[262_144 // BLOCK_SIZE])
    assert full.elements > 10 * long.elements
    assert torch.allclose(full_logits, long_logits, atol=1e-6, rtol=0)


def test_prepared_widths_double_up_to_max_model_len():
    assert prepared_widths(16384, 256) == [256, 512, 1024, 2048, 4096, 8192, 16384]
    assert prepared_widths(1000, 256) == [256, 512, 1000]
    assert prepared_widths(40, 256) == [40]


def test_static_steps_pick_the_narrowest_width_that_holds_the_batch(prefilled):
    model, cache, _ = prefilled
    runner = StaticDecodeRunner(model, cache, 4, 64, "eager", widths=[4, 8, 16])
    assert runner.widths == [4, 8, 16, 64]
    for used, expected in [(1, 4), (4, 4), (5, 8), (16, 16), (17, 64), (64, 64)]:
        batch = ForwardBatch.build([[5], [6], [7]], [0, 0, 0], [0, 0, 0], [[0] * used] * 3, BLOCK_SIZE)
        assert runner.shape_for(batch) == (4, expected)


# ---- the indexer: varlen scoring and top-k ---------------------------------------------------------------


class _Config:
    indexer_n_heads, indexer_head_dim, indexer_compress_ratio, indexer_budget = 3, 8, 4, 12
    hidden_size, rms_norm_eps = 16, 1e-6


def stable_sort_top_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: a stable full sort, highest first, ties to the lower block index."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


@pytest.mark.parametrize("k", [0, 1, 3, 17, 40])
def test_top_blocks_equals_a_stable_full_sort(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.relu(torch.randn(64, 40, generator=gen))  # about half exact zeros: ties
    scores[::5] = torch.randint(0, 3, (13, 40), generator=gen).float()  # rows of many equal values
    scores[1::7, ::3] = -0.0  # ties with 0.0
    scores[2::3, 25:] = float("-inf")  # blocks the query cannot see
    values, indices = top_blocks(scores, k)
    expected_values, expected_indices = stable_sort_top_blocks(scores, k)
    assert torch.equal(indices, expected_indices)
    assert torch.equal(values, expected_values)


def decode_batch(contexts: list[int], tables: list[list[int]], static: bool) -> ForwardBatch:
    batch = ForwardBatch.build([[3]] * len(contexts), contexts, list(range(len(contexts))), tables, 8)
    batch.static = static
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_decode_scoring_selects_what_the_padded_form_selects(dtype):
    """Requests of 3 to 200 tokens in one eager batch: each scores only its visible blocks (a short one
    beside a long one scores its own few), and the rows chosen equal the padded, sync-free form's."""
    torch.manual_seed(0)
    indexer = QSAIndexer(_Config())
    block_size, blocks = 8, 64
    state = QSAIndexerState(torch.zeros(5, 4, 8, dtype=dtype),
                            torch.randn(blocks + 1, block_size // 4, 8).to(dtype), block_size, blocks)
    contexts = [200, 3, 37, 8, 131]
    order, tables = torch.randperm(blocks).tolist(), []  # shuffled blocks, each request its own
    for c in contexts:
        tables.append(order[: c // block_size + 1])
        order = order[c // block_size + 1 :]
    q = torch.randn(len(contexts), 3, 8).to(dtype)
    q[1::2] = -q[1::2].abs()  # these queries tie often (relu(negative) = 0)
    scored = []
    indexer.queries = lambda raw_q, rope: raw_q  # q is taken as the roped, normed queries
    score = indexer.scores
    indexer.scores = lambda q, keys, positions: scored.append(keys.shape[-2]) or score(q, keys, positions)
    varlen = indexer.select_decode(q, decode_batch(contexts, tables, static=False), state, None)
    assert scored == [(c + 1) // 4 for c in contexts]
    padded = indexer.select_decode(q, decode_batch(contexts, tables, static=True), state, None)  # every block
    assert torch.equal(varlen.valid, padded.valid)
    assert torch.equal(varlen.rows, padded.rows)
