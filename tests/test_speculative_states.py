"""Speculative verification keeps the state after every verified row (`ForwardBatch.position_slots`): the
slot given for row t must hold what decoding the rows one at a time leaves after row t, for every
per-request state of the target (GDN conv window and recurrent state, PLE conv history, n-gram context,
QSA indexer ring and the block keys the rows close), and the verify rows' logits must be the decode
steps'. Both forms: every request of the batch verifying the same number of rows (the layers' multi-token
decode forms, `verify_slots`), and a verify request beside a plain decode (request by request).
The verified rows cross a compression group and a block boundary (R = 4, block 16: positions 13..16).
The fixed-shape forms (`StaticDecodeRunner`: verification steps of 1 + K rows per request, the draft head's
one-row steps; padded to a larger prepared size, as CUDA graphs replay them) equal the eager forwards.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tierlm.demo_model import build_demo_model
from tierlm.model.cache import QSAIndexerState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.loader import load_model
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner

BLOCK, PROMPT_LEN, ROWS = 16, 13, 4


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("states") / "demo", "tiny", mtp=True)


@pytest.fixture(scope="module")
def loaded(demo):
    return load_model(demo, dtype="float32", device="cpu")


def slot_states(cache: ModelCache, slot: int, seen: int) -> list[torch.Tensor]:
    """Every target state of a slot after `seen` tokens; of an indexer ring only its open group's entries
    (the rest is stale by design)."""
    out = []
    for state in cache.target_slot_states:
        for pool in state.slot_pools:
            if isinstance(state, QSAIndexerState):
                out.append(pool[slot, : seen % pool.shape[1]].clone())
            else:
                out.append(pool[slot].clone())
    return out


def block_key(cache: ModelCache, block: int, group: int) -> list[torch.Tensor]:
    return [c.indexer.keys[block, group].clone() for c in cache.layers if c.indexer is not None]


@pytest.mark.parametrize("beside", [False, True], ids=["uniform", "beside_a_decode"])
def test_position_slots_hold_what_decoding_row_by_row_leaves(loaded, beside):
    model, config = loaded
    cache = ModelCache(config, num_slots=8, num_blocks=6, block_size=BLOCK, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompt, other = (torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (PROMPT_LEN, 5))
    rows = torch.randint(3, config.vocab_size, (ROWS,), generator=gen).tolist()
    # the verifying request: slot 0, blocks 0-1; its reference decoded row by row: slot 1, blocks 2-3
    for slot, blocks in ((0, [0, 1]), (1, [2, 3])):
        model(ForwardBatch.build([prompt], [0], [slot], [blocks], BLOCK), cache)
    expected_logits, expected = [], []
    for t, token in enumerate(rows):
        expected_logits.append(model(ForwardBatch.build([[token]], [PROMPT_LEN + t], [1], [[2, 3]], BLOCK), cache)[0])
        expected.append(slot_states(cache, 1, PROMPT_LEN + t + 1))
    position_slots = [4, 5, 6]
    chunks, contexts, slots, tables, after = [rows], [PROMPT_LEN], [0], [[0, 1]], [position_slots]
    if beside:  # a request decoding one token in the same batch (slot 2, block 4)
        model(ForwardBatch.build([other], [0], [2], [[4]], BLOCK), cache)
        chunks, contexts, slots, tables, after = [rows, [7]], [PROMPT_LEN, 5], [0, 2], [[0, 1], [4]], [*after, []]
    batch = ForwardBatch.build(chunks, contexts, slots, tables, BLOCK, logits="all", position_slots=after)
    assert (batch.verify_slots is None) == beside
    logits = model(batch, cache)

    torch.testing.assert_close(logits[:ROWS], torch.stack(expected_logits))
    for t, slot in enumerate([*position_slots, 0]):
        got = slot_states(cache, slot, PROMPT_LEN + t + 1)
        assert len(got) == len(expected[t])
        for ours, theirs in zip(got, expected[t], strict=True):
            torch.testing.assert_close(ours, theirs)
    # position 15 closed compression group 3 of the first block, in the verify's block 0 and the reference's 2
    for ours, theirs in zip(block_key(cache, 0, 3), block_key(cache, 2, 3), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_position_slots_are_checked():
    with pytest.raises(ValueError, match="position_slots"):
        ForwardBatch.build([[1, 2, 3]], [0], [0], [[0]], BLOCK, position_slots=[[4]])


def _two_prefilled_requests(demo, device: str, k: int, seed: int):
    """The demo model with its draft head, a cache with 2 + 2k slots and 4 blocks, and two random prompts
    (PROMPT_LEN and 6 tokens; blocks [0, 1] and [2, 3]) prefilled: (model, config, cache, generator, prompts,
    tables)."""
    model, config = load_model(demo, dtype="float32", device=device, load_mtp=True)
    cache = ModelCache(config, num_slots=2 + 2 * k, num_blocks=4, block_size=BLOCK, dtype=torch.float32, device=device,
                       num_draft_layers=1)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (PROMPT_LEN, 6)]
    tables = [[0, 1], [2, 3]]
    model(ForwardBatch.build(prompts, [0, 0], [0, 1], tables, BLOCK, device=device), cache)
    return model, config, cache, gen, prompts, tables


@pytest.mark.parametrize("device, mode", [
    ("cpu", "eager"),
    pytest.param("cuda", "cuda_graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
])
def test_fixed_shape_verify_and_draft_steps_equal_the_eager_ones(demo, device, mode):
    """Two requests verifying 1 + K rows each, the draft head's pass over those rows (as after a full
    acceptance: verification-shaped, its logits at each request's last row) and a draft step, at a prepared
    size of 3 and a wider block table, against the eager forwards (the pass: a plain batch): the same
    logits and streams, and the same state in every real slot and block (the head's rings: the requests')."""
    k = 2
    model, config, cache, gen, prompts, tables = _two_prefilled_requests(demo, device, k, seed=1)
    static_cache, staged_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    shapes = {"sizes": [3], "widths": [4]}
    verify = StaticDecodeRunner(model, static_cache, 3, 4, mode, rows_per_request=1 + k, **shapes)
    draft = StaticDecodeRunner(model, static_cache, 3, 4, mode, draft_layer=0, **shapes)
    draft_pass = StaticDecodeRunner(model, static_cache, 3, 4, mode, draft_layer=0, rows_per_request=1 + k, **shapes)

    rows = torch.randint(3, config.vocab_size, (2, 1 + k), generator=gen).tolist()
    batch = ForwardBatch.build(rows, [len(p) for p in prompts], [0, 1], tables, BLOCK, device=device, logits="all",
                               position_slots=[[2, 3], [4, 5]])
    assert verify.can_run(batch) and not draft.can_run(batch)
    logits, streams = model.forward_with_streams(batch, cache)
    static_logits, static_streams = verify.run(batch)
    torch.testing.assert_close(static_logits, logits)
    torch.testing.assert_close(static_streams, streams)
    # the same verify staged from host lists (one copy into the buffers), on a third copy of the cache
    staged = StaticDecodeRunner(model, staged_cache, 3, 4, mode, rows_per_request=1 + k, **shapes)
    shape, staged_batch = staged.stage_verify(rows, [len(p) for p in prompts], [0, 1], [[2, 3, 0], [4, 5, 1]], tables)
    assert staged.can_run(staged_batch) and staged_batch.verify_slots.tolist() == [[2, 3, 0], [4, 5, 1]]
    for ours, theirs in zip(staged.replay(shape, 2 * (1 + k)), (logits, streams), strict=True):
        torch.testing.assert_close(ours, theirs)

    # the draft pass over every row (row t with token t+1; the last with a next token), then a draft step
    # after the pass's last row
    following = torch.randint(3, config.vocab_size, (2,), generator=gen).tolist()
    pass_rows = [[*r[1:], token] for r, token in zip(rows, following)]
    contexts = [len(p) for p in prompts]
    plain = ForwardBatch.build(pass_rows, contexts, [0, 1], tables, BLOCK, device=device, logits="all")
    shaped = ForwardBatch.build(pass_rows, contexts, [0, 1], tables, BLOCK, device=device, logits="all",
                                position_slots=[[2, 3], [4, 5]])
    assert draft_pass.can_run(shaped) and not draft_pass.can_run(plain)
    for ours, theirs in zip(draft_pass.run(shaped, streams), model.draft(plain, streams, cache, 0), strict=True):
        torch.testing.assert_close(ours[k :: 1 + k], theirs[k :: 1 + k])  # each request's last row
    step = ForwardBatch.build([[r[0]] for r in rows], [c + 1 + k for c in contexts], [0, 1], tables, BLOCK,
                              device=device)
    assert draft.can_run(step) and not verify.can_run(step)
    hidden = streams[k :: 1 + k]
    for ours, theirs in zip(draft.run(step, hidden), model.draft(step, hidden, cache, 0), strict=True):
        torch.testing.assert_close(ours, theirs)
    real_blocks, slots = 4, 2 + 2 * k
    torch.testing.assert_close(static_cache.ngram_context[:slots], cache.ngram_context[:slots])
    # tokens seen by each slot's rings: the target's after the verify (own slots, then the position slots),
    # the draft head's (own slots) after the pass and the step; only their open groups' entries count
    target_seen = {0: contexts[0] + 1 + k, 1: contexts[1] + 1 + k, 2: contexts[0] + 1, 3: contexts[0] + 2,
                   4: contexts[1] + 1, 5: contexts[1] + 2}
    draft_seen = {0: contexts[0] + 2 + k, 1: contexts[1] + 2 + k}
    torch.testing.assert_close(staged_cache.ngram_context[:slots], cache.ngram_context[:slots])
    for ours, staged_layer, theirs in zip(static_cache.layers, staged_cache.layers, cache.layers, strict=True):
        for pool, static_pool, staged_pool in ((theirs.gdn_conv, ours.gdn_conv, staged_layer.gdn_conv),
                                               (theirs.gdn_recurrent, ours.gdn_recurrent, staged_layer.gdn_recurrent),
                                               (theirs.ple_conv, ours.ple_conv, staged_layer.ple_conv)):
            if pool is not None:
                torch.testing.assert_close(static_pool[:slots], pool[:slots])
                torch.testing.assert_close(staged_pool[:slots], pool[:slots])
    for layers, static_layers, seen in ((cache.layers, static_cache.layers, target_seen),
                                        (cache.draft_layers, static_cache.draft_layers, draft_seen)):
        for theirs, ours in zip(layers, static_layers, strict=True):
            if theirs.index_ring is None:
                continue
            for slot, count in seen.items():
                entries = count % theirs.index_ring.shape[1]
                torch.testing.assert_close(ours.index_ring[slot, :entries], theirs.index_ring[slot, :entries])
    for ours, theirs in zip(static_cache.layers + static_cache.draft_layers, cache.layers + cache.draft_layers,
                            strict=True):
        if theirs.kv is not None:
            torch.testing.assert_close(ours.key_cache[:real_blocks], theirs.key_cache[:real_blocks])
            torch.testing.assert_close(ours.index_keys[:real_blocks], theirs.index_keys[:real_blocks])


@pytest.mark.parametrize("device, mode", [
    ("cpu", "eager"),
    pytest.param("cuda", "cuda_graph", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
])
def test_whole_greedy_step_at_a_fixed_shape_equals_the_eager_one(demo, device, mode, monkeypatch):
    """`GreedySpeculation` (verify, accept, roll back, draft) staged into a fixed-shape runner and replayed
    (one CUDA graph on a GPU; padded to a prepared size of 3 and a wider block table) against the same step
    run eagerly on a plain batch: the same readback (accepted counts, tokens, next drafts) and the same
    state in the slot of each request's last accepted row (target, and the head's rings; the host makes
    that slot the request's) and in every real block. One request's drafts are the greedy continuation (all accepted), the other's
    wrong at the first (a rollback). The step split after its verify forward (`replay` then
    `replay_accept` on the logits' argmaxes, as penalized steps run) does the same. On a GPU the eager step
    takes the torch ops of kernels/speculative_step (TIERLM_NO_FUSED_SPECULATIVE_STEP=1), the graphs their
    Triton launches."""
    from tierlm.model.speculative_step import GreedySpeculation

    k = 2
    model, config, cache, gen, prompts, tables = _two_prefilled_requests(demo, device, k, seed=2)
    contexts = [len(p) for p in prompts]
    rows = torch.randint(3, config.vocab_size, (2, 1 + k), generator=gen).tolist()
    for j in range(k):  # the second request's drafts: the target's greedy tokens, one forward each
        probe = ForwardBatch.build([rows[1][: j + 1]], [contexts[1]], [1], [tables[1]], BLOCK, device=device)
        rows[1][j + 1] = model(probe, copy.deepcopy(cache)).argmax(dim=-1).item()
    static_cache, split_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    batch = ForwardBatch.build(rows, contexts, [0, 1], tables, BLOCK, device=device, logits="all",
                               position_slots=[[2, 3], [4, 5]])
    with monkeypatch.context() as patch:
        patch.setenv("TIERLM_NO_FUSED_SPECULATIVE_STEP", "1")
        expected = GreedySpeculation(model, cache, k)(batch, cache)
    runner = StaticDecodeRunner(model, static_cache, 3, 4, mode, rows_per_request=1 + k, greedy_speculation=True,
                                sizes=[3], widths=[4])
    shape, _ = runner.stage_verify(rows, contexts, [0, 1], [[2, 3, 0], [4, 5, 1]], tables)
    assert runner.replay_greedy(shape, 2).tolist() == expected.tolist()
    split = StaticDecodeRunner(model, split_cache, 3, 4, mode, rows_per_request=1 + k, greedy_speculation=True,
                               sizes=[3], widths=[4])
    shape, _ = split.stage_verify(rows, contexts, [0, 1], [[2, 3, 0], [4, 5, 1]], tables)
    logits, _ = split.replay(shape, 2 * (1 + k))
    assert split.replay_accept(shape, 2, logits.float().argmax(dim=-1)).tolist() == expected.tolist()
    assert expected[:, 0].tolist() == [0, k]  # a rollback and a full acceptance
    kept = [row_slots[accepted] for row_slots, accepted in zip(([2, 3, 0], [4, 5, 1]), expected[:, 0].tolist())]
    assert kept == [2, 1]
    for ours in (static_cache, split_cache):
        for slot, context, accepted in zip(kept, contexts, expected[:, 0].tolist(), strict=True):
            for got, want in zip(slot_states(ours, slot, context + 1 + accepted),
                                 slot_states(cache, slot, context + 1 + accepted), strict=True):
                torch.testing.assert_close(got, want)
            for got, want in zip(ours.draft_layers, cache.draft_layers, strict=True):
                entries = (context + 1 + accepted) % want.index_ring.shape[1]
                torch.testing.assert_close(got.index_ring[slot, :entries], want.index_ring[slot, :entries])
        for got, want in zip(ours.layers + ours.draft_layers, cache.layers + cache.draft_layers, strict=True):
            if want.kv is not None:
                torch.testing.assert_close(got.key_cache[:4], want.key_cache[:4])
                torch.testing.assert_close(got.index_keys[:4], want.index_keys[:4])


def count_row_table_copies(monkeypatch) -> list[int]:
    """A spy on `ForwardBatch.verify_row_tables` (the one copy of the block tables a verify forward makes):
    its calls are appended to the returned list."""
    calls, copy_tables = [], ForwardBatch.verify_row_tables

    def spy(batch):
        calls.append(1)
        return copy_tables(batch)

    monkeypatch.setattr(ForwardBatch, "verify_row_tables", spy)
    return calls


def test_a_verify_forward_copies_the_block_tables_once(demo, monkeypatch):
    """The block tables one per verify row are copied once a forward, whatever its QSA layers (2 here),
    and once for a greedy step whose draft head's pass shares the verify forward's Rope; the logits are
    the same as when each layer makes its own copy."""
    from reference_models import CONFIGS

    from tierlm.config import ModelConfig
    from tierlm.model.layers.rotary import Rope
    from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM
    from tierlm.model.speculative_step import GreedySpeculation

    config = ModelConfig.from_dict(CONFIGS["hc3_4gram"])
    assert config.layer_types.count("indexed_attention") == 2
    model = Qwen4ExpForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.data.copy_(0.05 * torch.randn(param.shape, generator=gen))
    block = 4 * config.indexer_compress_ratio
    cache = ModelCache(config, num_slots=6, num_blocks=4, block_size=block, dtype=torch.float32)
    prompts = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in (block + 1, 6)]
    with torch.no_grad():
        model(ForwardBatch.build(prompts, [0, 0], [0, 1], [[0, 1], [2, 3]], block), cache)
        rows = torch.randint(3, config.vocab_size, (2, 3), generator=gen).tolist()
        batch = ForwardBatch.build(rows, [len(p) for p in prompts], [0, 1], [[0, 1], [2, 3]], block, logits="all",
                                   position_slots=[[2, 3], [4, 5]])
        per_layer = copy.deepcopy(cache)
        with monkeypatch.context() as patch:  # every QSA layer its own copy (as before the Rope shared it)
            patch.setattr(Rope, "verify_row_tables", property(lambda rope: rope.batch.verify_row_tables()))
            calls = count_row_table_copies(patch)
            expected = model(batch, per_layer)
            assert len(calls) == 2
        calls = count_row_table_copies(monkeypatch)
        torch.testing.assert_close(model(batch, cache), expected, rtol=0, atol=0)
        assert len(calls) == 1

    k = 2
    model, config, cache, gen, prompts, tables = _two_prefilled_requests(demo, "cpu", k, seed=3)
    rows = torch.randint(3, config.vocab_size, (2, 1 + k), generator=gen).tolist()
    batch = ForwardBatch.build(rows, [len(p) for p in prompts], [0, 1], tables, BLOCK, logits="all",
                               position_slots=[[2, 3], [4, 5]])
    calls.clear()
    GreedySpeculation(model, cache, k)(batch, cache)
    assert len(calls) == 1  # the verify forward's QSA layer and the draft head's pass over its rows
