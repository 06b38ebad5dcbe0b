"""kernels/ple: PLE's decode step (n-gram hash + row gather; gate, norms, short conv and residual add; the
context moved on)
against the torch reference, under TRITON_INTERPRET=1 on CPU at small shapes (compiled on a GPU, where the
real widths run too); and the reference against the layer's own torch path.

Tolerances. Embeddings and context: integer hashing and moves and a row copy (an fp8 row decoded exactly, times the scale in
fp32), so equal bit for bit in every dtype. Residual, fp32: the kernel sums the norms' and the dot's
products in another order and gets norm_conv's rms as gate^2 * mean(value^2): a few fp32 ulps. bf16: as in
test_bf16_parity, the fp32 reference on the same (bf16-valued) inputs is the truth; the kernel may be off
by at most FACTOR x the reference's own bf16 error plus half a bf16 ulp of the row's largest value, row
by row; the same for the conv history it writes.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import on_cuda_else_interpreted

from tierlm.kernels.ple import naive

FACTOR = 2.0
EPS = 1e-6
EOS = 1
# 3 channel blocks per stream (BLOCK_C 16 in the child), 2 stats steps (BLOCK_STATS 32)
REAL = {"hc": 4, "hidden": 2560, "kernel": 4, "dilation": 3, "heads_per_ngram": 8, "dim": 160}
SMALL = {"requests": 3, "hc": 2, "hidden": 40, "kernel": 4, "dilation": 3, "heads_per_ngram": 2, "dim": 12}


def embedding_inputs(requests: int, heads_per_ngram: int, dim: int, ngram_size: int = 3, vocab: int = 500):
    """Contexts holding EOS at every place (and none), slots out of order, an id that wraps the hash, a table
    of prime-sized heads."""
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(requests + 2, generator=gen)[:requests]
    context = torch.randint(2, vocab, (requests + 2, ngram_size - 1), generator=gen)
    for i in range(min(requests, ngram_size - 1)):
        context[slots[i], i] = EOS
    tokens = torch.randint(2, vocab, (requests,), generator=gen)
    tokens[-1] = 2**45  # out of vocabulary: the products wrap, and the hash may go below 0 (floor mod)
    heads = (ngram_size - 1) * heads_per_ngram
    sizes = torch.tensor([101, 103, 107, 109, 113, 127][:heads] + [131] * max(0, heads - 6))
    offsets = torch.cumsum(sizes, 0) - sizes
    multipliers = torch.randint(1, 2**40, (ngram_size,), generator=gen) * 2 + 1
    table = torch.randn(int(sizes.sum()), dim, generator=gen)
    return context, slots, tokens, table, multipliers, sizes, offsets


def residual_inputs(requests: int, hc: int, hidden: int, kernel: int, dilation: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    width = hc * hidden
    streams = torch.randn(requests, width, generator=gen) * (torch.rand(requests, 1, generator=gen) * 3 + 0.5)
    key_value = torch.randn(requests, width + hidden + 8, generator=gen)  # key, value: views of one row
    norms = [torch.randn(width, generator=gen) * 0.2 for _ in range(3)]
    conv_weight = torch.randn(width, kernel, generator=gen) * 0.5
    state = torch.randn(requests + 2, width, (kernel - 1) * dilation, generator=gen)
    slots = torch.randperm(requests + 2, generator=gen)[:requests]
    streams, key_value, state = (t.to(dtype) for t in (streams, key_value, state))
    norms, conv_weight = [n.to(dtype) for n in norms], conv_weight.to(dtype)
    return streams, key_value[:, :width], key_value[:, width : width + hidden], *norms, conv_weight, state, slots


def assert_within_reference_error(ours, theirs, reference, what: str) -> None:
    ours, theirs, reference = (t.float().flatten(1) for t in (ours, theirs, reference))
    ours_error = (ours - reference).abs().amax(dim=-1)
    their_error = (theirs - reference).abs().amax(dim=-1)
    _, exponent = torch.frexp(reference.abs().amax(dim=-1))
    floor = torch.ldexp(torch.ones_like(ours_error), exponent - 8) / 2
    worse = ours_error > FACTOR * their_error + floor
    assert not worse.any(), f"{what}: kernel off by {ours_error.max().item():.3g}, reference {their_error.max().item():.3g}"


def verify_inputs(args, rows: int):
    """Residual inputs for `rows` rows per request (speculative verification): the first args' requests
    each own `rows` rows of them and, beside their slot, rows - 1 slots for the history after each row."""
    *tensors, state, slots = args
    requests = tensors[0].shape[0] // rows
    slots = slots[:requests]
    spare = [s for s in range(state.shape[0]) if s not in slots.tolist()]
    state = torch.cat([state, state[: requests * rows]])  # room for the per-row slots
    spare += list(range(state.shape[0] - requests * rows, state.shape[0]))
    after = torch.tensor(spare[: requests * (rows - 1)]).view(requests, rows - 1)
    return (*tensors, state, slots), torch.cat([after, slots[:, None]], dim=1)


def run_residual(module, args, dilation: int, device: str, state_slots=None):
    """(output, the conv history after) of module.decode_residual on a copy of the history."""
    *tensors, state, slots = args
    state = state.clone().to(device)
    rows = {} if state_slots is None else {"state_slots": state_slots.to(device)}
    out = module.decode_residual(*(t.to(device) for t in tensors), state, slots.to(device), EPS, dilation, **rows)
    return out.cpu(), state.cpu()


def compare(device: str, requests: int, hc: int, hidden: int, kernel: int, dilation: int, heads_per_ngram: int,
            dim: int) -> None:
    from tierlm.kernels.ple import triton as kernels

    context, slots, tokens, table, multipliers, sizes, offsets = embedding_inputs(requests, heads_per_ngram, dim)
    fp8_scale = torch.tensor([0.03])
    cases = [(table, None, torch.float32), (table.bfloat16(), None, torch.bfloat16), (table, None, torch.bfloat16),
             ((table / fp8_scale).to(torch.float8_e4m3fn), fp8_scale, torch.bfloat16)]
    for stored, scale, dtype in cases:
        args = (context, slots, tokens, stored, scale, multipliers, sizes, offsets, heads_per_ngram, EOS, dtype)
        expected = naive.decode_embeddings(*args)
        got = kernels.decode_embeddings(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in args))
        assert got.dtype == dtype and torch.equal(got.cpu(), expected), f"embeddings from a {stored.dtype} table"

    got_context, expected_context = context.clone().to(device), context.clone()
    kernels.advance_context(got_context, slots.to(device), tokens.to(device))
    naive.advance_context(expected_context, slots, tokens)
    assert torch.equal(got_context.cpu(), expected_context), "advanced context"

    # speculative verification: 3 rows per request (the EOS rule reaching into the rows, the wrapping id)
    rows = 3
    row_tokens = torch.randint(2, 500, (requests * rows,), generator=torch.Generator().manual_seed(3))
    row_tokens[1], row_tokens[-1] = EOS, 2**45
    state_slots = torch.arange(requests * rows).view(requests, rows) + context.shape[0]
    state_slots[:, -1] = slots
    wide = torch.cat([context, torch.zeros(requests * rows, context.shape[1], dtype=context.dtype)])
    args = (wide, slots, row_tokens, table, None, multipliers, sizes, offsets, heads_per_ngram, EOS, torch.float32)
    got = kernels.decode_embeddings(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in args))
    assert torch.equal(got.cpu(), naive.decode_embeddings(*args)), "embeddings of verification rows"
    got_context, expected_context = wide.clone().to(device), wide.clone()
    kernels.advance_context(got_context, slots.to(device), row_tokens.to(device), state_slots.to(device))
    naive.advance_context(expected_context, slots, row_tokens, state_slots)
    assert torch.equal(got_context.cpu(), expected_context), "the context after each verification row"

    for dtype, width in ((torch.float32, 1), (torch.bfloat16, 1), (torch.float32, rows), (torch.bfloat16, rows)):
        args, state_slots = residual_inputs(requests * width, hc, hidden, kernel, dilation, dtype), None
        if width > 1:
            args, state_slots = verify_inputs(args, width)
        got, got_state = run_residual(kernels, args, dilation, device, state_slots)
        expected, expected_state = run_residual(naive, args, dilation, "cpu", state_slots)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_state, expected_state, rtol=1e-5, atol=1e-5)
            continue
        truth, truth_state = run_residual(naive, [t.float() if t.is_floating_point() else t for t in args], dilation,
                                          "cpu", state_slots)
        assert got.dtype == torch.bfloat16 and got_state.dtype == torch.bfloat16
        assert_within_reference_error(got, expected, truth, "bf16 residual")
        assert_within_reference_error(got_state, expected_state, truth_state, "bf16 conv history")


def test_kernels_match_reference():
    on_cuda_else_interpreted(lambda: compare("cuda", **SMALL), INTERPRETED_EARLY, "test_kernels_match_reference")


INTERPRETED_EARLY = {  # (a child: started when collection ends, see tests/interpreted.py)
    "test_kernels_match_reference": ((
        "import tierlm.kernels.ple.triton as k; k.BLOCK_C = 16; k.BLOCK_STATS = 32\n"
        "import test_ple_decode_kernel as t; t.compare('cpu', **t.SMALL)"),),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_layer(dtype):
    """The layer's torch decode path (what the CPU runs) is the reference, bit for bit, history included;
    with an fp8 table too."""
    from reference_models import BASE

    from tierlm.config import ModelConfig
    from tierlm.model.cache import PLEState
    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.layers.ple import NgramIds, PLELayer
    from tierlm.model.layers.ple_fp8 import Fp8NgramTable

    config = ModelConfig.from_dict(BASE)
    gen = torch.Generator().manual_seed(2)
    layer = PLELayer(config, 1)
    for param in layer.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    layer = layer.to(dtype)
    slots, tokens = [3, 0, 2], [7, config.eos_token_id, 300]
    batch = ForwardBatch.build([[t] for t in tokens], [5, 9, 1], slots, [[0], [1], [2]], 16)
    context = torch.randint(2, config.vocab_size, (4, config.ngram_size - 1), generator=gen)
    context[3, 0] = config.eos_token_id
    width, history = config.hc_count * config.hidden_size, layer.history
    streams = torch.randn(len(slots), width, generator=gen).to(dtype)
    conv = torch.randn(4, width, history, generator=gen).to(dtype)
    tables = [layer.table]
    if dtype == torch.bfloat16:
        fp8 = Fp8NgramTable(*layer.table.weight.shape)
        fp8.weight.data.copy_(layer.table.weight.float().to(torch.float8_e4m3fn))
        fp8.scale.data.fill_(0.5)
        tables.append(fp8)
    for table in tables:
        layer.table = table
        state = PLEState(conv.clone())
        got = layer(streams, batch, state, NgramIds(batch, context, config.eos_token_id, config.ngram_size))
        emb = naive.decode_embeddings(context, batch.slots, batch.token_ids, *table.stored(),
                                      *layer.hasher.constants(streams.device), config.heads_per_ngram,
                                      config.eos_token_id, dtype)
        key, value = layer.key_value_proj(emb)
        expected_state = conv.clone()
        expected = naive.decode_residual(streams, key, value, layer.norm_key.weight, layer.norm_query.weight,
                                         layer.norm_conv.weight, layer.conv1d.weight.squeeze(1), expected_state,
                                         batch.slots, config.rms_norm_eps, config.ngram_size)
        assert torch.equal(got, expected) and torch.equal(state.conv, expected_state), f"{table.weight.dtype} table"


def test_verification_rows_are_one_token_steps():
    """The references' T rows per request (speculative verification) are T one-token steps, each after the
    rows before it: the same embeddings, outputs, and the state each step leaves in that row's slot."""
    rows = 3
    context, slots, tokens, table, multipliers, sizes, offsets = embedding_inputs(2, 2, 4)
    tokens = torch.cat([tokens, tokens.flip(0), torch.tensor([EOS, 7])]).view(rows, 2).T.flatten()  # [B*T]
    hashing = (table, None, multipliers, sizes, offsets, 2, EOS, torch.float32)
    state_slots = torch.tensor([[4, 5, -1], [6, 7, -1]])
    state_slots[:, -1] = slots
    context = torch.cat([context, torch.zeros(4, context.shape[1], dtype=context.dtype)])
    got = naive.decode_embeddings(context, slots, tokens, *hashing)
    after = context.clone()
    naive.advance_context(after, slots, tokens, state_slots)
    step_context, expected = context.clone(), []
    for t in range(rows):
        step = tokens.view(2, rows)[:, t].contiguous()
        expected.append(naive.decode_embeddings(step_context, slots, step, *hashing))
        naive.advance_context(step_context, slots, step)
        assert torch.equal(after[state_slots[:, t]], step_context[slots]), f"the context after row {t}"
    assert torch.equal(got, torch.stack(expected, dim=1).flatten(0, 1)), "embeddings"

    for dtype in (torch.float32, torch.bfloat16):
        args, state_slots = verify_inputs(residual_inputs(2 * rows, 2, 8, 4, 3, dtype), rows)
        *tensors, state, slots = args
        got, got_state = run_residual(naive, args, 3, "cpu", state_slots)
        step_state, expected = state.clone(), []
        for t in range(rows):
            one = [x.view(2, rows, -1)[:, t] for x in tensors[:3]]
            expected.append(naive.decode_residual(*one, *tensors[3:], step_state, slots, EPS, 3))
            assert torch.equal(got_state[state_slots[:, t]], step_state[slots]), f"{dtype} history after row {t}"
        assert torch.equal(got, torch.stack(expected, dim=1).flatten(0, 1)), f"{dtype} outputs"


