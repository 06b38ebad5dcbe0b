"""Load a Hugging Face Qwen4-Exp checkpoint folder into `Qwen4ExpForCausalLM`.

The model is built on the meta device, materialised once in the target dtype and device, and each
checkpoint tensor is read from the memory-mapped safetensors file straight into its destination (per-
expert tensors into slices of the stacked expert weights, PLE `shard_{j}` parts into row ranges of one
table), so no second full copy of the weights is ever held. The checkpoint is checked against
`checkpoint_layout` before any data is read: a missing, unexpected or misshapen tensor fails with its
name and the expected shape; unknown tensors of known modules (e.g. activation scales), and a tied model's
`lm_head.*` (its head is the embedding), are skipped with one log line.

A VLM config (with a `vision_config`) loads the vision tower's `model.visual.*` tensors into the model's
`visual` (checked against the layout like the rest); without one they are skipped.

The MTP draft head (`mtp.*`) is skipped unless the caller asks for it (`load_mtp`): then it is checked
against the layout and loaded like the rest (`model.mtp`), quantized modules included. Its tensors may
also come as `model.mtp.*` or `model.language_model.mtp.*`; they are read as `mtp.*`.

Quantized checkpoints: the `quantization_config` in config.json gives each checkpoint module a weight
format (`tierlm.model.quantization`); each layer gets the quant method of its modules before the model is
materialised, so packed weights are allocated packed and copied in packed (only small zero points are
unpacked), never dequantized. With `tie_word_embeddings` the checkpoint holds the table once (as
`model.embed_tokens`, packed or not) and lm_head runs on the embedding's tensors (`Embedding.tie`); the
config must give both one format.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from tierlm.config import LOAD_FORMATS, ModelConfig
from tierlm.model.checkpoint_layout import (
    MTP_PREFIX,
    MTP_SHARED_HEAD,
    PREFIX,
    VISION_PREFIX,
    MTPLayout,
    checkpoint_layout,
    ple_hash_buffers,
    ple_shard_rows,
)
from tierlm.model.layers.ple_fp8 import Fp8NgramTable
from tierlm.model.pipeline_stage import PipelineStage, StageLayout
from tierlm.model.quantization.base import ModulePart, QuantizationError
from tierlm.model.quantization.config import QuantizationConfig, module_format
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM
from tierlm.model.random_weights import random_tensor

logger = logging.getLogger(__name__)

VLM_PREFIX = "model.language_model."
# tensors of known parts that inference does not use (skipped with the unknown tensors of known modules)
UNUSED_PREFIXES = (
    "model.hyper_connection_mixer.block_inject_weight.", "mtp.hyper_connection_mixer.block_inject_weight.",
)
DTYPE_TAGS = {"int32": "I32", "int64": "I64", "float8_e4m3fn": "F8_E4M3", "float32": "F32"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PLE_SHARD = re.compile(r"(model\.layers\.\d+\.ple)\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight")
_PLE_SCALE = re.compile(r"(model\.layers\.\d+\.ple)\.ple_embedding\.ngram_embedding\.weight_scale")
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
        ) from exc


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


def _canonical(name: str, with_mtp: bool, with_vision: bool) -> str | None:
    """The `model.`-prefixed name of a text-model tensor (`mtp.` for the draft head's, `model.visual.` for
    the vision tower's), or None for parts not loaded (the draft head's unless with_mtp, the vision tower's
    unless with_vision)."""
    if name.startswith(VLM_PREFIX):
        name = PREFIX + name[len(VLM_PREFIX) :]
    if name.startswith(PREFIX + MTP_PREFIX):
        name = name[len(PREFIX) :]
    if (name.startswith(VISION_PREFIX) and not with_vision) or (name.startswith(MTP_PREFIX) and not with_mtp):
        return None
    return name


def index_tensors(
    files: list[Path], with_mtp: bool = False, with_vision: bool = False
) -> dict[str, tuple[Path, str, tuple[int, ...], str]]:
    """canonical name -> (file, name in file, shape, safetensors dtype tag), reading headers only;
    with_mtp: the MTP draft head's tensors too; with_vision: the vision tower's (a VLM config's)."""
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys() and is not iterable
                canonical = _canonical(name, with_mtp, with_vision)
                if canonical is not None:
                    view = f.get_slice(name)
                    found[canonical] = (file, name, tuple(view.get_shape()), view.get_dtype())
    return found


def has_fp8_ple_tables(found: dict) -> bool:
    """Whether the checkpoint's PLE tables are float8 e4m3 (then with a global scale each)."""
    return any(info[3] == "F8_E4M3" for name, info in found.items() if _PLE_SHARD.fullmatch(name))


def mtp_layout(config: ModelConfig, found: dict) -> MTPLayout | None:
    """The MTP draft head of an index made `with_mtp` (None when it has no `mtp.*` tensors): the config's
    layer count (vLLM's default 1), and a head of its own if `mtp.shared_head.head` is there."""
    if not any(name.startswith(MTP_PREFIX) for name in found):
        return None
    shared_head = any(name.startswith(MTP_SHARED_HEAD.removesuffix("weight")) for name in found)
    return MTPLayout(config.num_mtp_layers, shared_head)


def check_layout(
    config: ModelConfig, found: dict, quantization: QuantizationConfig | None, mtp: MTPLayout | None = None
) -> list[str]:
    """Check names, shapes and integer dtypes against the layout (with the MTP draft head `mtp`, if given);
    returns the tensors to skip: unknown tensors of known modules (scales of activation quantization, hash
    statistics, ...), which vLLM ignores too. A tensor of a module the config does not have is an error."""
    try:
        layout = checkpoint_layout(config, quantization, has_fp8_ple_tables(found), mtp)
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None
    expected = {spec.name: spec for spec in layout}
    missing = [n for n in expected if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        spec = expected[missing[0]]
        raise CheckpointError(f"missing tensor {missing[0]} (expected shape {list(spec.shape)}){more}")
    modules = {name.rsplit(".", 1)[0] for name in expected}
    unexpected = sorted(n for n in found if n not in expected)
    unused = UNUSED_PREFIXES + (("lm_head.",) if config.tie_word_embeddings else ())  # tied: the embedding's
    skipped = [n for n in unexpected if n.rsplit(".", 1)[0] in modules or n.startswith(unused)]
    foreign = [n for n in unexpected if n not in set(skipped)]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise CheckpointError(f"unexpected tensor {foreign[0]} in the checkpoint{more}; it does not fit the config")
    for name, spec in expected.items():
        if found[name][2] != spec.shape and not (spec.kind == "ple_scale" and found[name][2] == ()):
            raise CheckpointError(f"tensor {name} has shape {list(found[name][2])}, expected {list(spec.shape)}")
        if spec.dtype is not None and found[name][3] != DTYPE_TAGS[spec.dtype]:
            raise CheckpointError(
                f"tensor {name} is {found[name][3]}, expected {DTYPE_TAGS[spec.dtype]} ({spec.dtype})"
            )
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        logger.info("skipping %d checkpoint tensors inference does not use: %s", len(skipped), shown)
    return skipped


def attach_formats(model: Qwen4ExpForCausalLM, quantization: QuantizationConfig | None) -> None:
    """Give every linear, embedding and experts layer the quant method of its checkpoint modules."""
    if quantization is None:
        return
    for path, module in model.named_modules():
        if hasattr(module, "checkpoint_modules"):
            names = [part.name for part in module.checkpoint_modules(path)]
            kind = "embedding" if module.kind == "embedding" else "linear"
            try:
                fmt = module_format(quantization, names, kind, path)
            except QuantizationError as exc:
                raise CheckpointError(str(exc)) from None
            try:
                module.set_format(fmt)
            except QuantizationError as exc:
                raise CheckpointError(f"{path} ({fmt.label}): {exc}") from None
    try:
        model.tie_weights()  # a tied lm_head holds the embedding's (packed) tensors: one format for both
    except QuantizationError as exc:
        raise CheckpointError(str(exc)) from None


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device | None = None,
    mapped_ple_tables: bool = False, stage: StageLayout | None = None, load_format: str = "auto",
    load_mtp: bool = False,
) -> tuple[Qwen4ExpForCausalLM | PipelineStage, ModelConfig]:
    """mapped_ple_tables: the PLE tables are served from memory-mapped files (`memory/ngram_store.py`),
    so they are neither allocated nor read here. stage: one pipeline rank's part (a `PipelineStage`):
    only the tensors it holds are allocated and read; the whole checkpoint is still checked. load_format
    "dummy" (vLLM's name) reads no weights: every tensor of the layout gets random values drawn on
    `device` (`model/random_weights.py`, seed 0; on the CPU the very values `tierlm demo-model` writes),
    so a model of any size runs from its config.json alone. load_mtp: load the checkpoint's MTP draft head
    too (`model.mtp`); a checkpoint without one is an error (with "dummy": a random head of the config's
    mtp_num_hidden_layers layers); with a stage, the rank whose layout holds the draft head loads it."""
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"load_format: unknown {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    model_dir = resolve_model_path(model_dir)
    config = ModelConfig.from_pretrained(model_dir)
    target_dtype = resolve_dtype(dtype, config)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quantization = read_quantization_config(model_dir)
    if load_format == "dummy":
        if quantization is not None:
            raise CheckpointError(
                f"load_format dummy draws unquantized weights, but {model_dir}/config.json has a quantization_config"
            )
        mtp = _checked_mtp(config, MTPLayout(config.num_mtp_layers), model_dir) if load_mtp else None
        model, destination = _materialise(
            _on_meta(config, None, target_dtype, stage, mtp), config, device, mapped_ple_tables, False
        )
        for spec in checkpoint_layout(config, mtp=mtp):
            # int64 hash buffers are only checked against the config on load: nothing to draw
            if spec.kind == "int64" or (mapped_ple_tables and spec.kind == "ple_table"):
                continue
            if stage is None or stage.holds(spec.name):
                destination.fill(spec.name, random_tensor(spec, 0, target_dtype, config.hidden_size, device=device))
        return model, config
    found = index_tensors(checkpoint_files(model_dir), with_mtp=load_mtp, with_vision=config.vision is not None)
    mtp = _checked_mtp(config, mtp_layout(config, found), model_dir) if load_mtp else None
    if quantization is not None:
        quantization = quantization.bind_checkpoint(set(found))
    model = _on_meta(config, quantization, target_dtype, stage, mtp)  # each layer's format is checked here first
    skipped = set(check_layout(config, found, quantization, mtp))
    model, destination = _materialise(model, config, device, mapped_ple_tables, has_fp8_ple_tables(found))
    handles: dict[Path, object] = {}
    for name, (file, name_in_file, _, _) in found.items():
        if stage is not None and not stage.holds(name):
            continue
        if name in skipped or (mapped_ple_tables and (_PLE_SHARD.fullmatch(name) or _PLE_SCALE.fullmatch(name))):
            continue
        if file not in handles:
            handles[file] = safe_open(file, framework="pt")
        destination.fill(name, handles[file].get_tensor(name_in_file))
    return model, config


def _checked_mtp(config: ModelConfig, mtp: MTPLayout | None, model_dir: Path) -> MTPLayout:
    """The draft head to load, or a CheckpointError saying why there is none."""
    if mtp is None:
        raise CheckpointError(f"load_mtp: {model_dir} has no MTP draft head (no mtp.* tensors)")
    if mtp.num_layers < 1:
        raise CheckpointError(f"load_mtp: {model_dir}/config.json says mtp_num_hidden_layers 0 (no draft head)")
    if not config.has_qsa:
        raise CheckpointError("load_mtp: the MTP draft head's layers are QSA layers, but the config has no indexer_* "
                              "fields")
    return mtp


def _on_meta(
    config: ModelConfig, quantization: QuantizationConfig | None, dtype: torch.dtype, stage: StageLayout | None,
    mtp: MTPLayout | None = None,
) -> Qwen4ExpForCausalLM | PipelineStage:
    """The model (or a rank's stage of it; with the MTP head `mtp`) on the meta device, each layer with its
    weight format."""
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config, mtp)
        attach_formats(model, quantization)
        if stage is not None:
            model = PipelineStage(model, stage)
        return model.to(dtype)


