"""`tierlm eval kld BASE QUANT --text FILE`: how far a (quantized) checkpoint's next-token distributions
are from a base checkpoint's over a text: token-level KL(BASE || QUANT) in nats (mean, p99, max) and the
share of positions where both pick the same most likely token.

The distributions are the full ones, from the model's forward: the engine's prompt logprobs (vLLM's
interface: `SamplingParams(prompt_logprobs=...)`) return at most the top 20 tokens per position, which
would truncate the KL. Each checkpoint is loaded in turn (`load_model`, as the engine loads it) and run
over the text's tokens in chunked prefill through one request's cache, exactly as the engine computes
prompt positions; the base's log-probabilities are kept (fp32, [T, vocab]) while the second model runs.
Both use BASE's tokenizer, so the token ids are the same.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from tierlm.cli import CliError


@dataclass(frozen=True)
class KldReport:
    tokens: int
    mean: float
    p99: float
    max: float
    top1_agreement: float

    def lines(self) -> list[str]:
        return [
            f"tokens: {self.tokens}",
            f"KL(base || quant) nats: mean {self.mean:.5f}  p99 {self.p99:.5f}  max {self.max:.5f}",
            f"top-1 agreement: {100 * self.top1_agreement:.2f}%",
        ]


def prompt_logprobs(model_dir, ids: list[int], dtype: str = "auto", device: str | None = None,
                    chunk: int = 256):
    """Log-probabilities [T, vocab] (fp32, on the CPU) of the next token at every position of `ids`."""
    import torch

    from tierlm.model.forward_batch import ForwardBatch
    from tierlm.model.loader import load_model
    from tierlm.model.model_cache import ModelCache

    model, config = load_model(model_dir, dtype=dtype, device=device)
    device = next(model.parameters()).device
    ratio = config.indexer_compress_ratio or 1
    block_size = ratio * math.ceil(16 / ratio)
    blocks = math.ceil(len(ids) / block_size) + 1
    cache = ModelCache(config, 1, blocks, block_size, next(model.parameters()).dtype, device)
    cache.reset_slot(0)
    table, out = list(range(blocks)), []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        batch = ForwardBatch.build([piece], [start], [0], [table], block_size, device=device, logits="all")
        out.append(torch.log_softmax(model(batch, cache).float(), dim=-1).cpu())
    del model, cache
    return torch.cat(out), config.vocab_size


def kl_divergence(base_logprobs, quant_logprobs) -> KldReport:
    """Per-position KL(base || quant) = sum_v p_base (log p_base - log p_quant), and top-1 agreement."""
    import torch

    kl = (base_logprobs.exp() * (base_logprobs - quant_logprobs)).sum(dim=-1).clamp_min(0)
    agree = (base_logprobs.argmax(dim=-1) == quant_logprobs.argmax(dim=-1)).float().mean()
    return KldReport(
        tokens=kl.numel(), mean=kl.mean().item(), p99=torch.quantile(kl, 0.99).item(), max=kl.max().item(),
        top1_agreement=agree.item(),
    )


def evaluate_kld(base, quant, text: str, max_tokens: int = 2048, dtype: str = "auto",
                 device: str | None = None) -> KldReport:
    from tierlm.model.loader import resolve_model_path
    from tierlm.tokenizer import Tokenizer

    base, quant = resolve_model_path(base), resolve_model_path(quant)
    ids = Tokenizer.from_pretrained(base).encode(text)[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); KL needs at least 2")
    base_logprobs, base_vocab = prompt_logprobs(base, ids, dtype, device)
    quant_logprobs, quant_vocab = prompt_logprobs(quant, ids, dtype, device)
    if base_vocab != quant_vocab:
        raise ValueError(f"the models' vocabularies differ ({base_vocab} vs {quant_vocab} tokens)")
    return kl_divergence(base_logprobs, quant_logprobs)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="compare checkpoints (KL divergence of next-token distributions)")
    actions = parser.add_subparsers(dest="eval_command", metavar="ACTION", required=True)
    kld = actions.add_parser(
        "kld",
        help="token-level KL(BASE || QUANT) over a text: mean, p99, max, top-1 agreement",
        description="Run both checkpoints over the tokens of a text (BASE's tokenizer) and report the KL "
        "divergence of QUANT's next-token distributions from BASE's, in nats.",
    )
    kld.add_argument("base", metavar="BASE", help="the reference checkpoint folder")
    kld.add_argument("quant", metavar="QUANT", help="the checkpoint to compare (e.g. a tierlm quantize output)")
    kld.add_argument("--text", required=True, type=Path, metavar="FILE", help="a UTF-8 text file")
    kld.add_argument("--max-tokens", type=int, default=2048, help="use the text's first N tokens")
    kld.add_argument("--dtype", default="auto", help="dtype both models run in (auto: each checkpoint's)")
    kld.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    kld.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tierlm.config import ConfigError
    from tierlm.model.loader import CheckpointError, ModelNotFoundError

    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--text {args.text}: {exc}") from None
    if args.max_tokens < 2:
        raise CliError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    try:
        report = evaluate_kld(args.base, args.quant, text, args.max_tokens, args.dtype, args.device)
    except (ConfigError, CheckpointError, ModelNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    print(f"base: {args.base}\nquant: {args.quant}")
    for line in report.lines():
        print(line)
    return 0
