"""The training run: corpus -> tokenizer -> token streams -> a seeded Qwen4-Exp trained under a time budget
-> two checkpoint folders (the final model, and the model at 5% of the steps), a JSON log and a loss curve.

How the time budget works (`max_minutes` covers the whole run, preparation included): after a few
calibration steps the step time is measured, and the number of steps is fixed so that training, the
evaluations and the writing end inside the budget; the learning-rate schedule (linear warmup, cosine to
10%) and the 5% checkpoint follow from that number. Should the steps run slower than measured, training
stops at the budget's end and still evaluates and writes. `max_steps` fixes the number instead.

Held-out perplexity: exp(mean next-token cross-entropy) over non-overlapping held-out windows, measured
before training, at 5% of the steps, about every 10% and at the end (all in the log; the first few points
also draw the curve).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tierlm.config import ModelConfig
from tierlm.demo_model import ENDOFTEXT, IM_END, bpe_tokenizer_json
from tierlm.model.checkpoint_layout import MTPLayout
from tierlm.model.layers.embedding import Embedding
from tierlm.model.layers.gated_deltanet import GatedDeltaNet
from tierlm.model.layers.moe import Experts
from tierlm.model.layers.norm import GatedRMSNorm, RMSNorm
from tierlm.model.layers.packed_linear import PackedLinear
from tierlm.model.layers.ple import NgramTable, PLELayer
from tierlm.model.qwen4_exp import Qwen4ExpForCausalLM
from tierlm.tools.train_demo.batched_forward import forward
from tierlm.tools.train_demo.corpus import collect_corpus, iter_windows, source_roots, token_stream
from tierlm.tools.train_demo.export import write_checkpoint
from tierlm.tools.train_demo.loss_plot import plot_losses
from tierlm.tools.train_demo.recipe import Recipe, model_config

INIT_STD = 0.02
# steps CALIBRATION_WARMUP..CALIBRATION_STEPS are timed to plan the run (the first ones pay for warm-up)
CALIBRATION_WARMUP, CALIBRATION_STEPS = 4, 14
SPEED_MARGIN = 0.93  # of the measured speed the plan counts on
WRITE_SECONDS_GUESS = 5.0  # one checkpoint's writing, before one was timed
EVALUATIONS = 10  # held-out measurements spread over the run (plus the initial, 5% and final ones)
EARLY_FRACTION = 0.05
LOG_EVERY = 10  # steps per point of the training-loss history
MAX_SKIPPED_STEPS = 50  # updates skipped for non-finite gradients before training stops (and still saves)
# projections whose output adds to the residual streams: their init is scaled down with depth
RESIDUAL_OUTPUTS = ("out_proj", "o_proj", "down_proj")


@dataclass
class RunLog:
    """What the run records (written as train_log.json)."""

    recipe: dict[str, Any]
    seed: int
    device: str
    torch_version: str
    python_version: str
    corpus: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    planned_steps: int = 0
    tokens_seen: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    heldout: list[dict[str, float]] = field(default_factory=list)  # {step, tokens, loss, perplexity}
    train_loss: list[dict[str, float]] = field(default_factory=list)  # {step, tokens, loss, mtp_loss, lr}
    early: dict[str, float] = field(default_factory=dict)  # the 5% checkpoint: step, perplexity
    final: dict[str, float] = field(default_factory=dict)
    stopped_by: str = ""
    skipped_steps: int = 0  # updates skipped for non-finite gradients


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def init_parameters(model: Qwen4ExpForCausalLM, seed: int) -> None:
    """Fresh training weights, drawn in module order from one seeded generator: projections, embeddings,
    experts and the n-gram tables N(0, 0.02) (residual outputs / sqrt(2 x layers)); Gemma norms 0 (unit
    scale); the GDN output norm 1; GDN conv N(0, 1/K), PLE conv 0 (transformers' init); GDN decay
    A_log = log U(1, 16), dt_bias 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    depth_scale = 1 / math.sqrt(2 * (model.config.num_hidden_layers + (model.mtp is not None)))

    def normal(param: torch.Tensor, std: float) -> None:
        param.copy_(torch.randn(param.shape, generator=gen) * std)

    with torch.no_grad():
        for path, module in model.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if isinstance(module, (PackedLinear, Embedding)):
                std = INIT_STD * (depth_scale if leaf in RESIDUAL_OUTPUTS else 1)
                normal(module.weight, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, Experts):
                normal(module.gate_up_proj, INIT_STD)
                normal(module.down_proj, INIT_STD * depth_scale)
            elif isinstance(module, NgramTable):
                normal(module.weight, INIT_STD)
            elif isinstance(module, RMSNorm):
                module.weight.zero_()
            elif isinstance(module, GatedRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, GatedDeltaNet):
                normal(module.conv1d.weight, module.kernel**-0.5)
                module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(1, 16, generator=gen).log())
                module.dt_bias.fill_(1.0)
            elif isinstance(module, PLELayer):
                module.conv1d.weight.zero_()