def _materialise(
    model: Qwen4ExpForCausalLM | PipelineStage, config: ModelConfig, device: torch.device, mapped_ple_tables: bool,
    fp8_ple_tables: bool,
) -> tuple[Qwen4ExpForCausalLM | PipelineStage, _Destinations]:
    """A meta model's uninitialised weights allocated on `device`, and where each tensor goes."""
    for layer in model.model.layers.children():
        if layer.ple is not None and mapped_ple_tables:
            layer.ple.table = None
        elif layer.ple is not None and fp8_ple_tables:  # after .to(): it would cast fp8 too
            with torch.device("meta"):
                layer.ple.table = Fp8NgramTable(*layer.ple.table.weight.shape)
    model = model.to_empty(device=device).requires_grad_(False).eval()
    model.tie_weights()
    return model, _Destinations(model, config)


def read_quantization_config(model_dir: Path) -> QuantizationConfig | None:
    """The checkpoint's quantization_config (None for an unquantized one); errors name the field."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        return QuantizationConfig.from_config_json(raw)
    except QuantizationError as exc:
        raise CheckpointError(f"{model_dir}/config.json: {exc}") from None


class _Destinations:
    """Where each checkpoint tensor goes in the runtime model."""

    def __init__(self, model: Qwen4ExpForCausalLM, config: ModelConfig) -> None:
        self.params = dict(model.named_parameters())
        self.config = config
        self.shard_starts: dict[str, list[int]] = {}
        # checkpoint tensor -> (layer, the checkpoint module's part, tensor name in its format)
        self.parts: dict[str, tuple[torch.nn.Module, ModulePart, str]] = {}
        # checkpoint bias -> (packed bias parameter, first row, end row)
        self.biases: dict[str, tuple[torch.Tensor, int, int]] = {}
        self.shared_filled: set[tuple] = set()
        for path, module in model.named_modules():
            if not hasattr(module, "checkpoint_modules"):
                continue
            fmt = module.quant_method.format
            for part in module.checkpoint_modules(path):
                for suffix in fmt.checkpoint_tensors(part.out_features, part.in_features):
                    self.parts[f"{part.name}.{suffix}"] = (module, part, suffix)
                if getattr(module, "bias", None) is not None:
                    self.biases[f"{part.name}.bias"] = (module.bias, part.start, part.end)

    def fill(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.parts:
            self._fill_part(name, tensor, *self.parts[name])
        elif name in self.biases:
            param, start, end = self.biases[name]
            param[start:end].copy_(tensor)
        elif m := _PLE_SHARD.fullmatch(name):
            table = self.params[f"{m.group(1)}.table.weight"]
            starts = self.shard_starts.get(m.group(1))
            if starts is None:
                sizes = ple_shard_rows(table.shape[0], self.config.split_ngram_parts)
                starts = self.shard_starts[m.group(1)] = [sum(sizes[:j]) for j in range(len(sizes))]
            start = starts[int(m.group(2))]
            table[start : start + tensor.shape[0]].copy_(tensor)
        elif m := _PLE_SCALE.fullmatch(name):
            self.params[f"{m.group(1)}.table.scale"].copy_(tensor.reshape(1))
        elif m := _PLE_BUFFER.fullmatch(name):
            expected = ple_hash_buffers(self.config, self.config.ple_index(int(m.group(1))))[m.group(2)]
            if tensor.tolist() != expected:
                raise CheckpointError(f"tensor {name} is {tensor.tolist()}, but the config's hash gives {expected}")
        elif name.startswith(VISION_PREFIX):  # the tower is the model's `visual`
            self.params[name[len(PREFIX) :]].copy_(tensor)
        else:
            self.params[name].copy_(tensor)

    def _fill_part(self, name: str, tensor: torch.Tensor, module, part: ModulePart, suffix: str) -> None:
        fmt = module.quant_method.format
        try:
            pieces = fmt.convert(suffix, tensor, part.out_features, part.in_features, name)
        except QuantizationError as exc:
            raise CheckpointError(str(exc)) from None
        specs = fmt.runtime_tensors(part.out_features, part.in_features)
        for runtime_name, piece in pieces.items():
            target = module.runtime_tensor(part, runtime_name)
            out_dim = specs[runtime_name].out_dim
            if out_dim is not None:
                target.narrow(out_dim, part.start, part.out_features).copy_(piece)
                continue
            key = (id(module), runtime_name, part.expert, part.projection)
            if key in self.shared_filled and not torch.equal(target, piece.to(target.dtype)):
                raise CheckpointError(
                    f"tensor {name} differs from the {runtime_name} of the modules packed with it ({part.name} "
                    "runs as one module with them, so they must agree)"
                )
            target.copy_(piece)
            self.shared_filled.add(key)
