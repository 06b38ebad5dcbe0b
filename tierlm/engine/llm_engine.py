"""The step loop: requests in, one scheduled forward per `step()`, `RequestOutput`s out.

Owns the model, its cache pools, the scheduler, the runner and the text side (prompt encoding,
incremental detokenization, stop strings). A request with `n > 1` becomes n sequences that share a
request id and report together. Both the offline `LLM` and the server drive this class.

Overlap scheduling (`async_scheduling`, vLLM's name; on by default, TIERLM_NO_ASYNC_SCHEDULING=1 or
--no-async-scheduling turns it off): a step's forward and sampling are launched, and its results are read
only in the next `step()`, after the next step was scheduled and launched behind it, so the device never
waits for the host's bookkeeping. At launch each sampling request counts its coming token as a
placeholder (engine/request.py) and its computed count moves on; the next step takes those ids on the
device. Reading a step back fills the placeholders, applies stop conditions (a request that finished has
one more token computed by the step already launched, which is discarded), detokenizes and streams. A
step keeps its results synchronous when a sampling request needs its own ids on the host to sample the
next token (a grammar, bad_words; penalties with pipeline parallelism: on one device the sampler reads the
last id from the step in flight's sampled ids); memory-mapped PLE tables (rows gathered on the host from the
ids) turn overlap off. With speculative decoding (`_speculative_step`) a greedy step on the device is left in
flight and the next one is launched on its outputs on the device before it is read (engine/speculative.py);
other drafting steps run serially. With pipeline parallelism the steps are launched
into the pipeline (`PipelineDriver.launch` / `finish`: the last rank sends its sampled ids to rank 0's
device, where the next step takes them), one batch of every running request at a time; without overlap
the pipeline keeps micro-batches in flight instead (`PipelineDriver.step`). Greedy and seeded outputs are
the same either way (tests/test_overlap_scheduling.py, tests/test_pipeline.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
from dataclasses import dataclass

import torch

from tierlm.engine.cache_manager import CacheManager
from tierlm.engine.encoder import DEFAULT_ENCODER_CACHE_BYTES, EncoderCache, place_vision_tower
from tierlm.engine.images import RequestImage, request_images
from tierlm.engine.model_runner import LaunchedStep, ModelRunner, StepResult
from tierlm.engine.request import Request, RequestStatus
from tierlm.engine.sampler import Sampler
from tierlm.engine.sampling_pass import greedy_readback
from tierlm.engine.scheduler import RequestListener, Scheduler
from tierlm.engine.speculative import (
    LaunchedSpeculation,
    SpeculativeConfig,
    SpeculativeRunner,
    draft_vocab_line,
    spare_slots_needed,
)
from tierlm.engine.trace import NoTrace, StepTrace
from tierlm.memory.host_pool import DEFAULT_MARGIN_BYTES
from tierlm.memory.ngram_prefetch import PrefetchWorker
from tierlm.memory.ngram_store import NgramStore, find_table_dir
from tierlm.memory.plan import (
    DEFAULT_ROW_CACHE_BYTES,
    CachePlan,
    CacheSettings,
    CapacityError,
    arena_rows_for,
    cache_budget,
    checkpoint_bytes,
    host_budget,
    plan_cache,
    weight_bytes,
)
from tierlm.model.checkpoint_layout import MTPLayout
from tierlm.model.loader import load_model, read_quantization_config, resolve_model_path
from tierlm.model.model_cache import ModelCache
from tierlm.model.static_decode import StaticDecodeRunner, runner_mode
from tierlm.model.vision.mrope import MropePositions
from tierlm.multimodal.image_processor import ProcessedImage
from tierlm.outputs import CompletionOutput, RequestOutput
from tierlm.sampling_params import RequestOutputKind, SamplingParams
from tierlm.tokenizer import Tokenizer

logger = logging.getLogger("tierlm")


def engine_cache_plan(
    config: EngineConfig, model_config, dtype: str, device: str, weights_bytes: int,
    host_memory_bytes: int | None = None, ple_mapped: bool = False, layer_ids: tuple[int, ...] | None = None,
    quantization=None, stage=None, mtp=None,
) -> CachePlan:
    """The cache plan for these settings: the engine sizes its pools from it, `tierlm plan` prints it.

    weights_bytes: weights not loaded yet, to count as in use in a --gpu-memory-utilization budget (the
    engine, which has loaded its weights, passes 0). host_memory_bytes: the host RAM to plan the host
    pools with, instead of this machine's MemAvailable. ple_mapped: the PLE tables are mapped files.
    layer_ids: the layers one pipeline rank holds (default: all). quantization: the checkpoint's
    `QuantizationConfig` (the weights are reported at their packed size). stage: one pipeline rank's
    `StageLayout` (its layers, and only the weights it holds; its share of the host RAM). mtp: the MTP
    draft head's `MTPLayout`, counted in the weights under --speculative-config (default: the config's
    layers, with the target's lm_head).
    """
    ranks_on_host = 1
    speculative = SpeculativeConfig.parse(config.speculative_config)
    if speculative is not None:
        mtp = speculative.head_layout(mtp or MTPLayout(model_config.num_mtp_layers))
    if stage is not None:
        layer_ids, ranks_on_host = stage.layer_ids, stage.world_size
        if speculative is not None and stage.is_last:  # the draft head (and the embedding it reads) is there
            stage = dataclasses.replace(stage, draft_head=True)
    draft_layers = model_config.num_mtp_layers if speculative is not None and (stage is None or stage.is_last) else 0
    if config.qsa_row_cache_rows is not None and config.qsa_row_cache_rows < 1:
        raise CapacityError(f"--qsa-row-cache-rows must be at least 1, got {config.qsa_row_cache_rows}")
    if config.qsa_row_cache_max_batch < 0:
        raise CapacityError(f"--qsa-row-cache-max-batch must be 0 or more, got {config.qsa_row_cache_max_batch}")
    if config.checkpoint_host_bytes is not None and config.max_state_checkpoints is not None:
        raise CapacityError("give --checkpoint-host-bytes or --max-state-checkpoints, not both")
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    budget, source = cache_budget(config.kv_cache_memory_bytes, config.gpu_memory_utilization, device, weights_bytes)
    host, host_source = host_budget(host_memory_bytes, DEFAULT_MARGIN_BYTES, ranks_on_host)
    if config.qsa_row_cache_rows is not None:
        arena_rows, arena_source = config.qsa_row_cache_rows, "--qsa-row-cache-rows"
    else:
        arena_rows = arena_rows_for(model_config, dtype, config.qsa_row_cache_bytes, layer_ids)
        arena_source = f"--qsa-row-cache-bytes {config.qsa_row_cache_bytes:,}"
        if arena_rows < 1:
            raise CapacityError(f"--qsa-row-cache-bytes {config.qsa_row_cache_bytes:,} holds no row of each QSA layer")
    caching = config.enable_prefix_caching and model_config.has_qsa
    checkpoints, checkpoint_source = 0, "prefix caching off"
    if caching and config.checkpoint_host_bytes is not None:
        if config.checkpoint_host_bytes < 0:
            raise CapacityError(f"--checkpoint-host-bytes must be 0 or more, got {config.checkpoint_host_bytes}")
        checkpoints = config.checkpoint_host_bytes // checkpoint_bytes(model_config, dtype, layer_ids)
        checkpoint_source = f"--checkpoint-host-bytes {config.checkpoint_host_bytes:,}"
    elif caching and config.max_state_checkpoints is not None:
        checkpoints, checkpoint_source = config.max_state_checkpoints, "--max-state-checkpoints"
    elif caching:
        checkpoints, checkpoint_source = 2 * config.max_num_seqs, "default: 2 x max_num_seqs"
    return plan_cache(model_config, dtype, CacheSettings(
        block_size=config.block_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        num_checkpoints=checkpoints, budget_bytes=budget, budget_source=source, kv_offload=config.qsa_kv_offload,
        device_type=torch.device(device).type, arena_rows=arena_rows, host_available_bytes=host,
        host_source=host_source, arena_source=arena_source, arena_in_budget=config.kv_cache_memory_bytes is None,
        checkpoint_source=checkpoint_source,
        weights_bytes=sum(weight_bytes(
            model_config, dtype, quantization, ple_mapped, layer_ids, stage, mtp if speculative else None
        ).values()),
        ple_mapped=ple_mapped,
        prefix_caching=caching and checkpoints > 0, layer_ids=layer_ids,
        num_draft_layers=draft_layers,
        spare_slots=spare_slots_needed(speculative, config.max_num_seqs),
    ))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state for metrics (read between steps)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of QSA blocks in use (0 for a model without QSA layers)
    num_preemptions: int  # total since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, total
    prefix_cache_hits: int  # of which found cached, total
    # the n-gram tables as memory-mapped files (zeros when they are in memory)
    ple_rows_gathered: int = 0
    ple_pages_advised: int = 0
    ple_prefetch_backlog_tokens: int = 0
    ple_gather_seconds: float = 0.0
    ple_table_resident_fraction: float = 0.0
    # QSA K/V in host pools: decode row reads served by the VRAM row cache
    qsa_row_cache_hits: int = 0
    qsa_row_cache_misses: int = 0
    # the device's caching allocator (zeros on CPU): bytes held by tensors, reserved from the driver,
    # and the most ever held
    device_memory_allocated: int = 0
    device_memory_reserved: int = 0
    device_memory_peak: int = 0
    # speculative decoding, totals: steps a request verified drafts in, drafts verified, drafts accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()  # [j]: drafts accepted at draft position j (0-based)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 512
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_state_checkpoints: int | None = None  # prefix-cache state checkpoints; default 2 x max_num_seqs
    checkpoint_host_bytes: int | None = None  # or: the host RAM the checkpoints may take (pinned, LRU)
    kv_cache_memory_bytes: int | None = None  # the cache budget; else a fraction of device memory:
    gpu_memory_utilization: float | None = None  # CUDA: of total memory (0.9); CPU: of available RAM (0.1)
    seed: int = 0
    ple_table: str | None = None  # folder of `tierlm ple export`; default: <model>/ple_tables if present
    ple_prefetch: bool = True  # admission-time prefetch of the tables' pages (TIERLM_NO_PLE_PREFETCH=1: off)
    # QSA K/V in exact-size (pinned) host pools, read over UVA at decode; None: auto, on CUDA when the
    # budget cannot hold max_num_seqs requests of max_model_len on the device (see memory/plan.py)
    qsa_kv_offload: bool | None = None
    qsa_row_cache: bool = True  # with offload: keep recently read rows in VRAM (bit-identical)
    # with offload: each QSA layer's VRAM arena (prefill staging, row cache), in rows per layer, or
    # (rows None) a byte budget for all QSA layers together
    qsa_row_cache_rows: int | None = None
    qsa_row_cache_bytes: int = DEFAULT_ROW_CACHE_BYTES
    qsa_row_cache_max_batch: int = 12  # decode batches of up to this many requests use the row cache
    enforce_eager: bool = False  # True: no CUDA graphs (nor compilation) for decode steps
    compile_decode: bool = False  # on CPU, torch.compile the decode step (slow start, ~2x faster steps)
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks; vLLM's flag)
    trace: str | None = None  # a Chrome-trace JSON of every step's host phases and GPU time (engine/trace.py)
    # pipeline parallel: ranks (one process each, layers split between them; engine/pipeline.py) and the
    # layers of each ("16,17,15"; None: balanced by each rank's memory)
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | tuple[int, ...] | None = None
    pipeline_timeout_s: float = 600.0  # every collective between ranks; a dead rank is seen sooner
    # MTP speculative decoding (vLLM's flag): '{"method": "mtp", "num_speculative_tokens": K}' (or a dict)
    speculative_config: str | dict | None = None
    # overlap scheduling (vLLM's --async-scheduling): launch the next step before reading this one's ids
    # (see the module docstring); TIERLM_NO_ASYNC_SCHEDULING=1 turns it off too
    async_scheduling: bool = True
    # the vision tower's weights in pinned host memory, streamed to the device per encode (engine/encoder.py;
    # vLLM-style name); None: auto, on CUDA when the cache plan needs the room
    mm_encoder_offload: bool | None = None
    # the vision tower's features of recent images, by image digest, LRU within this many bytes (0: off)
    mm_encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES


class _PrefetchListener(RequestListener):
    """Admitted: prefetch the table pages of what is left to compute. Released: drop the rest."""

    def __init__(self, prefetcher: PrefetchWorker) -> None:
        self.prefetcher = prefetcher

    def admitted(self, request: Request) -> None:
        start = request.num_computed_tokens
        self.prefetcher.submit(request.request_id, request.token_slice(0, request.num_tokens), start)

    def released(self, request: Request) -> None:
        self.prefetcher.cancel(request.request_id)


class PromptTooLongError(ValueError):
    """A prompt that cannot fit the model's context; the message gives both lengths."""


