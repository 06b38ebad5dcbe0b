"""QSA key selection against a per-query statement of the rule, and gathered-row attention against a
dense masked attention over the whole context (the plain reference)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tierlm.kernels.qsa_block_scores import block_scores
from tierlm.kernels.qsa_row_cache import attend_rows
from tierlm.model.cache import QSADeviceKV, QSAIndexerState
from tierlm.model.layers.qsa_attention import QSAAttention, QSAIndexer, Selection


class _Config:
    indexer_n_heads, indexer_head_dim, indexer_compress_ratio, indexer_budget = 3, 8, 4, 12
    hidden_size, rms_norm_eps = 16, 1e-6
    num_attention_heads, num_key_value_heads, head_dim, attention_bias = 4, 2, 8, False


def chosen_sets(indexer, q, block_keys, positions):
    token_pos, valid = indexer.choose(indexer.scores(q, block_keys, positions), positions)
    return [set(token_pos[i][valid[i]].tolist()) for i in range(len(positions))]


def test_selection_is_top_blocks_plus_open_tail():
    torch.manual_seed(0)
    indexer = QSAIndexer(_Config())
    r, topk = 4, 3
    context, chunk = 30, 21
    kv_len = context + chunk
    positions = torch.arange(context, kv_len)
    q = torch.randn(chunk, 3, 8)
    q[::3] = -q[::3].abs()  # every score of these queries is relu(negative) = 0: a full tie
    block_keys = torch.randn(kv_len // r, 8).abs()
    got = chosen_sets(indexer, q, block_keys, positions)
    for i, p in enumerate(positions.tolist()):
        nb = (p + 1) // r
        scores = torch.relu(q[i] @ block_keys[:nb].T).sum(0) / math.sqrt(8)
        # top scores, ties to the lower block index
        chosen = set(sorted(range(nb), key=lambda j: (-float(scores[j]), j))[: min(topk, nb)])
        expected = {j for j in range(p + 1) if j // r in chosen or j >= nb * r}
        assert got[i] == expected
        if nb > topk:  # late queries really are sparse: the budget drops blocks
            assert len(expected) < p + 1


def test_decode_block_scores_choose_the_same():
    """The decode form (each query's keys read through its block table, `kernels/qsa_block_scores`)
    equals the shared-keys form."""
    torch.manual_seed(1)
    indexer = QSAIndexer(_Config())
    positions = torch.tensor([3, 17, 40, 41, 63])
    q = torch.randn(5, 3, 8)
    block_keys = torch.randn(16, 8)  # 64 tokens: 8 paged blocks of 8 tokens, 2 keys each
    physical = torch.randperm(9)[:8]
    index_keys = torch.randn(9, 2, 8)
    index_keys[physical] = block_keys.view(8, 2, 8)
    tables = torch.cat([physical, torch.tensor([-1, -1])]).expand(5, -1)  # padded past the end
    decode = block_scores(q, index_keys, tables, positions, 4)
    shared = indexer.scores(q, block_keys, positions)
    assert torch.equal(decode[:, 16:], torch.full((5, 4), float("-inf")))
    torch.testing.assert_close(decode[:, :16], shared, rtol=1e-6, atol=1e-6)
    assert [set(s.tolist()) for s in indexer.choose(decode, positions)[0]] == [
        set(s.tolist()) for s in indexer.choose(shared, positions)[0]
    ]


def test_gathered_attention_equals_dense_masked_attention():
    torch.manual_seed(2)
    attention = QSAAttention(_Config())
    block_size, blocks, kv_len = 8, 6, 45
    kv = QSADeviceKV(torch.randn(blocks + 1, block_size, 2, 8), torch.randn(blocks + 1, block_size, 2, 8))
    paging = QSAIndexerState(torch.zeros(1, 4, 8), torch.zeros(blocks + 1, block_size // 4, 8), block_size, blocks)
    table = torch.tensor([4, 0, 5, 2, 1, 3])  # a shuffled block table
    positions = torch.arange(30, kv_len)
    q = torch.randn(len(positions), 4, 8)
    scores = attention.indexer.scores(torch.randn(len(positions), 3, 8), torch.randn(kv_len // 4, 8), positions)
    token_pos, valid = attention.indexer.choose(scores, positions)
    selection = Selection.of(token_pos, valid, table.expand(len(positions), -1), paging)
    got = attend_rows(q, *kv.gather(selection.rows), selection.valid, attention.scale)
    # reference: every context key, a boolean mask of the chosen ones
    keys = kv.key_cache[table].flatten(0, 1)[:kv_len].transpose(0, 1)
    values = kv.value_cache[table].flatten(0, 1)[:kv_len].transpose(0, 1)
    mask = torch.zeros(len(positions), kv_len, dtype=torch.bool)
    for i in range(len(positions)):
        mask[i, token_pos[i][valid[i]]] = True
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask,
        scale=8**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)
    assert torch.allclose(got, expected, atol=1e-6)


def test_prefill_query_groups_stay_within_their_working_memory():
    """The tensors a prefill query group allocates fit PREFILL_GROUP_BYTES: in place, its fp32 scores
    [group, keys] and its rows and validity [group, S]; on the torch paths also the fp32 products of every
    indexer head [group, ih, keys] and its gathered K and V rows. At long context the in-place group holds
    many times the queries."""
    import tierlm.model.layers.qsa_attention as qsa

    attention = QSAAttention(_Config())
    selected = 12 + 4 - 1  # budget + R - 1 rows a query
    for keys in (10, 5000, 65536):
        in_place = attention.query_group(keys, torch.float32, True)
        torch_paths = attention.query_group(keys, torch.float32, False)
        assert in_place * (keys * 4 + selected * (8 + 1)) <= qsa.PREFILL_GROUP_BYTES
        assert torch_paths * (keys * 3 * 4 + selected * 2 * 2 * 8 * 4) <= qsa.PREFILL_GROUP_BYTES
        assert in_place >= torch_paths >= 1
    assert attention.query_group(65536, torch.float32, True) > 5 * attention.query_group(65536, torch.float32, False)
