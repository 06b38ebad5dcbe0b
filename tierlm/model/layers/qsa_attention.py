"""QSA indexed sparse attention: an indexer picks which K/V rows each query may attend to.

Main attention: gated query heads (q_proj gives [query | gate] per head), q/k Gemma RMS norms, partial
RoPE, GQA, output * sigmoid(gate), o_proj. The indexer scores compressed key blocks: block j (tokens
[jR, jR+R)) has one key, k_layernorm(mean of its raw keys) roped at position jR; a query at position p
sees nb = (p+1)//R complete blocks, scores each as sum_h relu(q_h . K_j)/sqrt(d), keeps the top
min(budget/R, nb), and may attend to their tokens plus the open tail [nb*R, p].

Storage (see `model_cache`): K/V rows paged by `slot_mapping`; a block's compressed key is written once,
when its R-th token arrives; the raw keys of the still-open block wait in the request's ring slot.
Attention reads only the selected rows: each query gathers its (budget + R - 1) K/V rows from the
paged pool and attends to them, so prefill costs O(budget) per token, not O(context); with K/V in host
pools (`qsa_offload`) prefill stages the selected rows through a device arena and decode reads them over
UVA through a VRAM row cache. Prefill and mixed batches go request by request, each request's queries
in groups whose working memory is bounded (`query_group`), attending on CUDA through a kernel that reads
the selected rows in place (`kernels/qsa_sparse_attention`; TIERLM_NO_TRITON_QSA_PREFILL=1: the gather
+ SDPA path CPU runs); decode-only batches run all requests at once
in a static-shape, sync-free form (what a CUDA graph captures). The indexer's work follows the context,
not max_model_len: a request scores only the compressed keys up to its own position (a static batch up
to its block-table width, which `static_decode` sizes from the batch's longest context), and keeps its
top blocks in block order (`kernels/qsa_selection`: torch.topk and a sort of the chosen few; on CUDA, a
static decode step or a prefill's query group: a radix select in the rows kernels, no sort, the scores
from `kernels/qsa_block_scores`' kernels). The plain reference (a dense boolean mask over the whole
context) lives in the tests.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from tierlm.kernels.norm_rope.naive import apply_rotary
from tierlm.kernels.qsa_block_keys.naive import group_key_rows, store_decode_block_keys
from tierlm.kernels.qsa_block_scores import block_scores, request_scores
from tierlm.kernels.qsa_block_scores.naive import ranking_keys
from tierlm.kernels.qsa_ring import ring_after_rows
from tierlm.kernels.qsa_row_cache import attend_rows
from tierlm.kernels.qsa_selection import chosen_positions, physical_rows, top_keys
from tierlm.model.cache import QSADeviceKV, QSAIndexerState
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.layers.norm import RMSNorm
from tierlm.model.layers.packed_linear import Linear, PackedLinear
from tierlm.model.layers.rotary import Rope
from tierlm.model.qsa_offload import OffloadedKV

PREFILL_GROUP_BYTES = 256 << 20  # working memory of one group of prefill queries (see `query_group`)


def top_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k highest scores per row, highest first, ties going to the lower block index.

    relu makes exact-zero scores common, and torch.topk breaks ties differently for different row
    widths; so the choice is made a property of the scores alone (a request selects the same blocks
    whatever else is in its batch) by giving torch.topk unique keys (`ranking_keys`). No full sort.
    """
    indices = torch.topk(ranking_keys(scores), k, dim=-1).indices
    return scores.gather(-1, indices), indices


def sparse_kernel_applies(q: torch.Tensor) -> bool:
    """Prefill attention through `kernels/qsa_sparse_attention`'s Triton kernel (device pools read in
    place; offloaded pools through the arena), and the indexer's block scores of a request's queries
    through `kernels/qsa_block_scores`' prefill kernel: on CUDA, unless TIERLM_NO_TRITON_QSA_PREFILL=1."""
    return q.is_cuda and not os.environ.get("TIERLM_NO_TRITON_QSA_PREFILL")