def test_bad_arguments_are_named():
    args = residual_inputs(2, 2, 8, 4, 3, torch.float32)
    with pytest.raises(ValueError, match="conv weight"):
        naive.decode_residual(*args[:6], args[6][:, :3], *args[7:], EPS, 3)
    with pytest.raises(ValueError, match="needs 3 multipliers"):
        context, slots, tokens, table, multipliers, sizes, offsets = embedding_inputs(2, 2, 4)
        naive.decode_embeddings(context, slots, tokens, table, None, multipliers[:2], sizes, offsets, 2, EOS,
                                torch.float32)
    with pytest.raises(ValueError, match="state_slots"):  # 2 requests, 4 tokens: state_slots must be [2, 2]
        naive.advance_context(context, slots, torch.zeros(4, dtype=torch.int64), slots.repeat(3).view(3, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("requests", [1, 4, 16])
def test_kernels_at_real_widths_on_gpu(requests):
    compare("cuda", requests=requests, **REAL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernels_replay_in_a_cuda_graph():
    """Replays of captured launches write the same embeddings, output and history as eager launches."""
    from tierlm.kernels.ple import triton as kernels

    hc, hidden, kernel, dilation = REAL["hc"], REAL["hidden"], REAL["kernel"], REAL["dilation"]
    context, slots, tokens, table, multipliers, sizes, offsets = (
        t.cuda() for t in embedding_inputs(4, REAL["heads_per_ngram"], REAL["dim"]))
    *residual, state, res_slots = (t.cuda() for t in residual_inputs(4, hc, hidden, kernel, dilation, torch.bfloat16))
    hash_args = (multipliers, sizes, offsets, REAL["heads_per_ngram"], EOS, torch.bfloat16)

    def step(history):
        emb = kernels.decode_embeddings(context, slots, tokens, table, None, *hash_args)
        return emb, kernels.decode_residual(*residual, history, res_slots, EPS, dilation)

    step(state.clone())  # compiled outside the capture
    graph_state = state.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(graph_state)
    for seed in range(3):
        tokens.copy_(torch.randint(2, 500, tokens.shape, generator=torch.Generator().manual_seed(seed)))
        residual[0].normal_()
        eager_state = graph_state.clone()
        graph.replay()
        eager = step(eager_state)
        assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
        assert torch.equal(graph_state, eager_state)