def build_model(raw_config: dict[str, Any], seed: int, device: torch.device) -> Qwen4ExpForCausalLM:
    """The recipe's model with its MTP head, fp32 weights from `init_parameters`, every weight trainable."""
    config = ModelConfig.from_dict(raw_config)
    model = Qwen4ExpForCausalLM(config, MTPLayout(config.num_mtp_layers))
    model.tie_weights()
    init_parameters(model, seed)
    model.requires_grad_(True)  # the loader freezes; the n-gram tables are built frozen
    return model.to(device)


def parameter_counts(model: Qwen4ExpForCausalLM) -> dict[str, int]:
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    c = model.config
    inactive = experts * (1 - c.num_experts_per_tok / c.num_experts)
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, NgramTable))
    return {"total": total, "routed_experts": experts, "ple_tables": tables, "active_per_token": int(total - inactive)}


class Batches:
    """Training windows of seq_len + 1 tokens drawn from the stream on the device (seeded): a share of
    them start at a file's beginning (what a prompt looks like), the rest anywhere."""

    def __init__(self, stream: np.ndarray, recipe: Recipe, separator: int, seed: int, device: torch.device) -> None:
        self.length = recipe.seq_len + 1
        if len(stream) <= self.length:
            raise RuntimeError(f"the training stream has {len(stream)} tokens, fewer than one window ({self.length})")
        self.stream = torch.from_numpy(stream.astype(np.int64)).to(device)
        self.doc_starts = torch.from_numpy(np.flatnonzero(stream == separator) + 1).to(device)
        self.doc_starts = self.doc_starts[self.doc_starts < len(stream) - self.length]
        self.batch, self.fraction = recipe.batch_size, recipe.doc_start_fraction
        self.offsets = torch.arange(self.length, device=device)
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def next(self) -> torch.Tensor:
        """[batch, seq_len + 1] token ids."""
        device = self.stream.device
        anywhere = torch.randint(0, len(self.stream) - self.length, (self.batch,), generator=self.gen, device=device)
        if len(self.doc_starts):
            pick = torch.randint(0, len(self.doc_starts), (self.batch,), generator=self.gen, device=device)
            at_start = torch.rand(self.batch, generator=self.gen, device=device) < self.fraction
            anywhere = torch.where(at_start, self.doc_starts[pick], anywhere)
        return self.stream[anywhere[:, None] + self.offsets]


