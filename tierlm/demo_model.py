"""`tierlm demo-model`: a small, random-weight Qwen4-Exp checkpoint with a real tokenizer, built offline.

Owns the two demo configurations (`tiny` for tests and a 2-core CPU, `small` for benchmarks), the local
training of their byte-level BPE tokenizer, the weight initialisation and the sharded safetensors writing.
Everything is a function of (size, seed, this Python's standard library): building twice gives the same
bytes. The tensor list comes from `tierlm.model.checkpoint_layout`, so the files have exactly the names,
shapes and int64 hash buffers that transformers' `save_pretrained` would write. It does not own loading
(the engine's weight loader reads what this writes, like any other checkpoint).

Choices worth knowing:
- dtype: `tiny` is float32 (exact CPU parity tests against transformers, fast enough on CPU); `small` is
  bfloat16 (what a GPU serves, and half the bytes to move).
- vocab_size: the tokenizer's size rounded up to a multiple of 64; the padded ids (if any) are never produced
  by the tokenizer. With the trainer's vocab sizes (4096, 8192) there is no padding.
- The tokenizer is trained on this interpreter's standard-library sources (sorted file names, a fixed byte
  budget), so it is deterministic on a machine but may differ between Python versions.
- Weights: `tierlm.model.random_weights` (also what `--load-format dummy` loads): std 1/sqrt(fan_in),
  an lm_head scaled so next-token distributions are neither flat nor one-hot, Gemma-style norms near 0,
  non-zero PLE convolutions (transformers zero-initialises them) so that path is exercised. Each tensor
  has its own generator, seeded from (seed, tensor name).
- `--mtp` adds an MTP draft head (`mtp.*`, one QSA layer, `mtp_num_hidden_layers: 1` in config.json),
  random like the rest; without it the files are exactly those of a build before the option existed.
- Bigger n-gram tables (`--ngram-vocab-base`, `--heads-per-ngram`, `--ple-embed-dim`) for NVMe and
  page-cache benchmarks: the table is then split into shards of at most `MAX_PLE_SHARD_BYTES`, and each
  shard is generated (from its own generator), written and freed before the next, so the build's memory
  stays bounded whatever the table size. The `add_parser` epilog gives a 4 GB recipe.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT, IM_START, IM_END = SPECIAL_TOKENS

# Plain text tokens as Qwen's tokenizers have them: added (one id each) but not special, so decoded text
# keeps them and the reasoning / tool-call parsers see them.
TAG_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# With --vision: Qwen's image marker tokens, appended to the trained vocabulary (so every other id stays)
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# the demo's vision tower (`vision_config`; out_hidden_size is the text model's width) and image processor
DEMO_VISION = {
    "depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "patch_size": 16,
    "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
}
DEMO_PREPROCESSOR = {
    "size": {"shortest_edge": 64 * 64, "longest_edge": 512 * 512}, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_processor_type": "Qwen2VLImageProcessor",
}

# ChatML, with Qwen's conventions for tools and thinking: the tools listed as JSON lines in the system
# turn, an assistant's calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, tool
# results as `<tool_response>` blocks in a user turn, and `enable_thinking` (when given) opening a
# `<think>` block after the generation prompt (true) or closing an empty one (false).
CHATML_TEMPLATE = (
    "{%- macro text(content) %}\n"
    "{%- if content is string %}{{- content }}\n"
    "{%- elif content is not none %}\n"
    "{%- for part in content %}{%- if part['type'] == 'text' %}{{- part['text'] }}\n"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}\n"
    "{%- endif %}{%- endfor %}\n"
    "{%- endif %}\n"
    "{%- endmacro %}\n"
    "{%- set skip_first = tools and messages[0]['role'] == 'system' %}\n"
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if skip_first %}{{- text(messages[0]['content']) + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n\\nThese functions are available, one JSON signature per line:\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools>\\n\\nTo call functions, answer with one block per call:\\n<tool_call>\\n'"
    " + '{\"name\": <name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call><|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- set role = message['role'] %}\n"
    "{%- if role not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "{{- raise_exception('Only system, user, assistant and tool roles are supported, got ' + role) }}\n"
    "{%- endif %}\n"
    "{%- if role == 'tool' %}\n"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- elif not (loop.first and skip_first) %}\n"
    "{{- '<|im_start|>' + role + '\\n' + text(message['content']) }}\n"
    "{%- if role == 'assistant' and message['tool_calls'] %}\n"
    "{%- for call in message['tool_calls'] %}\n"
    "{%- set function = call['function'] if call['function'] is defined else call %}\n"
    "{%- set arguments = function['arguments'] %}\n"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}\n"
    "{{- '<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}\n"
    "{{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined %}{{- '<think>\\n' if enable_thinking else '<think>\\n\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
)

# Sampling defaults written to generation_config.json (Qwen's usual non-thinking values).
GENERATION_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}

@dataclass(frozen=True)
class DemoSize:
    """One demo configuration: the architecture (config.json fields other than vocab/eos) and build knobs."""

    text_config: dict[str, Any]
    tokenizer_vocab: int
    corpus_bytes: int  # standard-library source bytes the tokenizer is trained on
    max_shard_bytes: int
    dtype: str


def _layer_types(num_layers: int, interval: int) -> list[str]:
    return ["indexed_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


SIZES: dict[str, DemoSize] = {
    # ~3.6 M parameters, 15 MB float32; 3 GDN layers (PLE on 1 and 2) + 1 QSA layer.
    "tiny": DemoSize(
        text_config={
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "layer_types": _layer_types(4, 4),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "hc_count": 4,
            "hc_lowrank": 16,
            "ple_layer_ids": [1, 2],
            "ple_embed_dim": 64,
            "ple_conv_kernel_size": 4,
            "ngram_size": 3,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 2000,
            "split_ngram_parts": 4,
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 32,
            "indexer_budget": 64,
            "indexer_compress_ratio": 4,
        },
        tokenizer_vocab=4096,
        corpus_bytes=2_000_000,
        max_shard_bytes=8 << 20,
        dtype="float32",
    ),
    # ~150 M parameters, ~300 MB bfloat16; 6 GDN layers (PLE on 1 and 5) + 2 QSA layers.
    "small": DemoSize(
        text_config={
            "hidden_size": 512,
            "num_hidden_layers": 8,
            "layer_types": _layer_types(8, 4),
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 32768,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.25,
            },
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "num_experts": 64,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256,
            "hc_count": 4,
            "hc_lowrank": 32,
            "ple_layer_ids": [1, 5],
            "ple_embed_dim": 256,
            "ple_conv_kernel_size": 4,
            "ngram_size": 3,
            "heads_per_ngram": 4,
            "ngram_vocab_size_base": 50_000,
            "split_ngram_parts": 16,
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 64,
            "indexer_budget": 64,
            "indexer_compress_ratio": 8,
        },
        tokenizer_vocab=8192,
        corpus_bytes=4_000_000,
        max_shard_bytes=100 << 20,
        dtype="bfloat16",
    ),
}

_COMMON_FIELDS = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "norm_topk_prob": True,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "output_gate_type": None,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "pad_token_id": None,
}


# The PLE fields a demo build may override (`tierlm demo-model --ngram-vocab-base ...`), and the largest
# table shard it then writes: each shard is generated, written and freed on its own.
PLE_OVERRIDES = ("ngram_vocab_size_base", "heads_per_ngram", "ple_embed_dim")
MAX_PLE_SHARD_BYTES = 64 << 20
# decoder layers of the MTP draft head `--mtp` writes (vLLM's default when a config does not say)
DEMO_MTP_LAYERS = 1


# ---- tokenizer --------------------------------------------------------------------------------------


def corpus_files(budget_bytes: int) -> list[Path]:
    """The stdlib sources the tokenizer learns from: top-level `*.py`, by name, up to a byte budget."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(stdlib.glob("*.py"), key=lambda p: p.name):
        if total >= budget_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    if not chosen:
        raise RuntimeError(f"no Python sources found in the standard library folder {stdlib}")
    return chosen


