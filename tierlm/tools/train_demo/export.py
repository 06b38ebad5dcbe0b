"""Write an in-memory `Qwen4ExpForCausalLM` as a Hugging Face checkpoint folder tierlm loads as is.

The inverse of the loader's mapping, driven by the same `checkpoint_layout`: each checkpoint tensor is
cut from the runtime weight that holds it (packed projections by their rows, routed experts from their
stacks, the PLE table into `shard_{j}` parts, its int64 hash buffers recomputed from the config), so the
folder has exactly the names and shapes `load_model` checks. Beside the weights: config.json, the
tokenizer, tokenizer_config.json with the chat template, and generation_config.json (the demo model's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tierlm.demo_model import (
    ENDOFTEXT,
    GENERATION_DEFAULTS,
    IM_END,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    tokenizer_config,
)
from tierlm.model.checkpoint_layout import MTPLayout, checkpoint_layout, ple_hash_buffers, ple_shard_rows
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM

WEIGHTS_FILE = "model.safetensors"

# the trained model's default (applied to requests that leave it unset, as vLLM applies generation_config):
# a 10.8 M-parameter model decoding greedily repeats itself inside docstrings ("further further ..."); with
# 1.05 greedy `def fibonacci(n):` closes its docstring and writes a body (checked in tests/test_train_demo.py)
REPETITION_PENALTY = 1.05


def checkpoint_tensors(model: Qwen4ExpForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the model's checkpoint layout (its MTP head's too, if it has one): name -> CPU tensor,
    floats in `dtype`."""
    config = model.config
    mtp = MTPLayout(len(model.mtp.layers), model.mtp.shared_head is not None) if model.mtp is not None else None
    params = dict(model.named_parameters())
    parts = {}
    for path, module in model.named_modules():
        if hasattr(module, "checkpoint_modules"):
            for part in module.checkpoint_modules(path):
                parts[f"{part.name}.weight"] = (module, part)
    out = {}
    for spec in checkpoint_layout(config, mtp=mtp):
        name = spec.name
        if name in parts:
            module, part = parts[name]
            tensor = module.runtime_tensor(part, "weight").narrow(0, part.start, part.out_features)
        elif spec.kind == "int64":
            prefix, leaf = name.rsplit(".", 1)
            layer = int(prefix.split(".")[2])
            tensor = torch.tensor(ple_hash_buffers(config, config.ple_index(layer))[leaf], dtype=torch.int64)
        elif spec.kind == "ple_table":
            table_owner, shard = name.split(".ple_embedding.ngram_embedding.shard_")
            table = params[f"{table_owner}.table.weight"]
            sizes = ple_shard_rows(table.shape[0], config.split_ngram_parts)
            index = int(shard.split(".")[0])
            tensor = table.narrow(0, sum(sizes[:index]), sizes[index])
        else:
            tensor = params[name]
        if tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"{name}: the model holds {tuple(tensor.shape)}, the layout says {spec.shape}")
        tensor = tensor.detach()
        out[name] = (tensor if tensor.dtype == torch.int64 else tensor.to(dtype)).contiguous().cpu()
    return out


def write_checkpoint(
    model: Qwen4ExpForCausalLM, raw_config: dict[str, Any], tokenizer_json: str, out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """The model, its config.json fields (`raw_config`, dtype set here) and its tokenizer as a checkpoint
    folder `out_dir` (created; files of the same names replaced). Returns the folder."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS + TAG_TOKENS}
    save_file(checkpoint_tensors(model, dtype), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    files = {
        "tokenizer_config.json": tokenizer_config(ids, raw_config["max_position_embeddings"]),
        "generation_config.json": {
            "do_sample": True, "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], **GENERATION_DEFAULTS,
            "repetition_penalty": REPETITION_PENALTY,
        },
        "config.json": {**raw_config, "dtype": str(dtype).removeprefix("torch.")},  # last: the folder is complete
    }
    for name, value in files.items():
        (out_dir / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / WEIGHTS_FILE).chmod((out_dir / "config.json").stat().st_mode & 0o777)  # safetensors writes it private
    return out_dir