def heldout_loss(
    model: Qwen4ExpForCausalLM, windows: torch.Tensor, batch_size: int, autocast: bool
) -> float:
    """Mean next-token cross-entropy (nats) over held-out windows [W, seq_len + 1]."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast(windows.device.type, torch.bfloat16, enabled=autocast):
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size]
            logits = forward(model, chunk[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
            total += loss.item()
            count += chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


def heldout_windows(stream: np.ndarray, seq_len: int, max_tokens: int, device: torch.device) -> torch.Tensor:
    """Non-overlapping held-out windows of seq_len + 1 tokens, up to max_tokens in all: [W, seq_len + 1]."""
    count = max(1, max_tokens // (seq_len + 1))
    windows = [w for _, w in zip(range(count), iter_windows(stream, seq_len + 1))]
    if not windows:
        raise RuntimeError(f"the held-out stream has {len(stream)} tokens, fewer than one window ({seq_len + 1})")
    return torch.from_numpy(np.stack(windows).astype(np.int64)).to(device)


def learning_rate(step: int, total: int, recipe: Recipe) -> float:
    """Linear warmup, then cosine from the peak to 10% of it at `total` steps."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: Qwen4ExpForCausalLM, recipe: Recipe, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (and the expert stacks), none on norms, biases, gates' vectors."""
    unique = {id(p): p for p in model.parameters()}.values()
    decay = [p for p in unique if p.dim() >= 2]
    rest = [p for p in unique if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def run_training(
    out_dir: Path, early_dir: Path, recipe: Recipe, seed: int, device: torch.device, max_minutes: float,
    max_steps: int | None = None, log=print,
) -> RunLog:
    """The whole run (see the module docstring). Writes `out_dir` (final model, train_log.json, loss.png)
    and `early_dir` (the model at 5% of the steps); returns the log."""
    start = time.monotonic()
    deadline = start + max_minutes * 60
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    autocast = device.type == "cuda"
    run = RunLog(
        recipe=asdict(recipe), seed=seed, device=device_name(device), torch_version=torch.__version__,
        python_version=sys.version.split()[0],
    )

    roots = source_roots(recipe.stdlib_only)
    corpus = collect_corpus(recipe.max_train_bytes, recipe.max_heldout_bytes, roots=roots)
    run.seconds["corpus"] = time.monotonic() - start
    log(f"corpus: {len(corpus.train)} training files ({corpus.train_bytes / 1e6:.1f} MB), "
        f"{len(corpus.heldout)} held out ({corpus.heldout_bytes / 1e6:.1f} MB)")
    tokenizer_texts = _prefix_by_bytes(corpus.train, recipe.tokenizer_bytes)
    tokenizer_json = bpe_tokenizer_json(tokenizer_texts, len(tokenizer_texts), recipe.vocab_size)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    separator, eos = tokenizer.token_to_id(ENDOFTEXT), tokenizer.token_to_id(IM_END)
    train_stream = token_stream(tokenizer, corpus.train, separator)
    heldout_stream = token_stream(tokenizer, corpus.heldout, separator)
    run.seconds["tokenizer"] = time.monotonic() - start - run.seconds["corpus"]
    run.corpus = {
        "train_files": len(corpus.train), "train_bytes": corpus.train_bytes, "train_tokens": len(train_stream),
        "heldout_files": len(corpus.heldout), "heldout_bytes": corpus.heldout_bytes,
        "heldout_tokens": len(heldout_stream), "tokenizer_bytes": sum(len(t.encode()) for t in tokenizer_texts),
        "vocab_size": tokenizer.get_vocab_size(), "roots": [str(root) for root in roots],
        "heldout_paths": corpus.heldout_paths,
    }
    log(f"tokens: {len(train_stream):,} training, {len(heldout_stream):,} held out "
        f"({corpus.train_bytes / max(1, len(train_stream)):.2f} bytes per token)")

    raw_config = model_config(recipe, tokenizer.get_vocab_size(), eos)
    model = build_model(raw_config, seed, device)
    run.model = {"parameters": parameter_counts(model), "config": raw_config}
    log(f"model: {run.model['parameters']}")
    optimizer = optimizer_for(model, recipe, device)
    batches = Batches(train_stream, recipe, separator, seed, device)
    evaluation = heldout_windows(heldout_stream, recipe.seq_len, recipe.eval_tokens, device)
    tokens_per_step = recipe.batch_size * recipe.seq_len

    def evaluate(step: int) -> float:
        began = time.monotonic()
        loss = heldout_loss(model, evaluation, recipe.batch_size, autocast)
        run.heldout.append({"step": step, "tokens": step * tokens_per_step, "loss": loss, "perplexity": math.exp(loss)})
        log(f"step {step}: held-out loss {loss:.3f}, perplexity {math.exp(loss):.1f}")
        return time.monotonic() - began

    eval_seconds = evaluate(0)  # the first forward's warm-up included: an upper bound
    eval_in_steps = evaluation.numel() / tokens_per_step / 2  # a forward costs about a third of a step
    run.seconds["prepare"] = time.monotonic() - start
    plan = _Plan(max_steps)
    train_began = time.monotonic()
    write_seconds = WRITE_SECONDS_GUESS
    step, window, window_steps = 0, torch.zeros(3, device=device), 0  # summed losses: main, MTP, indexers'
    model.train()
    while True:
        if plan.total is not None and step >= plan.total:
            run.stopped_by = "steps"
            break
        reserve = eval_seconds * 2 + write_seconds * 2 + 5
        if time.monotonic() + reserve > deadline:
            run.stopped_by = "time"
            break
        lr = learning_rate(step, plan.total or 10**9, recipe)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = batches.next()
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            out = forward(model, ids[:, :-1], with_draft=recipe.mtp_loss_weight > 0,
                          train_indexers=recipe.indexer_loss_weight > 0)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten())
            mtp_loss = indexer_loss = loss.new_zeros(())
            if out.draft_logits is not None:
                mtp_loss = F.cross_entropy(out.draft_logits.float().flatten(0, 1), ids[:, 2:].flatten())
            if out.indexer_loss is not None:
                indexer_loss = out.indexer_loss
        optimizer.zero_grad(set_to_none=True)
        (loss + recipe.mtp_loss_weight * mtp_loss + recipe.indexer_loss_weight * indexer_loss).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):  # a bad batch must not end a one-shot run: skip its update
            run.skipped_steps += 1
            if run.skipped_steps > MAX_SKIPPED_STEPS:
                run.stopped_by = "non-finite gradients"
                break
            continue
        optimizer.step()
        step += 1
        window += torch.stack([loss, mtp_loss, indexer_loss]).detach()
        window_steps += 1
        if step % LOG_EVERY == 0 or step == plan.total:
            means = (window / window_steps).tolist()
            run.train_loss.append({"step": step, "tokens": step * tokens_per_step, "loss": means[0],
                                   "mtp_loss": means[1], "indexer_kl": means[2], "lr": lr})
            window, window_steps = torch.zeros(3, device=device), 0
        if plan.total is None:
            if device.type == "cuda":
                torch.cuda.synchronize()  # time whole steps
            plan.observe(step, time.monotonic(), deadline, eval_in_steps, write_seconds, log)
            continue
        if not run.early and step >= plan.early_step:
            eval_seconds = evaluate(step)
            run.early = {"step": step, "perplexity": run.heldout[-1]["perplexity"]}
            began = time.monotonic()
            write_checkpoint(model, raw_config, tokenizer_json, early_dir)
            write_seconds = time.monotonic() - began
        elif step in plan.eval_steps and step != plan.total:
            eval_seconds = evaluate(step)
    run.steps, run.planned_steps, run.tokens_seen = step, plan.total or step, step * tokens_per_step
    run.seconds["train"] = time.monotonic() - train_began
    if not run.early:  # stopped before the 5% step: the early checkpoint is the last one
        run.early = {"step": step, "perplexity": float("nan")}
    evaluate(step)
    run.final = {"step": step, "perplexity": run.heldout[-1]["perplexity"]}
    write_checkpoint(model, raw_config, tokenizer_json, out_dir)
    if not (early_dir / "config.json").exists():
        write_checkpoint(model, raw_config, tokenizer_json, early_dir)
    run.seconds["total"] = time.monotonic() - start
    (out_dir / "train_log.json").write_text(json.dumps(asdict(run), indent=1) + "\n")
    plot_losses(run.train_loss, run.heldout, out_dir / "loss.png", f"{run.model['parameters']['total'] / 1e6:.1f} M "
                f"parameters, {run.tokens_seen / 1e6:.1f} M tokens, {run.device}")
    log(f"done: {step} steps, {run.tokens_seen:,} tokens in {run.seconds['train']:.0f} s of training "
        f"({run.seconds['total']:.0f} s in all); held-out perplexity {run.heldout[0]['perplexity']:.1f} at start, "
        f"{run.early['perplexity']:.1f} at step {run.early['step']}, {run.final['perplexity']:.1f} at the end")
    return run