@dataclass(eq=False)
class _Sequence:
    """A request's text-side state beside the engine's `Request`."""

    request: Request
    index: int
    detokenizer: object
    text: str = ""
    detokenized: int = 0  # output tokens already fed to the detokenizer
    stop_scanned: int = 0  # characters of text already searched for stop strings
    # with RequestOutputKind.DELTA: characters and tokens already reported
    sent_chars: int = 0
    sent_tokens: int = 0

    def completion(self, delta: bool, holdback: int) -> CompletionOutput:
        """Everything so far, or (delta) what is new since the last call.

        A delta holds back the last `holdback` characters while the request runs: a stop string completed
        by a later token would cut them from the final text.
        """
        request = self.request
        finished = request.is_finished
        text, token_ids, logprobs = self.text, request.known_output_token_ids, request.logprobs
        if delta:
            end = len(text) if finished else max(self.sent_chars, len(text) - holdback)
            text, self.sent_chars = text[self.sent_chars : end], end
            if logprobs is not None:
                logprobs = logprobs[self.sent_tokens :]
            token_ids, self.sent_tokens = token_ids[self.sent_tokens :], len(token_ids)
        else:
            token_ids = list(token_ids)
        return CompletionOutput(
            index=self.index, text=text, token_ids=token_ids,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=logprobs, finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )


