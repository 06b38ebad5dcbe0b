"""Decode steps as fixed-shape forwards: replayed from CUDA graphs, or compiled with torch.compile.

A decode step of a small model is ~1,500 tiny ops; its time is dispatch and launch overhead, not
arithmetic. The decode path is static-shape and sync-free (see the layers), so one forward per shape
can be captured once (GPU: a CUDA graph) or compiled once (CPU: torch.compile fuses the ops into a few
kernels) and then reused: each step's inputs are copied into fixed input buffers, the forward runs on
them, and the logits come out of a fixed output buffer.

A shape is a (batch size, block-table width) pair. A batch of B requests runs at the smallest prepared
size >= B; padding rows point at the cache's scratch slot and scratch block, so they never touch a real
request's state. The width is the smallest prepared width >= the batch's longest block table: widths
double from one covering FIRST_WIDTH_TOKENS up to max_model_len, so what a step reads and scores (the
QSA indexer scores every compressed key of the table) follows the batch's context, not max_model_len.
Mode "eager" runs the same padded batches without capture or compilation: that is how the padding is
tested without a GPU.

Speculative decoding's verification steps have fixed shapes too: with rows_per_request T = 1 + K, a runner
prepares batches of T rows per request (the last token and K drafts, `ForwardBatch.verify_slots` naming
the slots that keep the state after each row), and its forwards return every row's logits and streams
(`forward_with_streams`, what the draft head reads). And the MTP draft head's one-row-per-request steps
(`draft_layer`): the hidden streams it reads come in through an input buffer too, and the draft logits
and output streams come back. A verification runner with `greedy_speculation` also prepares, per shape,
the whole greedy speculative step (`GreedySpeculation`: verify, accept, roll back, draft, one readback
tensor) as a second graph in the same memory pool (`replay_greedy`), and as a third its part after the
verify forward, on the verify rows' argmaxes the host wrote (of penalized logits; `replay_accept`). The
greedy graph resolves its input ids and takes its K/V rows from the block table on the device (one launch
on CUDA: kernels/speculative_step) and ends by writing the next greedy step's inputs into the buffers from
its own outcome (`GreedySpeculation`'s `following`): overlap scheduling launches that step before the host
has read this one (`stage_chained` then sends only the block-table entries that changed).

Inputs come two ways. `run(batch)` copies a built `ForwardBatch`'s device tensors into the buffers (the
pipeline stages and the speculative runners use it). `run_decode(...)` (plain decode, one row per request)
takes the engine's host lists and writes them straight into the buffers: each step fills a pinned host
staging buffer (ids, positions, context lengths, slots, K/V rows, token picks, and the block-table
entries that changed since the last step: a host mirror remembers which request's block list each row
holds and how much of it is on the device) and sends it in one host-to-device copy; the changed table
entries are scattered from there. A row's token source >= 0 takes its input id from the previous step's
sampled ids on the device (overlap scheduling: the host launches a step before it has read the ids of the
one before); the ids are resolved inside the graph, by one gather: the previous step's sampled ids are
copied into the buffer right before the input ids, and each row's pick (staged by the host) indexes that
pair, its source or its own input id. `stage_verify` does the same for a verification step
(T rows per request and their row-state slots), returning the batch its buffers hold.

A decode runner with `greedy_readback` (the engine's, without speculation) also takes every row's argmax
and status inside its graph, after the forward, into `argmax_readback`: a step whose rows are all plain
greedy without log-probabilities (engine/model_runner.py) then samples with nothing launched after the
replay but one small copy to the host. A speculative engine's decode runner (`with_streams`: its steps
without drafts) returns the rows' streams too, and captures its graphs in the verify runner's memory pool.

Every forward of a prepared shape is captured, compiled or run inside `decode_step_rows(rows)` (its size
x rows_per_request rows): its kernels take the programmatic dependent launch trigger of a step of that
many rows (kernels/dependent_launch.py `PDL_TRIGGERS_BY_ROWS`), which a graph keeps from its capture.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from tierlm.kernels.dependent_launch import decode_step_rows
from tierlm.model.forward_batch import ForwardBatch
from tierlm.model.model_cache import ModelCache
from tierlm.model.speculative_step import GreedySpeculation, NextInputs, step_kernels

MODES = ("cuda_graph", "compile", "eager")
# the narrowest prepared block table, in tokens: scoring this many tokens' compressed keys costs little
# beside the rest of a decode step, and fewer widths mean fewer graphs
FIRST_WIDTH_TOKENS = 4096


def runner_mode(device: torch.device, compile_decode: bool, enforce_eager: bool) -> str | None:
    """The mode an engine's static runner takes on `device` (None: every step eager): CUDA graphs on CUDA,
    torch.compile on CPU when asked. TIERLM_STATIC_DECODE_EAGER=1 makes it "eager" on CPU: the padded
    static batches and their inputs tested without a GPU (or a compile)."""
    if enforce_eager:
        return None
    if device.type == "cuda":
        return "cuda_graph"
    if compile_decode:
        return "compile"
    return "eager" if os.environ.get("TIERLM_STATIC_DECODE_EAGER") else None


def prepared_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def prepared_widths(max_blocks: int, first: int) -> list[int]:
    """Block-table widths: `first` blocks, doubling while below max_blocks, then max_blocks itself."""
    widths, width = [], max(1, first)
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return widths + [max_blocks]


class StaticDecodeRunner:
    def __init__(
        self, model, cache: ModelCache, max_batch: int, max_blocks_per_request: int, mode: str,
        sizes: list[int] | None = None, ple_embedding_dims: dict[int, int] | None = None,
        widths: list[int] | None = None, stage_input_width: int | None = None, rows_per_request: int = 1,
        draft_layer: int | None = None, greedy_speculation: bool = False, with_streams: bool = False,
        graph_pool=None, greedy_readback=None,
    ) -> None:
        """sizes: the batch sizes to prepare (default `prepared_sizes(max_batch)`); the largest is max_batch.
        widths: the block-table widths to prepare (default `prepared_widths` from FIRST_WIDTH_TOKENS); the
        largest is max_blocks_per_request.
        ple_embedding_dims: {PLE index: width} when the host gathers PLE embeddings (mapped tables).
        stage_input_width: a pipeline stage after the first: the width of the hidden state it receives
        (`ForwardBatch.stage_input`), copied into an input buffer like the token ids.
        rows_per_request: T > 1 prepares speculative verification steps of T rows per request instead of
        decode steps (see the module docstring).
        draft_layer: prepares steps of the MTP draft head (`model.draft` at a draft step running that layer)
        instead: one row per request, `run` takes the hidden streams.
        greedy_speculation: with T = 1 + K rows per request, also prepares each shape's whole greedy
        speculative step (`GreedySpeculation`: verify, accept, roll back, draft; `replay_greedy`) and its
        part after the verify forward (`replay_accept`), a CUDA graph each per shape (modes "cuda_graph" and
        "eager"; not "compile").
        with_streams: decode steps (one row per request) that also return every row's streams
        (`forward_with_streams`): the speculative engine's steps without drafts, whose rows the draft head
        reads next.
        graph_pool: the CUDA graph memory pool to capture into (another runner's `graph_pool`, whose graphs
        never run at the same time as these: one stream, every output kept): the forwards' temporaries
        then share its memory; only the outputs are new.
        greedy_readback: a function (logits [size, vocab], out [size, 2] int64) writing each row's argmax and
        status into out (engine/sampling_pass.py `greedy_readback`), run after every forward of a decode runner
        (inside its graph) on `argmax_readback`: a step of plain greedy rows then needs no sampling launch."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: choose one of {MODES}")
        if greedy_speculation and (rows_per_request < 2 or draft_layer is not None or mode == "compile"):
            raise ValueError("greedy_speculation: a verification runner (rows_per_request > 1, no draft_layer), "
                             "in mode cuda_graph or eager")
        if (with_streams or greedy_readback is not None) and (rows_per_request != 1 or draft_layer is not None):
            raise ValueError("with_streams, greedy_readback: a decode runner (rows_per_request 1, no draft_layer)")
        if with_streams and greedy_readback is not None:
            raise ValueError("greedy_readback reads the logits alone: not with_streams")
        self.model, self.cache, self.mode = model, cache, mode
        self.sizes = sorted(set(sizes or prepared_sizes(max_batch)) | {max_batch})
        first = math.ceil(FIRST_WIDTH_TOKENS / cache.block_size)
        widths = widths or prepared_widths(max_blocks_per_request, first)
        self.widths = sorted({w for w in widths if w < max_blocks_per_request} | {max_blocks_per_request})
        self.max_batch, self.rows_per_request = max_batch, rows_per_request
        as_long = {"dtype": torch.int64, "device": cache.device}
        max_rows = max_batch * rows_per_request
        # the input buffers every prepared forward reads (a narrower width reads the first columns); the
        # per-row vectors and the table updates are views of one buffer, what `run_decode` copies into
        # (each vector has max_rows entries; context lengths and slots use the first max_batch); verification
        # steps' row-state slots [max_batch, T] follow them (`stage_verify` sends those too)
        m = self.row_capacity = max_rows
        verifies = rows_per_request > 1
        self._updates_at = (NUM_ROW_INPUTS + verifies) * m  # where the block-table updates start
        # the previous step's sampled ids (what token sources name) sit right before the inputs, so that
        # [previous sampled ids | input ids] is one tensor each row's token pick indexes (`_resolve_tokens`)
        buffer = torch.zeros(m + self._updates_at + 2 * max_batch * max_blocks_per_request, **as_long)
        self.previous_tokens, self.inputs = buffer[:m], buffer[m:]
        self._token_candidates = buffer[: 2 * m]
        self.input_ids, self.positions, self.context_lens, self.slots, self.slot_mapping, self.token_picks = (
            self.inputs[i * m : (i + 1) * m] for i in range(NUM_ROW_INPUTS))
        self.token_ids = torch.zeros(m, **as_long)  # what the model reads: input ids, sources resolved
        self._own_picks = torch.arange(m, 2 * m, **as_long)  # row r's own input id: candidate m + r
        self._own_picks_host = self._own_picks.cpu().numpy()
        self.verify_slots = self.inputs[NUM_ROW_INPUTS * m : self._updates_at].view(
            max_batch, rows_per_request) if verifies else None
        self.block_tables = torch.zeros(max_batch, max_blocks_per_request, **as_long)
        self.tables_at = {width: self.block_tables[:, :width] for width in self.widths}  # the columns a width reads
        self._staging = _Staging(self.inputs.numel(), cache.device)
        self.logits_rows = torch.arange(max_rows, **as_long)
        self.ple_embeddings = {
            index: torch.zeros(max_rows, width, dtype=cache.dtype, device=cache.device)
            for index, width in (ple_embedding_dims or {}).items()
        } or None
        self.stage_input = None if stage_input_width is None else torch.zeros(
            max_rows, stage_input_width, dtype=cache.dtype, device=cache.device)
        self.hidden = None if draft_layer is None else torch.zeros(
            max_rows, cache.config.hc_count * cache.config.hidden_size, dtype=cache.dtype, device=cache.device)
        self._pad(0, max_batch, max_blocks_per_request)
        self.shapes = [(size, width) for size in self.sizes for width in self.widths]
        self.batches = {shape: self._static_batch(*shape) for shape in self.shapes}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        # greedy_speculation: per shape, the whole greedy speculative step, and its part after the verify
        # forward (on the argmaxes of penalized logits the host writes into `penalized_best`, and the verify
        # graph's streams)
        self.greedy = GreedySpeculation(model, cache, rows_per_request - 1) if greedy_speculation else None
        self.penalized_best = torch.zeros(max_rows, **as_long) if greedy_speculation else None
        self.greedy_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.greedy_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.accept_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.accept_outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.draft_layer = draft_layer
        self.takes_decode_lists = rows_per_request == 1 and draft_layer is None  # `stage_decode` serves it
        if draft_layer is not None:
            self.step = self._draft_step
        else:
            # what a shape runs
            self.step = model if rows_per_request == 1 and not with_streams else model.forward_with_streams
        # greedy_readback: every decode forward's argmax and status, [max_batch, 2] (rows past the batch: padding)
        self.greedy_readback = greedy_readback
        self.argmax_readback = None if greedy_readback is None else torch.zeros(max_batch, 2, **as_long)
        if greedy_readback is not None:
            self.step = self._decode_with_argmax
        self.forward = self.step
        self.graph_pool = graph_pool  # mode "cuda_graph": the memory pool its graphs were captured into
        if mode == "compile":
            # one compiled graph per prepared shape; shapes never change for a given (size, width)
            self.forward = torch.compile(self.step, dynamic=False)
            # each shape is a recompile of the same code: let all of them be compiled, not run eagerly
            with torch._dynamo.config.patch(recompile_limit=max(8, len(self.shapes))):
                for shape in self.shapes:
                    with self._launching(shape):
                        self.forward(self.batches[shape], cache)
        elif mode == "cuda_graph":
            pool = self._capture(self.step, self.graphs, self.outputs, graph_pool)
            if self.greedy is not None:  # the same pool: one graph runs at a time, each read before the next
                # (the greedy step resolves its ids itself; the accept step's were resolved by the verify's)
                pool = self._capture(self._greedy_step, self.greedy_graphs, self.greedy_outputs, pool, resolve=False)
                pool = self._capture(self._accept_step, self.accept_graphs, self.accept_outputs, pool, resolve=False)
            self.graph_pool = pool
        self._reset_tables()
        cache.reset_row_cache_counters()  # the warm-up and capture forwards served no request

    def _greedy_step(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The whole greedy speculative step on the staged inputs (its ids resolved and its K/V rows taken
        from the block table on the device), ending with the next step's inputs in the buffers (overlap
        scheduling chains steps on them: `stage_chained`): request i's tokens are the token after its
        accepted drafts and its K new drafts, from position start + 1 + a_i; its state is in
        verify_slots[i, a_i], and its row slots move round by a_i + 1, so that one comes last (the host's
        order: engine/speculative.py `SpeculativeRunner.row_slots`). Padding requests stay padding (their
        row slots are all the scratch slot)."""
        rows, size = batch.token_ids.shape[0], batch.num_requests
        step_kernels(self.positions).step_inputs(
            self._token_candidates, self.token_picks[:rows], self.positions[:rows], batch.block_tables,
            self.cache.block_size, self.cache.scratch_block, self.token_ids[:rows], self.slot_mapping[:rows])
        following = NextInputs(self.input_ids[:rows], self.positions[:rows], self.context_lens[:size],
                               self.slots[:size], self.verify_slots[:size], self.cache.scratch_slot)
        return self.greedy(batch, cache, following)

    def _accept_step(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The greedy step after its verify forward: on `penalized_best` and the streams of this shape's forward."""
        rows, size = batch.token_ids.shape[0], batch.num_requests
        streams = self.outputs[size, batch.block_tables.shape[1]][1]
        return self.greedy.accept_and_draft(batch, self.penalized_best[:rows].view(size, self.rows_per_request),
                                            streams[:rows])

    def _decode_with_argmax(self, batch: ForwardBatch, cache: ModelCache) -> torch.Tensor:
        """The decode forward's logits, its rows' argmax and status written into `argmax_readback`."""
        logits = self.model(batch, cache)
        self.greedy_readback(logits, self.argmax_readback[: batch.num_requests])
        return logits

    def _draft_step(self, batch: ForwardBatch, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.draft(batch, self.hidden[: batch.token_ids.shape[0]], cache, self.draft_layer)

    def _launching(self, shape: tuple[int, int]):
        """The context a forward of `shape` is captured or run in: its kernels launched as a decode step of
        its rows (their PDL trigger: kernels/dependent_launch.py)."""
        return decode_step_rows(shape[0] * self.rows_per_request)

    def _static_batch(self, size: int, width: int) -> ForwardBatch:
        rows, per_request, scratch = size * self.rows_per_request, self.rows_per_request, self.cache.scratch_slot
        return ForwardBatch(
            token_ids=self.token_ids[:rows], positions=self.positions[:rows], context_lens=[0] * size,
            query_lens=[per_request] * size, state_slots=[scratch] * size,
            block_tables=self.tables_at[width][:size], slot_mapping=self.slot_mapping[:rows],
            logits_rows=self.logits_rows[:rows], logits_every_row=True, slots=self.slots[:size],
            context_lens_tensor=self.context_lens[:size], static=True,
            ple_embeddings={i: e[:rows] for i, e in self.ple_embeddings.items()} if self.ple_embeddings else None,
            stage_input=None if self.stage_input is None else self.stage_input[:rows],
            position_slots=[[scratch] * (per_request - 1)] * size if per_request > 1 else None,
            verify_slots=None if self.verify_slots is None else self.verify_slots[:size],
        )

    def _pad(self, start: int, size: int, width: int) -> None:
        """Requests start:size become harmless padding (scratch slot, scratch block in the first `width`
        columns, position 0): what a (size, width) forward reads of them."""
        if start >= size:
            return
        rows = slice(start * self.rows_per_request, size * self.rows_per_request)
        for buffer in (self.input_ids, self.positions):
            buffer[rows].zero_()
        self.context_lens[start:size].zero_()
        self.token_picks[rows] = self._own_picks[rows]
        for buffer in (self.stage_input, self.hidden):
            if buffer is not None:
                buffer[rows].zero_()
        self.slots[start:size] = self.cache.scratch_slot
        if self.verify_slots is not None:
            self.verify_slots[start:size] = self.cache.scratch_slot
        self.tables_at[width][start:size] = self.cache.scratch_block
        self.slot_mapping[rows] = self.cache.scratch_block * self.cache.block_size

    def _capture(self, step, graphs: dict, outputs: dict, pool=None, resolve: bool = True):
        """`step(batch, cache)` captured at every prepared shape into graphs / outputs; the memory pool.
        resolve: the input ids resolved first (`_resolve_tokens`; False: the step does it, or needs not)."""
        for shape in reversed(self.shapes):  # largest first, so smaller graphs reuse its memory pool
            batch = self.batches[shape]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._launching(shape):
                for _ in range(2):  # warm up lazily built tensors and kernels outside the capture
                    if resolve:
                        self._resolve_tokens()
                    step(batch, self.cache)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), self._launching(shape):
                if resolve:
                    self._resolve_tokens()
                outputs[shape] = step(batch, self.cache)
            pool = graph.pool()
            graphs[shape] = graph
        return pool

    def can_run(self, batch: ForwardBatch) -> bool:
        if self.rows_per_request == 1:
            shaped = batch.is_decode_only
        else:  # a verification batch of this width, every row's logits wanted
            shaped = batch.verify_slots is not None and batch.verify_slots.shape[1] == self.rows_per_request
        return (
            shaped
            and batch.mrope_positions is None  # image requests' M-RoPE rows run eagerly
            and batch.num_requests <= self.max_batch
            and batch.block_tables.shape[1] <= self.block_tables.shape[1]
            and batch.logits_rows.shape[0] == batch.token_ids.shape[0]
        )

    def shape_for(self, batch: ForwardBatch) -> tuple[int, int]:
        """The prepared (size, width) a decode batch runs at: the smallest that hold it."""
        return self._shape(batch.num_requests, batch.block_tables.shape[1])

    def _shape(self, num_requests: int, longest: int) -> tuple[int, int]:
        """The smallest prepared (size, width) holding num_requests requests whose longest block table has
        `longest` blocks."""
        if longest > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {longest} blocks > the {self.block_tables.shape[1]} prepared")
        return next(s for s in self.sizes if s >= num_requests), next(w for w in self.widths if w >= longest)

    def run(
        self, batch: ForwardBatch, hidden: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, vocab] of a decode-only batch; of a verification batch, every row's logits and streams;
        of a draft step (hidden: its input streams), the draft logits and output streams (valid until the
        next call)."""
        n, rows = batch.num_requests, batch.token_ids.shape[0]
        size, width = shape = self.shape_for(batch)
        self.input_ids[:rows].copy_(batch.token_ids)
        if self.takes_decode_lists:  # only `stage_decode` picks previous sampled ids
            self.token_picks[:rows] = self._own_picks[:rows]
        self.positions[:rows].copy_(batch.positions)
        self.context_lens[:n].copy_(batch.context_lens_tensor)
        self.slots[:n].copy_(batch.slots)
        if self.verify_slots is not None:
            self.verify_slots[:n].copy_(batch.verify_slots)
        used, tables = batch.block_tables.shape[1], self.tables_at[width]
        tables[:n, :used].copy_(batch.block_tables)
        tables[:n, used:] = -1
        self.slot_mapping[:rows].copy_(batch.slot_mapping)
        for index, buffer in (self.ple_embeddings or {}).items():
            buffer[:rows].copy_(batch.ple_embeddings[index])
        if self.stage_input is not None:
            self.stage_input[:rows].copy_(batch.stage_input)
        if self.hidden is not None:
            self.hidden[:rows].copy_(hidden)
        self._pad(n, size, width)
        self._forget_tables()
        out = self._forward(shape)
        return (out[0][:rows], out[1][:rows]) if isinstance(out, tuple) else out[:rows]

    def run_decode(
        self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
        token_sources: list[int] | None = None, previous_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] of B decode rows given as host lists (valid until the next call): row i
        computes token_ids[i] at positions[i] of the request in state slot slots[i] whose block list is
        tables[i] (the request's own list object: rows remember it, so a grown list sends only its new
        entries). token_sources[i] >= 0: row i's input is previous_tokens[token_sources[i]] instead."""
        staged = self.stage_decode(token_ids, positions, slots, tables, token_sources)
        if previous_tokens is not None:  # what the token sources name (the engine's callers copy it themselves)
            self.previous_tokens[: previous_tokens.shape[0]].copy_(previous_tokens)
        return self.replay(*staged)

    def replay(self, shape: tuple[int, int], num_rows: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The forward at a prepared shape on what `stage_decode` (logits of its rows; with_streams: and their
        streams) or `stage_verify` (logits and streams of its rows) staged."""
        out = self._forward(shape)
        return (out[0][:num_rows], out[1][:num_rows]) if isinstance(out, tuple) else out[:num_rows]

    def replay_greedy(self, shape: tuple[int, int], num_requests: int) -> torch.Tensor:
        """The whole greedy speculative step (`GreedySpeculation`) on what `stage_verify` staged: one graph
        replay; its readback [num_requests, 2 + K] (accepted count, token after them, next drafts; valid
        until the next call)."""
        if self.greedy is None:
            raise ValueError("replay_greedy: this runner was prepared without greedy_speculation")
        if shape in self.greedy_graphs:
            self.greedy_graphs[shape].replay()
            return self.greedy_outputs[shape][:num_requests]
        with self._launching(shape):
            return self._greedy_step(self.batches[shape], self.cache)[:num_requests]

    def replay_accept(self, shape: tuple[int, int], num_requests: int, best: torch.Tensor) -> torch.Tensor:
        """The greedy step's part after the verify forward (`replay` of this shape just ran), on `best` [rows]
        (each verify row's argmax of its penalized logits): one graph replay; the readback as
        `replay_greedy`'s."""
        if self.greedy is None:
            raise ValueError("replay_accept: this runner was prepared without greedy_speculation")
        self.penalized_best[: best.shape[0]].copy_(best)
        if shape in self.accept_graphs:
            self.accept_graphs[shape].replay()
            return self.accept_outputs[shape][:num_requests]
        with self._launching(shape):
            return self._accept_step(self.batches[shape], self.cache)[:num_requests]

    def stage_decode(
        self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
        token_sources: list[int] | None = None,
    ) -> tuple[tuple[int, int], int]:
        """`run_decode`'s inputs into the buffers (queued on the device); the shape to replay, the rows. The
        ids the token sources name go into `previous_tokens` by the caller, after this (a pipeline's rank 0
        waits for them there)."""
        n, m = len(token_ids), self.row_capacity
        if not self.takes_decode_lists:
            raise ValueError("run_decode takes plain decode rows: this runner prepares verification or draft steps")
        if n > self.max_batch:
            raise ValueError(f"{n} decode rows > the {self.max_batch} this runner was prepared for")
        size, _ = shape = self._shape(n, max(len(t) for t in tables))
        stage = self._staging.next()
        self._stage_rows(stage, token_ids, positions, positions, slots, tables)  # context: every token before
        if token_sources is not None:
            if len(token_sources) != n or max(token_sources) >= m:
                raise ValueError(f"token_sources: one per row, each < {m} (the previous step's sampled ids this "
                                 f"runner holds); got {len(token_sources)} for {n} rows, largest {max(token_sources)}")
            sources = np.asarray(token_sources, dtype=np.int64)
            stage[5 * m : 5 * m + n] = np.where(sources >= 0, sources, self._own_picks_host[:n])
        self._send(stage, tables, size)
        return shape, n

    def stage_verify(
        self, token_ids: list[list[int]], starts: list[int], slots: list[int], verify_slots: list[list[int]],
        tables: list[list[int]],
    ) -> tuple[tuple[int, int], ForwardBatch]:
        """A verification step's inputs into the buffers with one host-to-device copy (as `stage_decode`):
        request i computes its T tokens token_ids[i] from position starts[i], in state slot slots[i], the
        state after each row going to verify_slots[i] (its position slots, then slots[i]), its block list
        tables[i]. Returns the shape to `replay` and the batch the buffers hold (its tensors are views of
        them: valid until the next call; `can_run` takes it)."""
        n, width = len(token_ids), self.rows_per_request
        if self.verify_slots is None or self.draft_layer is not None:
            raise ValueError("stage_verify takes verification steps: this runner prepares decode or draft steps")
        if n > self.max_batch or any(len(t) != width for t in token_ids) or any(len(v) != width for v in verify_slots):
            raise ValueError(f"stage_verify: at most {self.max_batch} requests of {width} tokens and row slots each")
        longest = max(len(t) for t in tables)
        size, _ = shape = self._shape(n, longest)
        rows = n * width
        positions = [start + t for start in starts for t in range(width)]
        row_tables = [table for table in tables for _ in range(width)]
        stage = self._staging.next()
        self._stage_rows(stage, [t for request in token_ids for t in request], positions, starts, slots, row_tables)
        at = NUM_ROW_INPUTS * self.row_capacity
        stage[at : at + rows] = [slot for request in verify_slots for slot in request]
        stage[at + rows : self._updates_at] = self.cache.scratch_slot
        self._send(stage, tables, size)
        batch = ForwardBatch(
            token_ids=self.input_ids[:rows], positions=self.positions[:rows], context_lens=list(starts),
            query_lens=[width] * n, state_slots=list(slots), block_tables=self.block_tables[:n, :longest],
            slot_mapping=self.slot_mapping[:rows], logits_rows=self.logits_rows[:rows], logits_every_row=True,
            slots=self.slots[:n], context_lens_tensor=self.context_lens[:n],
            position_slots=[v[:-1] for v in verify_slots], verify_slots=self.verify_slots[:n],
        )
        return shape, batch

    def stage_chained(self, tables: list[list[int]]) -> tuple[int, int]:
        """The inputs of a greedy step that follows the last `replay_greedy` of the same requests in the same
        rows (overlap scheduling): the ids, positions and slots are already in the buffers (that step's graph
        wrote them on the device, `_greedy_step`); only the block-table entries that changed are sent (one
        copy). Returns the shape to `replay_greedy`: the same size, the width the tables need now."""
        size, _ = shape = self._shape(len(tables), max(len(t) for t in tables))
        self._send(self._staging.next(), tables, size, tables_only=True)
        return shape

    def _stage_rows(self, stage, token_ids: list[int], positions: list[int], context_lens: list[int],
                    slots: list[int], row_tables: list[list[int]]) -> None:
        """The per-row vectors into a staging buffer: rows past the given ones (and requests past the given
        ones) as padding (scratch slot, scratch block), every token source -1."""
        m, rows, n, block_size = self.row_capacity, len(token_ids), len(slots), self.cache.block_size
        stage[: NUM_ROW_INPUTS * m].fill(0)
        stage[0:rows] = token_ids
        stage[m : m + rows] = positions
        stage[2 * m : 2 * m + n] = context_lens
        stage[3 * m : 3 * m + n] = slots
        stage[3 * m + n : 4 * m] = self.cache.scratch_slot
        stage[4 * m : 4 * m + rows] = [t[p // block_size] * block_size + p % block_size
                                       for t, p in zip(row_tables, positions, strict=True)]
        stage[4 * m + rows : 5 * m] = self.cache.scratch_block * block_size
        stage[5 * m : 6 * m] = self._own_picks_host

    def _send(self, stage, tables: list[list[int]], size: int, tables_only: bool = False) -> None:
        """The staged vectors (tables_only: not those) and the block-table entries rows 0:size need changed to
        the device (one copy), the entries scattered into the table there."""
        columns, values = self._table_updates(tables, size)
        changed, updates = len(columns), self._updates_at
        stage[updates : updates + changed] = columns
        stage[updates + changed : updates + 2 * changed] = values
        self._staging.send(self.inputs, updates + 2 * changed, start=updates if tables_only else 0)
        if changed:
            self.block_tables.view(-1).index_copy_(
                0, self.inputs[updates : updates + changed], self.inputs[updates + changed : updates + 2 * changed])

    def _forward(self, shape: tuple[int, int]) -> torch.Tensor:
        if shape in self.graphs:
            self.graphs[shape].replay()
            return self.outputs[shape]
        with self._launching(shape):
            self._resolve_tokens()
            out = self.forward(self.batches[shape], self.cache)
        if self.greedy is not None:  # what `replay_accept` reads the streams from
            self.outputs[shape] = out
        return out

    def _resolve_tokens(self) -> None:
        """Each row's input id: the host's, or (a token source) the previous step's sampled id; one gather
        from [previous sampled ids | input ids] by the picks the host staged (row r's own id: pick m + r)."""
        torch.index_select(self._token_candidates, 0, self.token_picks, out=self.token_ids)

    # ---- the host mirror of the block tables (run_decode) ---------------------------------------------
    def _reset_tables(self) -> None:
        """Every row padding: the scratch block in column 0, -1 after (a padding row's context is empty)."""
        self.block_tables.fill_(-1)
        self.block_tables[:, 0] = self.cache.scratch_block
        self._row_lists: list[list[int] | None] = [None] * self.max_batch  # the block list each row holds
        self._row_lens = [1] * self.max_batch  # entries of each row before its -1s (also: sent of its list)

    def _forget_tables(self) -> None:
        """`run` wrote the table directly: the next `run_decode` rewrites every row it uses, whole."""
        self._row_lists = [None] * self.max_batch
        self._row_lens = [self.block_tables.shape[1]] * self.max_batch

    def _table_updates(self, tables: list[list[int]], size: int) -> tuple[list[int], list[int]]:
        """(flat index, block id) of the entries rows 0:size need changed: the new blocks of a row whose
        list grew, a whole row where the list is another one (and -1 over what is left of the old one)."""
        columns, values, width = [], [], self.block_tables.shape[1]
        scratch = [self.cache.scratch_block]
        for row in range(size):
            wanted = tables[row] if row < len(tables) else None
            held, sent = self._row_lists[row], self._row_lens[row]
            blocks = scratch if wanted is None else wanted
            if held is wanted and (wanted is not None or sent == 1):  # the same list, or padding already
                start = sent
            else:
                start = 0
                columns += range(row * width + len(blocks), row * width + max(sent, len(blocks)))
                values += [-1] * max(0, sent - len(blocks))
            columns += range(row * width + start, row * width + len(blocks))
            values += blocks[start:]
            self._row_lists[row], self._row_lens[row] = wanted, len(blocks)
        return columns, values


NUM_ROW_INPUTS = 6  # input ids, positions, context lengths, slots, K/V rows, token picks


class _Staging:
    """Two host staging buffers, used in turn (pinned on CUDA): one is filled while the copy from the
    other may still be queued; a buffer is reused only once its last copy has run."""

    def __init__(self, numel: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.zeros(numel, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.arrays = [b.numpy() for b in self.buffers]
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def next(self):
        """The buffer to fill now (a numpy view), once its previous copy has run."""
        self.turn ^= 1
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        return self.arrays[self.turn]

    def send(self, target: torch.Tensor, count: int, start: int = 0) -> None:
        """Entries start:count of the buffer just filled into target's (one host-to-device copy)."""
        target[start:count].copy_(self.buffers[self.turn][start:count], non_blocking=True)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].record()