class _Plan:
    """The number of steps (given, or fixed from the calibration steps' speed), the 5% step and the
    evaluation steps that follow from it."""

    def __init__(self, total: int | None) -> None:
        self.total: int | None = None
        self.early_step = -1
        self.eval_steps: set[int] = set()
        self._timed_from: tuple[int, float] | None = None
        if total is not None:
            self._set(total)

    def _set(self, total: int) -> None:
        self.total = max(1, total)
        self.early_step = max(1, round(EARLY_FRACTION * self.total))
        self.eval_steps = {round(self.total * k / EVALUATIONS) for k in range(1, EVALUATIONS)}

    def observe(self, step: int, now: float, deadline: float, eval_in_steps: float, write_seconds: float,
                log) -> None:
        """Called after every step while the total is open: times steps CALIBRATION_WARMUP..CALIBRATION_STEPS,
        then fixes the total so that the remaining steps, the evaluations (each costing `eval_in_steps`
        steps) and the writes fit the budget."""
        if step == CALIBRATION_WARMUP:
            self._timed_from = (step, now)
        if step < CALIBRATION_STEPS or self._timed_from is None:
            return
        first, began = self._timed_from
        step_seconds = (now - began) / (step - first)
        evaluations = EVALUATIONS + 2  # the spread ones, the 5% one and the final one
        left = deadline - now - evaluations * eval_in_steps * step_seconds - 2 * write_seconds
        self._set(step + max(0, int(SPEED_MARGIN * left / step_seconds)))
        log(f"{step_seconds * 1000:.0f} ms per step: {self.total} steps fit the budget")


def _prefix_by_bytes(texts: list[str], budget: int) -> list[str]:
    chosen, size = [], 0
    for text in texts:
        if size >= budget:
            break
        chosen.append(text)
        size += len(text.encode())
    return chosen