def _corpus_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


@lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int, corpus_bytes: int, show_progress: bool = False) -> str:
    """A byte-level BPE tokenizer (as tokenizer.json text) with the ChatML special tokens at ids 0, 1, 2 and
    the (not special) tag tokens `<think>`, `</think>`, `<tool_call>`, `</tool_call>` at 3-6.

    Byte-level pre-tokenizer and decoder with the full 256-byte initial alphabet: every string round-trips.
    Deterministic for a given file list (cached per process: the tests build several models).
    """
    files = corpus_files(corpus_bytes)
    return bpe_tokenizer_json(_corpus_texts(files), len(files), vocab_size, show_progress)


def bpe_tokenizer_json(texts: Iterable[str], count: int, vocab_size: int, show_progress: bool = False) -> str:
    """`train_tokenizer`'s tokenizer learnt from `count` texts (the trained demo model's corpus uses it too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS + TAG_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=count)
    raw = json.loads(tokenizer.to_str())
    for added in raw["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS  # the tag tokens are plain text
    return json.dumps(raw, indent=2, ensure_ascii=False)


def tokenizer_config(ids: dict[str, int], max_length: int) -> dict[str, Any]:
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS + VISION_TOKENS,
        }
        for token in ids
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# ---- config -----------------------------------------------------------------------------------------


def demo_config(
    size: str, vocab_size: int, eos_token_id: int, ple_overrides: dict[str, int] | None = None, mtp: bool = False
) -> dict[str, Any]:
    """The config.json dict of a demo model (flat text fields, as `save_pretrained` writes them).

    `ple_overrides` replaces any of `PLE_OVERRIDES` (a bigger n-gram table); `split_ngram_parts` then
    grows so that no table shard exceeds `MAX_PLE_SHARD_BYTES`. mtp: the model has an MTP draft head of
    `DEMO_MTP_LAYERS` layers.
    """
    spec = SIZES[size]
    padded_vocab = math.ceil(vocab_size / 64) * 64
    fields = {**_COMMON_FIELDS, **spec.text_config}
    if ple_overrides:
        unknown = sorted(set(ple_overrides) - set(PLE_OVERRIDES))
        if unknown:
            raise ValueError(
                f"ple_overrides: {unknown} cannot be overridden; choose from {list(PLE_OVERRIDES)}"
            )
        fields.update(ple_overrides)
        item_size = 4 if spec.dtype == "float32" else 2
        # about heads x ngram_vocab_size_base rows (each head's prime lies just above the base), D/heads wide
        table_bytes = fields["ngram_vocab_size_base"] * fields["ple_embed_dim"] * item_size
        parts = math.ceil(table_bytes / MAX_PLE_SHARD_BYTES)
        fields["split_ngram_parts"] = max(fields["split_ngram_parts"], parts)
    if mtp:
        fields["mtp_num_hidden_layers"] = DEMO_MTP_LAYERS
    config = {
        "architectures": ["Qwen4ExpForCausalLM"],
        "model_type": "qwen4_exp_text",
        "dtype": spec.dtype,
        "vocab_size": padded_vocab,
        "eos_token_id": eos_token_id,
        "number_of_conv_states": 3 if fields["ple_layer_ids"] else 1,
        "use_cache": True,
        **fields,
    }
    return dict(sorted(config.items()))


def vision_demo_config(text: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """A demo config.json made a VLM's: the text fields under text_config, DEMO_VISION as vision_config
    (its output as wide as the text model), the image marker ids."""
    text_config = {k: v for k, v in text.items() if k != "architectures"}
    text_config["model_type"] = "qwen4_exp_text"
    start, image, end = (ids[token] for token in VISION_TOKENS)
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
        "text_config": text_config,
        "vision_config": {**DEMO_VISION, "model_type": "qwen4_exp_vision", "out_hidden_size": text["hidden_size"]},
        "image_token_id": image, "video_token_id": image, "vision_start_token_id": start, "vision_end_token_id": end,
        "tie_word_embeddings": text.get("tie_word_embeddings", False), "dtype": text["dtype"],
    }


VLM_TEXT_PREFIX = "model.language_model."


def _stored_name(name: str, vision: bool) -> str:
    """A layout name as a VLM checkpoint stores it (the text model under `model.language_model.`)."""
    if vision and name.startswith("model.") and not name.startswith("model.visual."):
        return VLM_TEXT_PREFIX + name[len("model.") :]
    return name


# ---- weights ----------------------------------------------------------------------------------------


def _plan_shards(sizes: list[int], max_shard_bytes: int) -> list[int]:
    """Shard index of each tensor, in order, starting a new shard when the next tensor would overflow."""
    shard_of, current, used = [], 0, 0
    for nbytes in sizes:
        if used and used + nbytes > max_shard_bytes:
            current, used = current + 1, 0
        shard_of.append(current)
        used += nbytes
    return shard_of


# ---- the build --------------------------------------------------------------------------------------

OWNED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
)


def _owned(path: Path) -> bool:
    return path.name in OWNED_FILES or (path.name.startswith("model-") and path.suffix == ".safetensors")


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_model(
    out_dir: str | Path,
    size: str = "tiny",
    seed: int = 0,
    *,
    overwrite: bool = False,
    progress: bool = False,
    ple_overrides: dict[str, int] | None = None,
    quantize: str | None = None,
    group_size: int = 32,
    mtp: bool = False,
    vision: bool = False,
) -> Path:
    """Write the demo checkpoint of `size` into `out_dir` and return that folder.

    The files are written to a hidden folder beside `out_dir` and moved in at the end (config.json last),
    so an interrupted build leaves no half model behind. An `out_dir` that already holds checkpoint files
    is refused unless `overwrite`; only those files are replaced, anything else in the folder is kept.
    `ple_overrides` (see `demo_config`) makes the n-gram tables bigger, e.g. multi-GB for benchmarks.
    `quantize` (a `tierlm quantize` scheme, e.g. int4-mixed) writes the quantized checkpoint instead: the
    dense one is built in a hidden folder beside `out_dir` and quantized from there. `mtp` adds an MTP
    draft head (`mtp.*`). `vision` makes it a VLM (Qwen4ExpForConditionalGeneration): a small vision tower
    (`DEMO_VISION`, `model.visual.*`), the text model under `model.language_model.`, the image marker tokens
    appended to the vocabulary, and a preprocessor_config.json.
    """
    if vision and quantize is not None:
        raise ValueError("vision: a quantized demo model with a vision tower is not supported")
    if quantize is not None:
        from tierlm.tools.quantize import quantize_checkpoint

        out = Path(out_dir)
        if out.is_dir() and any(_owned(p) for p in out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out} already holds checkpoint files; overwrite=True replaces them")
        out.parent.mkdir(parents=True, exist_ok=True)
        dense = Path(tempfile.mkdtemp(prefix=f".{out.name}.dense-", dir=out.parent))
        try:
            build_demo_model(
                dense, size, seed, overwrite=True, progress=progress, ple_overrides=ple_overrides, mtp=mtp
            )
            return quantize_checkpoint(dense, out, quantize, group_size, overwrite=True, progress=progress)
        finally:
            shutil.rmtree(dense, ignore_errors=True)
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from tierlm.config import ModelConfig
    from tierlm.model.checkpoint_layout import MTPLayout, checkpoint_layout, ple_hash_buffers
    from tierlm.model.random_weights import random_tensor

    if size not in SIZES:
        raise ValueError(f"size: unknown demo size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    out = Path(out_dir)
    existing = sorted(p for p in out.iterdir() if _owned(p)) if out.is_dir() else []
    if existing and not overwrite:
        names = ", ".join(p.name for p in existing[:3]) + (", ..." if len(existing) > 3 else "")
        raise FileExistsError(f"{out} already holds checkpoint files ({names}); overwrite=True replaces them")

    console = Console(stderr=True)
    # The trainer's bars print stray newlines on stdout when it is not a terminal.
    show_trainer = progress and sys.stdout.isatty()
    tokenizer_json = train_tokenizer(spec.tokenizer_vocab, spec.corpus_bytes, show_progress=show_trainer)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    if vision:
        from tokenizers import AddedToken

        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
        tokenizer_json = json.dumps(json.loads(tokenizer.to_str()), indent=2, ensure_ascii=False)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + TAG_TOKENS + VISION_TOKENS * vision}
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    raw_config = demo_config(size, vocab, ids[IM_END], ple_overrides, mtp)
    if vision:
        raw_config = vision_demo_config(raw_config, ids)
    config = ModelConfig.from_dict(raw_config)  # refuse to write a config the reference would reject

    dtype = getattr(torch, spec.dtype)
    layout = checkpoint_layout(config, mtp=MTPLayout(config.num_mtp_layers) if mtp else None)
    buffers = {
        f"model.layers.{layer_id - 1}.ple.ple_embedding.": ple_hash_buffers(config, k)
        for k, layer_id in enumerate(config.ple_layer_ids)
    }
    item_size = {"int64": 8}
    nbytes = [math.prod(t.shape) * item_size.get(t.kind, dtype.itemsize) for t in layout]
    shard_of = _plan_shards(nbytes, spec.max_shard_bytes)
    num_shards = shard_of[-1] + 1
    shard_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (staging / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(staging / "tokenizer_config.json", tokenizer_config(ids, config.max_position_embeddings))
        if vision:
            _write_json(staging / "preprocessor_config.json", DEMO_PREPROCESSOR)
        _write_json(
            staging / "generation_config.json",
            {"do_sample": True, "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], **GENERATION_DEFAULTS},
        )
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, disable=not progress) as bar:
            task = bar.add_task(f"demo-model {size}: weights", total=len(layout))
            for shard in range(num_shards):
                tensors = {}
                for tensor_spec, owner in zip(layout, shard_of, strict=True):
                    if owner != shard:
                        continue
                    prefix, leaf = tensor_spec.name.rsplit(".", 1)
                    hash_buffer = buffers[prefix + "."][leaf] if tensor_spec.kind == "int64" else None
                    tensors[_stored_name(tensor_spec.name, vision)] = random_tensor(
                        tensor_spec, seed, dtype, config.hidden_size, hash_buffer
                    )
                    bar.advance(task)
                save_file(tensors, str(staging / shard_names[shard]), metadata={"format": "pt"})
        index = {
            "metadata": {"total_size": sum(nbytes)},
            "weight_map": {
                _stored_name(t.name, vision): shard_names[s]
                for t, s in sorted(zip(layout, shard_of, strict=True), key=lambda x: _stored_name(x[0].name, vision))
            },
        }
        _write_json(staging / "model.safetensors.index.json", index)
        _write_json(staging / "config.json", raw_config)
        mode = (staging / "config.json").stat().st_mode & 0o777  # what the umask gives a new file
        for name in shard_names:  # safetensors creates its files private
            (staging / name).chmod(mode)

        out.mkdir(parents=True, exist_ok=True)
        for stale in existing:
            stale.unlink()
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):  # config.json last
            path.replace(out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# ---- the default model ------------------------------------------------------------------------------

# the small code model `tierlm train-demo` trained, committed in the repository's models/ (large files live
# there); a checkout's editable install finds it, an installed wheel has none and serves the random demo
TRAINED_DEFAULT_DIR = Path(__file__).resolve().parents[1] / "models" / "default_model"


def default_model_dir(trained: Path = TRAINED_DEFAULT_DIR) -> Path:
    """What `tierlm serve` serves without a model: the trained default when `trained` holds one, else the
    tiny random demo checkpoint in the user's cache folder ($XDG_CACHE_HOME or ~/.cache), built there if
    missing."""
    if (trained / "config.json").is_file():
        return trained
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierlm" / "demo-tiny"
    if not (folder / "config.json").is_file():
        print(f"tierlm: building the random demo model in {folder} (once)", file=sys.stderr)
        build_demo_model(folder, "tiny", overwrite=True)
    return folder


# ---- command line -----------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    from tierlm.cli import CliError

    start = time.perf_counter()
    overrides = {name: getattr(args, name) for name in PLE_OVERRIDES if getattr(args, name) is not None}
    try:
        out = build_demo_model(
            args.out_dir, args.size, args.seed, overwrite=args.force, progress=True, ple_overrides=overrides,
            quantize=args.quantize, group_size=args.group_size, mtp=args.mtp, vision=args.vision,
        )
    except FileExistsError:
        raise CliError(
            f"{args.out_dir} already holds checkpoint files; pass --force to replace them"
        ) from None
    except ValueError as exc:  # ConfigError: overrides the architecture rules reject
        raise CliError(str(exc)) from None
    total = sum(p.stat().st_size for p in out.iterdir() if _owned(p))
    seconds = time.perf_counter() - start
    print(
        f"wrote the {args.size} demo model to {out}: {total / 1e6:.1f} MB in {seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo-model",
        help="write a small random-weight Qwen4-Exp checkpoint with a trained tokenizer",
        description="Write a small random-weight Qwen4-Exp checkpoint (config, sharded safetensors, a BPE "
        "tokenizer trained on Python's standard library, chat template). "
        "The same seed gives identical files.",
        epilog="A multi-GB n-gram table for NVMe benchmarks, with the real model's 320-byte rows "
        "(16 heads of 160 bf16 values): `tierlm demo-model models/demo-ple4g --size small "
        "--ngram-vocab-base 400000 --heads-per-ngram 8 --ple-embed-dim 2560` writes two PLE tables of "
        "6.4 M rows x 320 B = 2.05 GB each (4.1 GB); table bytes per PLE layer are about "
        "ngram-vocab-base x ple-embed-dim x 2 (bfloat16; x 4 for the float32 tiny size).",
    )
    parser.add_argument("out_dir", metavar="DIR", type=Path, help="folder to write the checkpoint into")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny: tests and CPU serving (float32); small: benchmarks (bfloat16)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="weight seed; the same seed gives identical files"
    )
    parser.add_argument("--force", action="store_true", help="replace checkpoint files already in DIR")
    parser.add_argument(
        "--mtp", action="store_true",
        help=f"also write an MTP draft head (mtp.*: {DEMO_MTP_LAYERS} QSA layer, vLLM's speculative 'mtp' method)",
    )
    parser.add_argument(
        "--vision", action="store_true",
        help="a VLM: also write a small vision tower (model.visual.*), the image marker tokens and a "
        "preprocessor_config.json",
    )
    from tierlm.tools.quantize import SCHEMES as QUANTIZE_SCHEMES

    parser.add_argument(
        "--quantize", choices=QUANTIZE_SCHEMES, default=None, metavar="SCHEME",
        help=f"write the checkpoint quantized as `tierlm quantize --scheme SCHEME` would ({', '.join(QUANTIZE_SCHEMES)})",
    )
    parser.add_argument("--group-size", type=_positive_int, default=32, help="with --quantize: inputs per INT4/INT6 scale")
    tables = parser.add_argument_group("bigger n-gram tables (benchmarks; see the recipe below)")
    tables.add_argument(
        "--ngram-vocab-base", dest="ngram_vocab_size_base", type=_positive_int, metavar="N",
        help="ngram_vocab_size_base: each n-gram head gets the next prime above N rows",
    )
    tables.add_argument("--heads-per-ngram", type=_positive_int, metavar="N", help="heads_per_ngram")
    tables.add_argument(
        "--ple-embed-dim", type=_positive_int, metavar="D",
        help="ple_embed_dim: row width x number of heads ((ngram_size-1) x heads-per-ngram)",
    )
    parser.set_defaults(func=_run)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