@dataclass(eq=False)
class _Group:
    """The sequences of one `add_request` (n of them), reported together under one request id."""

    prompt: str | None
    sequences: list[_Sequence]
    reported: bool = False  # an output was returned already

    @functools.cached_property
    def delta(self) -> bool:
        return self.sequences[0].request.params.output_kind is RequestOutputKind.DELTA

    @functools.cached_property
    def holdback(self) -> int:
        """Characters a running delta keeps back: one short of the longest stop string."""
        return max((len(s) for s in self.sequences[0].request.params.stop_strings), default=1) - 1


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.pipeline = None  # a PipelineDriver with --pipeline-parallel-size > 1
        self.model_dir = model_dir = resolve_model_path(config.model)
        table_dir = find_table_dir(str(model_dir), config.ple_table)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        speculative = SpeculativeConfig.parse(config.speculative_config)
        if speculative is not None and table_dir is not None:
            raise ValueError("--speculative-config is not supported with memory-mapped PLE tables "
                             "(--ple-table, or <model>/ple_tables) yet: serve the tables in memory")
        if config.pipeline_parallel_size != 1:
            self._start_pipeline(model_dir, table_dir, speculative)
            return
        self.model, self.model_config = load_model(
            model_dir, config.dtype, config.device, mapped_ple_tables=table_dir is not None,
            load_format=config.load_format, load_mtp=speculative is not None,
        )
        if speculative is not None:
            speculative.restrict_draft_vocab(self.model)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        dtype = next(self.model.parameters()).dtype
        device = next(self.model.parameters()).device
        quantization = read_quantization_config(model_dir)
        self.cache_plan, tower_line = place_vision_tower(
            self.model, config.mm_encoder_offload, device, config.max_num_seqs, config.qsa_kv_offload is None,
            lambda: engine_cache_plan(
                config, mc, str(dtype).removeprefix("torch."), str(device), 0,
                ple_mapped=table_dir is not None and bool(mc.ple_layer_ids), quantization=quantization,
                mtp=None if getattr(self.model, "mtp", None) is None else MTPLayout(
                    len(self.model.mtp.layers), self.model.mtp.shared_head is not None),
            ),
        )
        for line in self.cache_plan.lines() + ([tower_line] if tower_line else []):
            logger.info(line)
        plan = self.cache_plan
        self.cache = ModelCache(
            mc, plan.num_slots + plan.spare_slots, plan.num_blocks,
            plan.block_size, dtype, device, kv_offload=plan.kv_offload,
            arena_rows=plan.arena_rows, row_cache=config.qsa_row_cache,
            row_cache_max_batch=config.qsa_row_cache_max_batch, num_host_checkpoints=plan.num_checkpoints,
            num_draft_layers=plan.num_draft_layers,
        )
        if plan.kv_offload:
            logger.info("QSA K/V in host pools (%s)", f"row cache of {plan.arena_rows:,} rows per layer for decode "
                        f"batches of up to {config.qsa_row_cache_max_batch}" if config.qsa_row_cache else "no row cache")
        self.cache_manager = CacheManager(
            self.cache, config.max_num_seqs, plan.num_checkpoints, config.enable_prefix_caching
        )
        self.ngram_store = self.prefetcher = None
        if table_dir is not None:
            self.ngram_store = NgramStore(table_dir, mc, device, max_tokens=config.max_num_batched_tokens)
            logger.info("PLE tables memory-mapped from %s", table_dir)
            if config.ple_prefetch and not os.environ.get("TIERLM_NO_PLE_PREFETCH"):
                self.prefetcher = PrefetchWorker(self.ngram_store)
        listener = _PrefetchListener(self.prefetcher) if self.prefetcher else None
        k = speculative.num_speculative_tokens if speculative is not None else 0
        self.encoder_cache = EncoderCache(config.mm_encoder_cache_bytes) if mc.vision is not None else None
        self.scheduler = Scheduler(self.cache_manager, config.max_num_seqs, config.max_num_batched_tokens, listener,
                                   num_speculative_tokens=k, encoder_cache=self.encoder_cache)
        block_size = plan.block_size
        static_decode, static_plain, static_drafts = None, None, None
        mode = runner_mode(device, config.compile_decode, config.enforce_eager)
        if mode:
            max_blocks = math.ceil(self.max_model_len / block_size)
            ple_dims = {t.ple_index: t.rows.shape[1] * mc.num_ngram_heads for t in self.ngram_store.tables} if (
                self.ngram_store) else None
            # speculative decoding: the verification steps (1 + K rows per request) are the fixed shapes
            # (and, but for torch.compile, each shape's whole greedy step: verify, accept, roll back, draft)
            # without: each decode graph also takes its rows' argmax, a plain greedy step's whole sampling
            # (TIERLM_NO_GRAPH_ARGMAX=1: the sampler's launches after the replay)
            argmax = speculative is None and not os.environ.get("TIERLM_NO_GRAPH_ARGMAX")
            static_decode = StaticDecodeRunner(
                self.model, self.cache, config.max_num_seqs, max_blocks, mode, ple_embedding_dims=ple_dims,
                rows_per_request=1 + k, greedy_speculation=speculative is not None and mode != "compile",
                greedy_readback=greedy_readback if argmax else None,
            )
            if speculative is not None:  # and the draft head's, per MTP layer, at 1 and 1 + K rows per request
                static_drafts = {(i, rows): StaticDecodeRunner(
                    self.model, self.cache, config.max_num_seqs, max_blocks, mode, draft_layer=i,
                    rows_per_request=rows) for i in range(len(self.model.mtp.layers)) for rows in (1, 1 + k)}
                # and the steps without drafts (a request's last token, requests that do not speculate): one
                # row per request with its streams (the draft head reads them), in the verify graphs' pool
                static_plain = StaticDecodeRunner(
                    self.model, self.cache, config.max_num_seqs, max_blocks, mode, with_streams=True,
                    graph_pool=static_decode.graph_pool)
        self.runner = ModelRunner(
            self.model, self.cache, Sampler(config.seed), self._decode_token,
            static_decode if speculative is None else static_plain, self.ngram_store, self.encoder_cache,
        )
        if speculative is not None:
            self.runner = SpeculativeRunner(self.runner, speculative, plan.num_slots, config.seed, static_decode,
                                            static_drafts)
            logger.info("speculative decoding: %s, %d draft tokens per step (%d MTP layer(s), drafting from %s); "
                        "requests with biases, bans, allowed ids, min_tokens or logprobs decode one token per step",
                        speculative.method, k, mc.num_mtp_layers, draft_vocab_line(speculative, mc.vocab_size))
        self._finish_init()

    def _start_pipeline(self, model_dir, table_dir, speculative: SpeculativeConfig | None) -> None:
        """--pipeline-parallel-size N: this process is rank 0 (scheduler and first stage); the other ranks
        are spawned (or, under torchrun, ranks > 0 serve their stage in `serve_if_worker` and never return).
        With --speculative-config the last rank holds the draft head (engine/pipeline_speculative.py)."""
        from tierlm.config import ModelConfig
        from tierlm.engine.pipeline import PipelineDriver
        from tierlm.engine.pipeline_worker import serve_if_worker
        from tierlm.engine.stage_setup import check_pipeline_config

        config = self.config
        mc = ModelConfig.from_pretrained(model_dir)
        check_pipeline_config(config, mc)
        if table_dir is not None and mc.ple_layer_ids:
            raise ValueError("memory-mapped PLE tables (--ple-table, or <model>/ple_tables) are not supported with "
                             "--pipeline-parallel-size > 1 yet: serve the tables in memory")
        serve_if_worker(config)
        self.pipeline = driver = PipelineDriver(config, self._decode_token)
        stage = driver.stage
        self.model, self.model_config, self.cache, self.cache_plan = stage.model, mc, stage.cache, stage.plan
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        for line in self.cache_plan.lines():
            logger.info("rank 0 %s", line)
        self.cache_manager = CacheManager(
            driver.cache, config.max_num_seqs, stage.plan.num_checkpoints, config.enable_prefix_caching
        )
        self.ngram_store = self.prefetcher = self.encoder_cache = None  # images are refused with PP
        k = speculative.num_speculative_tokens if speculative is not None else 0
        self.scheduler = Scheduler(self.cache_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   num_speculative_tokens=k)
        self.runner = driver.runner
        if speculative is not None:
            from tierlm.engine.pipeline_speculative import PipelineSpeculation

            self.runner = PipelineSpeculation(driver, speculative, stage.plan.num_slots, config.seed)
            logger.info("speculative decoding: %s, %d draft tokens per step (%d MTP layer(s), drafting from %s, on "
                        "the last pipeline rank; steps run serially and eagerly); requests with biases, bans, "
                        "min_tokens, logprobs or a grammar decode one token per step", speculative.method, k,
                        mc.num_mtp_layers, draft_vocab_line(speculative, mc.vocab_size))
        self._finish_init()

    def close(self) -> None:
        """Write the trace (if any) and stop the pipeline's other ranks."""
        self.trace.flush()
        if self.pipeline is not None:
            self.pipeline.close()

    def _finish_init(self) -> None:
        mc, device = self.model_config, self.cache.device
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[Request, str] = {}
        self._ids = itertools.count()
        self.last_step_num_tokens = 0
        self.trace = StepTrace(self.config.trace, device) if self.config.trace else NoTrace()
        self.runner.trace = self.trace
        asynchronous = self.config.async_scheduling and not os.environ.get("TIERLM_NO_ASYNC_SCHEDULING")
        self.overlap = asynchronous and type(self.runner) is ModelRunner and self.runner.ngram_store is None
        # with drafts: greedy steps on the device chain on the device's own outputs (`_speculative_step`)
        self.speculative_overlap = asynchronous and isinstance(self.runner, SpeculativeRunner)
        # overlap: the launched step not read back yet (with drafts: a `LaunchedSpeculation`)
        self._in_flight: LaunchedStep | LaunchedSpeculation | None = None
        if device.type == "cuda":
            memory = self._device_memory()
            logger.info("%s memory after start-up: %s allocated, %s reserved, peak %s", device,
                        *(f"{memory[k]:,} B" for k in ("device_memory_allocated", "device_memory_reserved",
                                                        "device_memory_peak")))

    # ---- requests -----------------------------------------------------------------------------------
    def default_params(self) -> tuple[float | None, float | None, int | None, float | None]:
        d = self.tokenizer.generation_defaults
        return d.temperature, d.top_p, d.top_k, d.repetition_penalty

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        prompt_text: str | None = None, images: list[ProcessedImage] | None = None,
    ) -> str:
        """Queue a prompt (text or token ids; `prompt_text` names the text of given ids); returns its id.
        images: the prompt's images, processed, in prompt order; each one's marker already widened to
        its run of image tokens (`multimodal/prompt.py`)."""
        request_id = request_id or str(next(self._ids))
        text = prompt if isinstance(prompt, str) else prompt_text
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check_prompt(token_ids)
        located, mrope = self._images(token_ids, images or [])
        params = params.with_defaults(*self.default_params())
        for name, token_id in params.token_ids_used():
            if token_id >= self.model_config.vocab_size:
                raise ValueError(f"{name}: token id {token_id} is outside the vocabulary [0, {self.model_config.vocab_size})")
        bad_words = [self.tokenizer.encode(prefix + word, add_special_tokens=False)
                     for word in params.bad_words or () for prefix in ("", " ")]
        grammars = [None] * params.n  # a matcher per sequence; a bad schema raises before anything is queued
        if params.structured_output is not None:
            grammars = [self.structured_outputs.new_state(params.structured_output) for _ in range(params.n)]
        sequences = []
        for index in range(params.n):
            # sequence i draws from seed + i (wrapped into 64 bits)
            seq_params = params if params.seed is None else dataclasses.replace(
                params, seed=(params.seed + index + 2**63) % 2**64 - 2**63
            )
            request = Request(
                f"{request_id}-{index}" if params.n > 1 else request_id, token_ids, seq_params,
                self.eos_token_ids, self.max_model_len,
                structured_output=grammars[index], bad_words_token_ids=bad_words, images=located, mrope=mrope,
            )
            detok = self.tokenizer.detokenizer(token_ids, skip_special_tokens=params.skip_special_tokens)
            sequences.append(_Sequence(request, index, detok))
            self._group_of[request] = request_id
            self.scheduler.add(request)
        self._groups[request_id] = _Group(text, sequences)
        return request_id

    def _images(self, token_ids: list[int], images: list[ProcessedImage]) -> tuple[list[RequestImage], MropePositions | None]:
        """The prompt's images located in it and its M-RoPE positions ([], None: a text prompt); a
        ValueError for images the engine cannot take."""
        vision = self.model_config.vision
        if vision is None:
            if images:
                raise ValueError("this model has no vision tower (its config.json has no vision_config): it takes "
                                 "no images")
            return [], None
        if not images and vision.image_token_id not in token_ids:
            return [], None
        if self.pipeline is not None or type(self.runner) is not ModelRunner:
            raise ValueError("image prompts are not supported with --pipeline-parallel-size > 1 or "
                             "--speculative-config yet")
        return request_images(token_ids, images, vision)

    @functools.cached_property
    def structured_outputs(self):
        """Compiles `SamplingParams.structured_output`; built on first use (xgrammar is slow to import; the
        server builds it at start-up, before it serves)."""
        from tierlm.engine.structured_output import StructuredOutputManager

        return StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))

    def check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its memory; unknown or finished ids are ignored."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.sequences:
            self._group_of.pop(seq.request, None)
            if not seq.request.is_finished:
                seq.request.finish(RequestStatus.FINISHED_ABORTED)
            self.scheduler.finish(seq.request)

    def pause_request(self, request_id: str, paused: bool) -> None:
        """Hold a request back from scheduling (its memory stays), or let it run again; unknown ids are
        ignored. The server pauses a stream whose client has not read what it was sent."""
        group = self._groups.get(request_id)
        for seq in group.sequences if group else ():
            seq.request.paused = paused

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or a launched step not read back yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def stats(self) -> EngineStats:
        manager = self.cache_manager
        total = self.cache.num_blocks
        used = total - manager.num_free_blocks if manager.uses_blocks else 0
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=used / total if manager.uses_blocks and total else 0.0,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=manager.queried_tokens, prefix_cache_hits=manager.hit_tokens,
            **self._ple_stats(), **self._row_cache_stats(), **self._device_memory(), **self._speculative_stats(),
        )

    def _speculative_stats(self) -> dict:
        runner = self.runner
        if not isinstance(runner, SpeculativeRunner):
            return {}
        return {"num_drafts": runner.num_drafts, "num_draft_tokens": runner.num_draft_tokens,
                "num_accepted_tokens": runner.num_accepted_tokens,
                "num_accepted_tokens_per_pos": tuple(runner.accepted_per_position)}

    def _device_memory(self) -> dict:
        if self.cache.device.type != "cuda":
            return {}
        device = self.cache.device
        return {
            "device_memory_allocated": torch.cuda.memory_allocated(device),
            "device_memory_reserved": torch.cuda.memory_reserved(device),
            "device_memory_peak": torch.cuda.max_memory_allocated(device),
        }

    def _row_cache_stats(self) -> dict:
        offloaded = self.cache.offloaded  # the draft head's layers read through their row caches too
        if not offloaded or not self.config.qsa_row_cache:
            return {}
        # one device read for all layers: the server snapshots the stats after every step
        hits, misses = torch.stack([torch.stack([o.cache.hits, o.cache.misses]) for o in offloaded]).sum(0).tolist()
        return {"qsa_row_cache_hits": hits, "qsa_row_cache_misses": misses}

    def _ple_stats(self) -> dict:
        if self.ngram_store is None:
            return {}
        counters = self.ngram_store.counters
        return {
            "ple_rows_gathered": counters.rows_gathered, "ple_pages_advised": counters.pages_advised,
            "ple_prefetch_backlog_tokens": self.prefetcher.backlog_tokens if self.prefetcher else 0,
            "ple_gather_seconds": counters.gather_seconds, "ple_table_resident_fraction": counters.resident_fraction,
        }

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample; outputs of every request that changed this step. With
        pipeline parallelism: launch batches into the pipeline, and take back the oldest one in flight.
        With overlap scheduling: launch this step, then read back the step launched before it."""
        if isinstance(self.runner, SpeculativeRunner):
            return self._speculative_step()
        trace = self.trace
        changed: dict[str, None] = {}
        if self.pipeline is not None and not self.overlap:
            with trace.phase("pipeline step"):
                launched, done = self.pipeline.step(self.scheduler)
            # a step that only took back a batch in flight ran too (0 tells the server nothing could run)
            self.last_step_num_tokens = launched + sum(plan.num_tokens for plan, _ in done)
            with trace.phase("apply, detokenize"):
                for plan, result in done:
                    self._apply(plan, result, changed)
                outputs = [self._collect(request_id) for request_id in changed]
            if self.last_step_num_tokens:
                trace.end_step(self.last_step_num_tokens)
            return outputs
        with trace.phase("schedule"):
            plan = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        launched = self._launch(plan, previous) if plan.chunks else None
        # 0 tells the server nothing could run; reading back a step in flight is work too
        self.last_step_num_tokens = plan.num_tokens or (previous.num_tokens if previous else 0)
        reads = []  # (what to read back, its plan if it was read at once), oldest first
        if previous is not None:
            reads.append((previous, None))
        if launched is not None and launched is not self._in_flight:
            reads.append((launched, plan))
        outputs = []
        for index, (step, serial_plan) in enumerate(reads):
            with trace.phase("read sampled ids"):
                result = step if isinstance(step, StepResult) else (self.pipeline or self.runner).finish(step)
            with trace.phase("apply, detokenize"):
                if serial_plan is None:
                    self._apply_launched(step, result, changed)
                else:
                    self._apply(serial_plan, result, changed)
                if index == len(reads) - 1:
                    outputs = [self._collect(request_id) for request_id in changed]
        if self.last_step_num_tokens:
            trace.end_step(plan.num_tokens)
        return outputs

    def _speculative_step(self) -> list[RequestOutput]:
        """`step` with drafts. Overlap scheduling keeps one greedy step on the device in flight
        (`SpeculativeRunner.launch_greedy`): the next `step` launches the step after it on the device's own
        outputs (`launch_chained`, when `_chains` allows), then reads it back; else it only reads it back,
        and the step after schedules anew. Any other step runs serially (`execute`)."""
        trace, runner = self.trace, self.runner
        changed: dict[str, None] = {}
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            with trace.phase("schedule"):
                plan = self.scheduler.schedule()
            self.last_step_num_tokens = plan.num_tokens
            if not plan.chunks:
                return []
            if self.speculative_overlap and runner.overlaps(plan):
                self._in_flight = runner.launch_greedy(plan)
                trace.end_step(plan.num_tokens)
                return []
            result = runner.execute(plan)
            with trace.phase("apply, detokenize"):
                self._apply(plan, result, changed)
        else:
            if self._chains(previous):
                self._save_ahead(previous)
                self._in_flight = runner.launch_chained(previous)
            self.last_step_num_tokens = (self._in_flight or previous).num_tokens
            result = runner.finish_greedy(previous, self._in_flight)
            with trace.phase("apply, detokenize"):
                self._apply(previous.step, result, changed, checkpoint=self._in_flight is None)
                for chunk in previous.step.chunks if self._in_flight is not None else ():
                    if not chunk.request.is_finished:
                        self.cache_manager.settle_ahead(chunk.request)
        with trace.phase("apply, detokenize"):
            outputs = [self._collect(request_id) for request_id in changed]
        trace.end_step(self.last_step_num_tokens)
        return outputs

    def _save_ahead(self, previous) -> None:
        """Before the step chained after `previous` is queued: a request whose computed count `previous` may
        bring onto a block boundary (row j ends there, if its draft is accepted) has the state after row j
        saved for the prefix cache (`CacheManager.save_ahead`), as a serial step saves it after it ran."""
        block_size = self.cache_manager.block_size
        for chunk in previous.step.chunks:
            request = chunk.request
            first = request.num_computed_tokens + 1  # the computed count after row 0
            boundary = -(-first // block_size) * block_size
            if boundary - first < 1 + self.runner.k:
                self.cache_manager.save_ahead(request, boundary, self.runner.row_slots(request)[boundary - first])

    def _chains(self, previous) -> bool:
        """Whether the greedy step after `previous` (in flight) can be launched before reading it: the same
        requests are all that run (none finished, paused or waiting to be admitted), none certainly ends
        with `previous` (max_tokens), and each has room for any accepted count of `previous` (K + 1 more
        tokens) followed by a full step: a verify of K drafts and the draft head's K positions past it
        (the blocks are reserved here; max_model_len bounds it)."""
        requests = [chunk.request for chunk in previous.step.chunks]
        scheduler, k = self.scheduler, self.runner.k
        if (len(requests) != len(scheduler.running) or set(requests) != set(scheduler.running)
                or (scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs)):
            return False
        for request in requests:
            max_tokens = request.params.max_tokens
            if (request.is_finished or request.paused or request.num_tokens + 3 * k + 2 > request.max_model_len
                    or (max_tokens is not None and len(request.output_token_ids) + 1 >= max_tokens)):
                return False
        return all(self.cache_manager.grow(request, request.num_tokens + 3 * k) for request in requests)

    def _launch(self, plan, previous: LaunchedStep | None) -> LaunchedStep | StepResult:
        """Run the plan: left in flight (`self._in_flight`) when overlap allows, else a launched step to
        read back at once."""
        samples = [chunk.samples for chunk in plan.chunks]  # before the computed counts move on
        launched = (self.pipeline or self.runner).launch(plan, previous)
        if self.overlap and all(self._overlaps(request, self.pipeline is None) for request in launched.sampling):
            self._in_flight = launched
            for chunk, sampled in zip(plan.chunks, samples, strict=True):
                request = chunk.request
                request.num_computed_tokens += chunk.num_tokens
                last = sampled and request in launched.row_of and self._last_token(request)
                if sampled and request in launched.row_of and not last:
                    request.add_placeholder()
                    launched.placeholders.add(request)
                self.cache_manager.on_computed(request, request.num_known_tokens)
                if last:  # its memory goes back now, before the next schedule, as after a serial step
                    self.scheduler.finish(request)
        return launched

    @staticmethod
    def _overlaps(request: Request, device_penalties: bool) -> bool:
        """Whether the request samples its next token without its previous one's id on the host (penalties
        read it on the device, from the step in flight's sampled ids, when device_penalties: one device)."""
        return (request.structured_output is None and (device_penalties or not request.params.has_penalties)
                and not request.bad_words_token_ids)

    @staticmethod
    def _last_token(request: Request) -> bool:
        """The token being sampled now certainly finishes the request (max_tokens, max_model_len): the
        next step has nothing to compute for it, and it leaves the scheduler at launch."""
        n_out = len(request.output_token_ids) + 1
        max_tokens = request.params.max_tokens
        return ((max_tokens is not None and n_out >= max_tokens)
                or request.num_prompt_tokens + n_out >= request.max_model_len)

    def _apply_launched(self, launched: LaunchedStep, result: StepResult, changed: dict[str, None]) -> None:
        """A step left in flight, read back: fill its placeholders (computed counts moved on at launch)."""
        for request in launched.sampling:
            if request.is_finished:  # finished by the step before, or aborted: this token is discarded
                continue
            if request in result.failed:
                request.finish(RequestStatus.FINISHED_ERROR, result.failed[request])
            else:
                fill = request.fill_placeholder if request in launched.placeholders else request.append_token
                self._append(request, result.sampled[request], fill)
                self.cache_manager.on_tokens_known(request)
            changed[self._group_of[request]] = None
        for request in result.failed:  # failed at launch (prompt log-probabilities): not sampling rows
            if request not in launched.row_of and not request.is_finished:
                request.finish(RequestStatus.FINISHED_ERROR, result.failed[request])
                changed[self._group_of[request]] = None

    def _apply(self, plan, result, changed: dict[str, None], checkpoint: bool = True) -> None:
        """A step's computed tokens and sampled tokens into its requests (checkpoint: see
        `CacheManager.on_computed`)."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.is_finished:  # aborted while its batch was in the pipeline
                continue
            # accepted drafts (speculative decoding) are tokens first, then computed with the chunk
            appended = self._append_accepted(request, result.accepted.get(request, ()))
            request.num_computed_tokens = min(request.num_computed_tokens + chunk.num_tokens + appended,
                                              request.num_tokens)
            self.cache_manager.on_computed(request, checkpoint=checkpoint)
            if appended and request.is_finished:  # a stop inside the accepted drafts
                changed[self._group_of[request]] = None
                continue
            if request in result.failed:
                request.finish(RequestStatus.FINISHED_ERROR, result.failed[request])
            elif request in result.sampled:
                self._append(request, result.sampled[request])
            else:
                continue
            changed[self._group_of[request]] = None

    def _append_accepted(self, request: Request, tokens) -> int:
        """Append accepted drafts until one finishes the request (EOS, a stop id, max_tokens); how many."""
        appended = 0
        for token in tokens:
            if request.is_finished:
                break
            self._append(request, token)
            appended += 1
        return appended

    @staticmethod
    def _append(request: Request, token_id: int, take=None) -> None:
        """Append a sampled token (or `take` it: fill a placeholder); a failure of this request's own state
        (its grammar) ends it alone."""
        try:
            (take or request.append_token)(token_id)
        except Exception as exc:
            logger.exception("request %s could not take token %d", request.request_id, token_id)
            request.finish(RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}")

    def _collect(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        sequences = group.sequences
        completions = []
        for seq in sequences:
            request = seq.request
            try:
                self._update_text(seq)
            except Exception as exc:
                logger.exception("request %s: detokenizing failed", request.request_id)
                request.finish(RequestStatus.FINISHED_ERROR, f"detokenizing failed: {type(exc).__name__}: {exc}")
            if request.is_finished:
                self.scheduler.finish(request)
            completions.append(seq.completion(group.delta, group.holdback))
        finished = all(seq.request.is_finished for seq in sequences)
        first = sequences[0].request
        if finished:
            del self._groups[request_id]
            for seq in sequences:
                del self._group_of[seq.request]
        # a delta stream reports the prompt's log-probabilities once, in its first output
        prompt_logprobs = None if group.delta and group.reported else first.prompt_logprobs
        group.reported = True
        return RequestOutput(
            request_id=request_id, prompt=group.prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=completions, finished=finished,
            num_cached_tokens=first.num_cached_tokens,
        )

    def _update_text(self, seq: _Sequence) -> None:
        """Detokenize the new tokens, applying stop strings after each (a stop ends the request at the token
        that completes it: the tokens after it, accepted drafts of the same step, are dropped)."""
        request = seq.request
        known = request.known_output_token_ids
        stops = request.params.stop_strings
        for index in range(seq.detokenized, len(known)):
            seq.text += seq.detokenizer.push(known[index])
            seq.detokenized = index + 1
            if stops and self._stop_string(seq):
                request.drop_output_after(index + 1)
                return  # what the detokenizer still holds comes after the stop
        if request.is_finished and request.status != RequestStatus.FINISHED_ABORTED:
            seq.text += seq.detokenizer.flush()
            if stops:
                self._stop_string(seq)  # in the flushed tail

    def _stop_string(self, seq: _Sequence) -> bool:
        """Search the new text for the request's stop strings; the earliest match cuts the text there and
        finishes the request (True)."""
        request = seq.request
        stops = request.params.stop_strings
        if request.is_finished and isinstance(request.stop_reason, str):
            return False
        # only the new text, and the tail before it that a stop string could still end in, is scanned
        start = max(0, seq.stop_scanned - max(len(stop) for stop in stops) + 1)
        seq.stop_scanned = len(seq.text)
        found = [(at, stop) for stop in stops if (at := seq.text.find(stop, start)) != -1]
        if found:
            at, stop = min(found)  # the earliest match cuts the text
            end = at + len(stop) if request.params.include_stop_str_in_output else at
            seq.text = seq.text[:end]
            request.finish(RequestStatus.FINISHED_STOPPED, stop)
            return True
        return False

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