def norm_rope_fuses(x: torch.Tensor) -> bool:
    """Norm + rotary through `kernels/norm_rope`'s kernel: on CUDA, unless TIERLM_NO_FUSED_NORM_ROPE=1."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_FUSED_NORM_ROPE")


def norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """norm(x) then rotary, x [N, heads, D]: on CUDA one launch (`kernels/norm_rope`), unless
    TIERLM_NO_FUSED_NORM_ROPE=1; else the torch ops."""
    if norm_rope_fuses(x):
        from tierlm.kernels.norm_rope.triton import triton_norm_rope

        return triton_norm_rope(x, norm.weight, norm.eps, cos, sin)
    return apply_rotary(norm(x), cos, sin)


def norm_rope_rows(norm: RMSNorm, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """`norm_rope` at the batch's rows; a text batch's kernel computes the angles from the positions
    (no cos/sin tables)."""
    if norm_rope_fuses(x) and rope.positions is not None:
        from tierlm.kernels.norm_rope.triton import triton_norm_rope_at

        return triton_norm_rope_at(x, norm.weight, norm.eps, rope.positions, rope.inv_freq)
    return norm_rope(norm, x, rope.cos, rope.sin)


def kv_write_fuses(kv: QSADeviceKV | OffloadedKV, x: torch.Tensor, rope: Rope) -> bool:
    """New keys normed, roped and written into a device pool with their values by the norm + rotary
    kernel itself (a text batch on CUDA), unless TIERLM_NO_FUSED_QSA_KV_WRITE=1 (or the norm + rotary
    kernel is off)."""
    return (isinstance(kv, QSADeviceKV) and rope.positions is not None and norm_rope_fuses(x)
            and not os.environ.get("TIERLM_NO_FUSED_QSA_KV_WRITE"))


def selection_fuses(x: torch.Tensor) -> bool:
    """Selection through `kernels/qsa_selection`'s kernels (top-k and rows without a sort) for a static
    decode batch or a prefill's query group: on CUDA, unless TIERLM_NO_FUSED_QSA_SELECT=1."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_FUSED_QSA_SELECT")


def block_key_store_fuses(x: torch.Tensor, rope: Rope) -> bool:
    """A decode step's indexer key store as one launch (`kernels/qsa_block_keys`): a text batch on CUDA,
    unless TIERLM_NO_FUSED_QSA_BLOCK_KEYS=1."""
    return x.is_cuda and rope.positions is not None and not os.environ.get("TIERLM_NO_FUSED_QSA_BLOCK_KEYS")


def verify_keys_fuse(x: torch.Tensor, rope: Rope) -> bool:
    """A verification batch's block keys through the decode key store's kernel, a row at a time
    (`store_verify_keys_by_row`): where the decode key store fuses, unless TIERLM_NO_FUSED_QSA_VERIFY_KEYS=1."""
    return block_key_store_fuses(x, rope) and not os.environ.get("TIERLM_NO_FUSED_QSA_VERIFY_KEYS")


def store_verify_keys_by_row(
    raw_keys: torch.Tensor, ring: torch.Tensor, index_keys: torch.Tensor, row_slots: torch.Tensor,
    positions: torch.Tensor, row_tables: torch.Tensor, weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
    block_size: int, scratch_block: int, store=store_decode_block_keys,
) -> None:
    """A verification batch's block keys, once its rings are in its row slots (`kernels/qsa_ring`): each row
    taken as a decode step of its own (its raw key, its row slot's ring, its position, its request's block
    table), so the decode key store (`store`: `kernels/qsa_block_keys`' reference or its one launch) writes
    the keys of the rows that close a group, from the angles at the group's start. Its write of the row's
    raw key into the ring rewrites the value already there. row_slots [B, T]; raw_keys, positions [B*T];
    row_tables [B*T, W] each row's block table (`ForwardBatch.verify_row_tables`: made once a forward). In
    place of the rotary tables at the group starts (7 small kernels a forward) and the torch compress (4 to
    6 a layer)."""
    store(raw_keys, ring, index_keys, row_slots.flatten(), positions, row_tables, weight, eps, inv_freq, block_size,
          scratch_block)


def ring_fuses(x: torch.Tensor) -> bool:
    """A verification batch's indexer rings and key rows as one launch (`kernels/qsa_ring`): on CUDA, unless
    TIERLM_NO_FUSED_QSA_RING=1."""
    return x.is_cuda and not os.environ.get("TIERLM_NO_FUSED_QSA_RING")


def gate_fuses() -> bool:
    """The output gate applied by decode attention itself (on CUDA in its merge kernel), unless
    TIERLM_NO_FUSED_QSA_GATE=1 (then by the layer's torch ops, as in prefill)."""
    return not os.environ.get("TIERLM_NO_FUSED_QSA_GATE")


