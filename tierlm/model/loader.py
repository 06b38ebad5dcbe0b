"""Load a Hugging Face Qwen4-Exp checkpoint folder into `Qwen4ExpForCausalLM`.

The model is built on the meta device, materialised once in the target dtype and device, and each
checkpoint tensor is read from the memory-mapped safetensors file straight into its destination (per-
expert tensors into slices of the stacked expert weights, PLE `shard_{j}` parts into row ranges of one
table), so no second full copy of the weights is ever held. The checkpoint is checked against
`checkpoint_layout` before any data is read: a missing, unexpected or misshapen tensor fails with its
name and the expected shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tierlm.config import ModelConfig
from tierlm.model.checkpoint_layout import PREFIX, checkpoint_layout, ple_hash_buffers, ple_shard_rows
from tierlm.model.layers.packed_linear import PackedLinear
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM

VLM_PREFIX = "model.language_model."
# tensors of parts tierlm builds elsewhere (vision tower, MTP draft head): not part of the text model
IGNORED_PREFIXES = ("model.visual.", "mtp.")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PLE_SHARD = re.compile(r"(model\.layers\.\d+\.ple)\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight")
_PLE_BUFFER = re.compile(r"model\.layers\.(\d+)\.ple\.ple_embedding\.(\w+)")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensor."""


class ModelNotFoundError(FileNotFoundError):
    """A model name that is neither a local folder nor downloadable here."""


def resolve_model_path(model: str | Path) -> Path:
    """A local folder as is; otherwise a Hugging Face repo id fetched with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(model).startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {model!r} is not a folder with config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception as exc:  # offline, unknown repo, no permission: all end the same way for the user
        raise ModelNotFoundError(
            f"model {model!r} is not a local folder and could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}). "
            "Point at a local checkpoint folder instead (one holding config.json and *.safetensors), "
            "e.g. one made by `tierlm demo-model DIR`."
        ) from None


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (via its index when there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _canonical(name: str) -> str | None:
    """The `model.`-prefixed name of a text-model tensor, or None for parts loaded elsewhere."""
    if name.startswith(VLM_PREFIX):
        name = PREFIX + name[len(VLM_PREFIX) :]
    if name.startswith(IGNORED_PREFIXES):
        return None
    return name


def _index_tensors(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """canonical name -> (file, name in file, shape), reading headers only."""
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                canonical = _canonical(name)
                if canonical is not None:
                    found[canonical] = (file, name, tuple(f.get_slice(name).get_shape()))
    return found


def _check_layout(config: ModelConfig, found: dict) -> None:
    expected = {spec.name: spec.shape for spec in checkpoint_layout(config)}
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])}){more}")
    unexpected = sorted(n for n in found if n not in expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"unexpected tensor {unexpected[0]} in the checkpoint{more}; it does not fit the config")
    for name, shape in expected.items():
        if found[name][2] != shape:
            raise CheckpointError(f"tensor {name} has shape {list(found[name][2])}, expected {list(shape)}")


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
    mapped_ple_tables: bool = False,
) -> tuple[Qwen4ExpForCausalLM, ModelConfig]:
    """mapped_ple_tables: the PLE tables are served from memory-mapped files (`memory/ngram_store.py`),
    so they are neither allocated nor read here."""
    model_dir = resolve_model_path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    target_dtype = resolve_dtype(dtype, config)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    found = _index_tensors(checkpoint_files(model_dir))
    _check_layout(config, found)

    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config).to(target_dtype)
    if mapped_ple_tables:
        for layer in model.model.layers:
            if layer.ple is not None:
                layer.ple.table = None
    model = model.to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    destination = _Destinations(model, config)
    handles: dict[Path, object] = {}
    for name, (file, name_in_file, _) in found.items():
        if mapped_ple_tables and _PLE_SHARD.fullmatch(name):
            continue
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        destination.fill(name, handles[file].get_tensor(name_in_file))
    return model, config


class _Destinations:
    """Where each checkpoint tensor goes in the runtime model."""

    def __init__(self, model: Qwen4ExpForCausalLM, config: ModelConfig) -> None:
        self.params = dict(model.named_parameters())
        self.config = config
        self.shard_starts: dict[str, list[int]] = {}
        # checkpoint tensor -> (packed parameter, first row, end row)
        self.packed: dict[str, tuple[str, int, int]] = {}
        for path, module in model.named_modules():
            if isinstance(module, PackedLinear):
                parent = path.rsplit(".", 1)[0]
                for part, (start, end) in module.packed_rows().items():
                    self.packed[f"{parent}.{part}.weight"] = (f"{path}.weight", start, end)
                    if module.bias is not None:
                        self.packed[f"{parent}.{part}.bias"] = (f"{path}.bias", start, end)

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.packed:
            param, start, end = self.packed[name]
            self.params[param][start:end].copy_(tensor)
        elif m := _EXPERT.fullmatch(name):
            stack, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            if proj == "down_proj":
                self.params[f"{stack}.down_proj"][expert].copy_(tensor)
                return
            size = self.config.moe_intermediate_size
            rows = slice(0, size) if proj == "gate_proj" else slice(size, 2 * size)
            self.params[f"{stack}.gate_up_proj"][expert, rows].copy_(tensor)
        elif m := _PLE_SHARD.fullmatch(name):
            table = self.params[f"{m.group(1)}.table.weight"]
            starts = self.shard_starts.get(m.group(1))
            if starts is None:
                sizes = ple_shard_rows(table.shape[0], self.config.split_ngram_parts)
                starts = self.shard_starts[m.group(1)] = [sum(sizes[:j]) for j in range(len(sizes))]
            start = starts[int(m.group(2))]
            table[start : start + tensor.shape[0]].copy_(tensor)
        elif m := _PLE_BUFFER.fullmatch(name):
            expected = ple_hash_buffers(self.config, self.config.ple_index(int(m.group(1))))[m.group(2)]
            if tensor.tolist() != expected:
                raise CheckpointError(f"tensor {name} is {tensor.tolist()}, but the config's hash gives {expected}")
        else:
            self.params[name].copy_(tensor)