def gather_rows(pool: torch.Tensor, block_table: torch.Tensor, count: int, rows_per_block: int) -> torch.Tensor:
    """The first `count` logical rows of a paged pool [num_blocks, rows_per_block, ...] for one request."""
    if count == 0:
        return pool.new_empty((0, *pool.shape[2:]))
    blocks = block_table[: math.ceil(count / rows_per_block)]
    return pool[blocks].flatten(0, 1)[:count]


class QSAIndexer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.n_heads, self.head_dim = c.indexer_n_heads, c.indexer_head_dim
        self.ratio, self.block_topk = c.indexer_compress_ratio, c.indexer_budget // c.indexer_compress_ratio
        self.index_qk_proj = Linear(c.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (raw queries [N, ih, id], raw keys [N, id]); `queries` norms and ropes the queries
        (left out where a decode step needs no scores)."""
        q, raw_keys = self.index_qk_proj(x).split([self.n_heads * self.head_dim, self.head_dim], dim=-1)
        return q.unflatten(-1, (self.n_heads, self.head_dim)), raw_keys

    def queries(self, raw_queries: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Raw queries [N, ih, id] at the batch's rows -> roped, normed queries."""
        return norm_rope_rows(self.q_layernorm, raw_queries, rope)

    def compress(self, raw_group_keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """raw keys [G, R, id] of complete blocks -> block keys [G, id] (cos/sin at each block start)."""
        pooled = raw_group_keys.float().mean(dim=1).to(raw_group_keys.dtype)
        return norm_rope(self.k_layernorm, pooled.unsqueeze(1), cos, sin).squeeze(1)

    def store_block_keys(
        self, raw_keys: torch.Tensor, context_len: int, slot: int, block_table: torch.Tensor,
        state: QSAIndexerState, rope: Rope, request: int, position_slots: list[int] = (),
    ) -> None:
        """Complete the blocks this chunk closes, write their keys, keep the open block's raw keys.
        request: the request's index in the batch (`rope` looks block starts up by it);
        position_slots (speculative verification): slots that receive the ring after each row but the last."""
        r = self.ratio
        carried = context_len % r
        pending = torch.cat([state.ring[slot, :carried], raw_keys])  # from position context_len - carried
        for t, target in enumerate(position_slots):
            seen = carried + t + 1  # pending rows up to row t; the open group is the last `seen % r` of them
            if seen % r:
                state.ring[target, : seen % r] = pending[seen - seen % r : seen]
        first_block = context_len // r
        complete = pending.shape[0] // r
        if complete:
            starts = torch.arange(first_block, first_block + complete, device=raw_keys.device) * r
            cos, sin = rope.at(starts, request)
            keys = self.compress(pending[: complete * r].unflatten(0, (complete, r)), cos, sin)
            rows = group_key_rows(block_table[None], starts[None], True, state.block_size, r, state.scratch_block)
            state.keys.view(-1, self.head_dim)[rows[0]] = keys
        left = pending[complete * r :]
        state.ring[slot, : left.shape[0]] = left

    def scores(self, q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Block scores [M, G] of queries q [M, ih, id] against one request's block keys [G, id]; blocks a
        query cannot see yet (j >= (p+1)//R) score -inf (`kernels/qsa_block_scores.request_scores`: on CUDA
        its kernel, unless TIERLM_NO_TRITON_QSA_PREFILL=1). (Static decode batches: `block_scores`.)"""
        if sparse_kernel_applies(q):
            from tierlm.kernels.qsa_block_scores.triton import triton_request_scores

            return triton_request_scores(q, block_keys, positions, self.ratio)
        return request_scores(q, block_keys, positions, self.ratio)

    def select(self, scores: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
               state: QSAIndexerState) -> Selection:
        """A prefill query group's selection from its block scores [M, G] (`scores`): the kernels where
        `selection_fuses` (bit-identical rows; the torch top-k over a long context was most of a long
        prefill's QSA time), else `choose`. tables: [M, W], the request's block table for each query."""
        if selection_fuses(scores):
            from tierlm.kernels.qsa_selection.triton import triton_selection_rows

            return Selection(*triton_selection_rows(scores, positions, tables, self.ratio, state.block_size,
                                                    state.scratch_block, self.block_topk))
        return Selection.of(*self.choose(scores, positions), tables, state)

    def choose(self, scores: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token positions [M, S] each query attends to and their validity [M, S], S = budget + R - 1:
        the tokens of its top blocks (ties to the lower block) in block order, then its open tail [nb*R, p]."""
        # -inf (unseen) blocks rank after every visible one: one top-k serves queries of any position
        return chosen_positions(top_keys(ranking_keys(scores), self.block_topk), positions, self.ratio)

    # ---- decode: one token per request, static shapes, no host sync ------------------------------------
    def store_block_key_decode(
        self, raw_keys: torch.Tensor, batch: ForwardBatch, state: QSAIndexerState, rope: Rope
    ) -> None:
        """Put each new raw key in its request's ring; where it closes a block, write the block's key.

        The block key is computed for every request and written to the scratch block where the block is
        not complete yet, so the work does not depend on the data. A text batch on CUDA: one launch
        (`kernels/qsa_block_keys`; TIERLM_NO_FUSED_QSA_BLOCK_KEYS=1: these torch ops).
        """
        if block_key_store_fuses(raw_keys, rope):
            from tierlm.kernels.qsa_block_keys.triton import triton_store_decode_block_keys

            triton_store_decode_block_keys(
                raw_keys, state.ring, state.keys, batch.slots, batch.context_lens_tensor, batch.block_tables,
                self.k_layernorm.weight, self.k_layernorm.eps, rope.inv_freq, state.block_size, state.scratch_block,
            )
            return
        r = self.ratio
        context = batch.context_lens_tensor
        offset = context % r
        state.ring[batch.slots, offset] = raw_keys
        starts = context - offset  # first position of the open block (the decode row's group start)
        cos, sin = rope.group_starts_at(r)
        keys = self.compress(state.ring[batch.slots], cos, sin)
        row = group_key_rows(batch.block_tables, starts[:, None], (offset == r - 1)[:, None], state.block_size, r,
                             state.scratch_block)
        state.keys.view(-1, self.head_dim)[row[:, 0]] = keys

    def store_block_keys_verify(
        self, raw_keys: torch.Tensor, batch: ForwardBatch, state: QSAIndexerState, rope: Rope
    ) -> None:
        """`store_block_key_decode` for a verification batch's T rows per request: the ring after each row
        (its open group's raw keys: from the request's ring, then from its rows) goes to that row's slot
        (`batch.verify_slots`), and a row that closes a block writes the block's key. Static shapes; on
        CUDA the rings and key rows in one launch (`kernels/qsa_ring`; TIERLM_NO_FUSED_QSA_RING=1: torch), and
        the keys through the decode key store's kernel, row by row (`store_verify_keys_by_row`)."""
        ring_rows = ring_after_rows
        if ring_fuses(raw_keys):
            from tierlm.kernels.qsa_ring.triton import triton_ring_after_rows as ring_rows
        rings, key_rows = ring_rows(
            state.ring, batch.slots, raw_keys, batch.positions, batch.context_lens_tensor, batch.verify_slots,
            batch.block_tables, state.block_size, state.scratch_block)
        if verify_keys_fuse(raw_keys, rope):
            from tierlm.kernels.qsa_block_keys.triton import triton_store_decode_block_keys

            store_verify_keys_by_row(
                raw_keys, state.ring, state.keys, batch.verify_slots, batch.positions, rope.verify_row_tables,
                self.k_layernorm.weight, self.k_layernorm.eps, rope.inv_freq, state.block_size, state.scratch_block,
                triton_store_decode_block_keys)
            return
        cos, sin = rope.group_starts_at(self.ratio, rows_per_request=batch.verify_slots.shape[1])
        state.keys.view(-1, self.head_dim)[key_rows] = self.compress(rings, cos, sin)

    def select_decode(self, raw_q: torch.Tensor, batch: ForwardBatch, state: QSAIndexerState, rope: Rope) -> Selection:
        """The K/V rows each request's query (raw_q: its raw indexer queries, `project`) attends to: its top
        blocks' tokens and its open tail.

        Scores are [B, G] with G the blocks of the batch's block-table width (`static_decode` picks that
        width per step from the batch's longest context), unseen ones -inf. A static batch scores in one
        sync-free call (`kernels/qsa_block_scores`: on CUDA a kernel that reads only each request's
        visible keys), any other batch request by request, each over its visible keys. On CUDA a static
        batch goes scores -> rows (top-k without a sort, `kernels/qsa_selection`: one launch for the rows,
        or a few over many programs a request for long tables), the rows alone where the table holds at
        most budget / R blocks (every seen block is chosen: no scores), the scores of requests that see at
        most that many left out (TIERLM_NO_FUSED_QSA_SELECT=1: the torch ops)."""
        if batch.static and selection_fuses(raw_q):
            from tierlm.kernels.qsa_block_scores.triton import triton_block_scores
            from tierlm.kernels.qsa_selection.triton import triton_selection_rows

            groups = batch.block_tables.shape[1] * (state.block_size // self.ratio)
            scores = None
            if groups > self.block_topk:
                scores = triton_block_scores(self.queries(raw_q, rope), state.keys, batch.block_tables,
                                             batch.positions, self.ratio, skip_up_to=self.block_topk)
            return Selection(*triton_selection_rows(scores, batch.positions, batch.block_tables, self.ratio,
                                                    state.block_size, state.scratch_block, self.block_topk))
        q = self.queries(raw_q, rope)
        if batch.static:
            score = block_scores
            if q.is_cuda:
                from tierlm.kernels.qsa_block_scores.triton import triton_block_scores as score
            scores = score(q, state.keys, batch.block_tables, batch.positions, self.ratio)
        else:
            scores = self.visible_scores(q, batch, state)
        token_pos, valid = self.choose(scores, batch.positions)
        return Selection.of(token_pos, valid, batch.block_tables, state)

    def visible_scores(self, q: torch.Tensor, batch: ForwardBatch, state: QSAIndexerState) -> torch.Tensor:
        """Decode block scores [B, G = W * bs / R] where each request scores only the nb = (p+1)//R blocks
        its query sees (varlen: a short request beside a long one costs its own length); the rest -inf."""
        per_block = state.block_size // self.ratio
        scores = torch.full((batch.num_requests, batch.block_tables.shape[1] * per_block), float("-inf"),
                            device=q.device)
        for i, context in enumerate(batch.context_lens):
            visible = (context + 1) // self.ratio
            block_keys = gather_rows(state.keys, batch.block_tables[i], visible, per_block)
            scores[i, :visible] = self.scores(q[i : i + 1], block_keys, batch.positions[i : i + 1])[0]
        return scores


class Selection:
    """What a QSA layer reads for each query: physical K/V rows [M, S] and their validity [M, S]
    (invalid entries point at the scratch block, so every read stays in bounds)."""

    def __init__(self, rows: torch.Tensor, valid: torch.Tensor) -> None:
        self.rows, self.valid = rows, valid

    @classmethod
    def of(
        cls, token_pos: torch.Tensor, valid: torch.Tensor, tables: torch.Tensor, state: QSAIndexerState
    ) -> Selection:
        """tables: [M, W] block tables (one per query row; an expanded view for one request's queries);
        state: the paging (block_size, scratch_block) the layer's caches share."""
        return cls(physical_rows(token_pos, valid, tables, state.block_size, state.scratch_block), valid)


class QSAAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h, bias = c.hidden_size, c.attention_bias
        kv_width = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            h, {"q_proj": 2 * self.num_heads * self.head_dim, "k_proj": kv_width, "v_proj": kv_width}, bias=bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.indexer = QSAIndexer(c)
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, kv: QSADeviceKV | OffloadedKV, state: QSAIndexerState, rope: Rope
    ) -> torch.Tensor:
        n = x.shape[0]
        q_and_gate, k, v = self.qkv_proj(x)
        q, gate = q_and_gate.reshape(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # gate [N, nh, hd]
        q = norm_rope_rows(self.q_norm, q, rope)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if kv_write_fuses(kv, x, rope):
            from tierlm.kernels.norm_rope.triton import triton_norm_rope_kv_write

            triton_norm_rope_kv_write(k, self.k_norm.weight, self.k_norm.eps, rope.positions, rope.inv_freq, v,
                                      batch.slot_mapping, kv.key_rows, kv.value_rows)
        else:
            kv.write(batch.slot_mapping, norm_rope_rows(self.k_norm, k, rope), v)

        raw_index_q, raw_keys = self.indexer.project(x)
        if batch.is_decode_only:
            return self._decode(q, gate, raw_index_q, raw_keys, batch, kv, state, rope)
        if batch.verify_slots is not None:  # every row as a decode query (their K/V are all written above)
            self.indexer.store_block_keys_verify(raw_keys, batch, state, rope)
            selection = self.indexer.select_decode(raw_index_q, batch.verify_rows(rope.verify_row_tables), state,
                                                   rope)
            return self._attend_decode(q, gate, selection, kv)
        index_q = self.indexer.queries(raw_index_q, rope)
        out = torch.empty(n, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        r, bs = self.indexer.ratio, state.block_size
        in_place = sparse_kernel_applies(x) and selection_fuses(x) and not isinstance(kv, OffloadedKV)
        for i, (start, end) in enumerate(batch.bounds):
            table, ctx = batch.block_tables[i], batch.context_lens[i]
            self.indexer.store_block_keys(
                raw_keys[start:end], ctx, batch.state_slots[i], table, state, rope, i,
                batch.position_slots[i] if batch.position_slots else (),
            )
            block_keys = gather_rows(state.keys, table, (ctx + end - start) // r, bs // r)
            tables = torch.where(table < 0, state.scratch_block, table)
            group = self.query_group(block_keys.shape[0], x.dtype, in_place)
            groups = [(lo, min(lo + group, end)) for lo in range(start, end, group)]  # bounded working memory
            selections = []
            for lo, hi in groups:
                positions = batch.positions[lo:hi]
                scores = self.indexer.scores(index_q[lo:hi], block_keys, positions)
                selections.append(self.indexer.select(scores, positions, tables.expand(hi - lo, -1), state))
            rows, valid = torch.cat([s.rows for s in selections]), torch.cat([s.valid for s in selections])
            if sparse_kernel_applies(q):  # rows read by index: no [queries x rows] copy
                if isinstance(kv, OffloadedKV):
                    out[start:end] = kv.prefill_attention(q[start:end], rows, valid, self.scale)
                    continue
                from tierlm.kernels.qsa_sparse_attention.triton import triton_sparse_attention

                out[start:end] = triton_sparse_attention(q[start:end], kv.key_rows, kv.value_rows, rows, valid,
                                                         self.scale)
                continue
            read = kv.prefill_reader(rows, valid)  # from device pools, or staged from host pools
            for lo, hi in groups:
                keys, values = read(lo - start, hi - start)
                out[lo:hi] = attend_rows(q[lo:hi], keys, values, valid[lo - start : hi - start], self.scale)
        return self._output(out, gate)

    def query_group(self, num_block_keys: int, dtype: torch.dtype, in_place: bool) -> int:
        """How many prefill queries to score, select and attend at once so that their working tensors
        stay within PREFILL_GROUP_BYTES. Per query: its fp32 scores over every block key of the context
        and its S selected rows and their validity; on the torch paths also the indexer's fp32 products of
        every head and its top-k keys, its S gathered K and V rows and its fp32 attention weights. At the
        target model's shapes and 262k context that is ~10 MB a query on the torch paths (a whole chunk at
        once would take GBs); in_place (the indexer's kernels, and attention reading the device pools in
        place): ~0.3 MB, so a group holds ~30x the queries (fewer, larger launches)."""
        selected = self.indexer.block_topk * self.indexer.ratio + self.indexer.ratio - 1
        per_query = num_block_keys * 4 + selected * 9
        if not in_place:
            per_query += num_block_keys * (4 * self.indexer.n_heads + 16)
            per_query += selected * (2 * self.num_kv_heads * self.head_dim * dtype.itemsize + 4 * self.num_heads)
        return max(1, PREFILL_GROUP_BYTES // per_query)

    def _decode(
        self, q, gate, raw_index_q, raw_keys, batch: ForwardBatch, kv: QSADeviceKV | OffloadedKV,
        state: QSAIndexerState, rope: Rope,
    ) -> torch.Tensor:
        self.indexer.store_block_key_decode(raw_keys, batch, state, rope)
        return self._attend_decode(q, gate, self.indexer.select_decode(raw_index_q, batch, state, rope), kv)

    def _attend_decode(self, q, gate, selection: Selection, kv: QSADeviceKV | OffloadedKV) -> torch.Tensor:
        """Decode attention over the selected rows, gated (`gate_fuses`: by the attention itself), through
        o_proj."""
        fused = gate_fuses()
        out = kv.decode_attention(q, selection.rows, selection.valid, self.scale, gate if fused else None)
        return self._output(out, None if fused else gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [N, nh, hd] times sigmoid(gate) (None: applied already), through o_proj."""
        return self.o_proj((out if gate is None else out * torch.sigmoid(gate)).flatten(1))
