"""`tierlm draft-vocab MODEL --text FILE [FILE ...] --size N --out MAP.json`: a reduced draft vocabulary
for MTP speculative decoding (FR-Spec; SGLang's speculative token map).

The draft head's lm_head is vocabulary-wide: at the real width it is 1.27 GB in bf16, three quarters of
what one draft pass reads. Drafting from the N tokens that occur most in text like the traffic costs
N / vocab of that, and verification, which reads the target's full logits, stays exact (a draft is only a
proposal; a token outside the map is never drafted, so it is never accepted early). The map: the model's
stop tokens and special tokens first, then the text's most frequent tokens (ties by lower id), N in all,
as a JSON list of ids. Serve with it:

    tierlm serve MODEL --speculative-config '{"method": "mtp", "num_speculative_tokens": 1,
                                              "speculative_token_map": "MAP.json"}'

It prints how much of the text's tokens the map covers (the acceptance it can keep, at best).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tierlm.cli import CliError

READ_CHARS = 1 << 20  # text tokenized per call


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("draft-vocab", help="a reduced draft vocabulary (speculative token map) from text",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model directory (its tokenizer counts the text)")
    parser.add_argument("--text", nargs="+", required=True, metavar="FILE", help="UTF-8 text like the traffic")
    parser.add_argument("--size", type=int, required=True, help="tokens in the map (e.g. 32768)")
    parser.add_argument("--out", required=True, help="the map to write (a JSON list of token ids)")
    parser.set_defaults(func=run)


def token_counts(tokenizer, paths: list[str], vocab_size: int) -> np.ndarray:
    """How often each id occurs in the files' text [vocab_size] (tokenized a block of lines at a time)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        with open(path, encoding="utf-8") as f:
            while block := f.read(READ_CHARS) + f.readline():
                ids = np.asarray(tokenizer.encode(block, add_special_tokens=False), dtype=np.int64)
                counts += np.bincount(ids[ids < vocab_size], minlength=vocab_size)
    return counts


def draft_vocab(counts: np.ndarray, size: int, always: list[int]) -> list[int]:
    """`always` (in order, those inside the vocabulary), then the most frequent ids (ties by lower id):
    `size` distinct ids in all, sorted."""
    if size < 1:
        raise ValueError(f"--size must be at least 1, got {size}")
    chosen = list(dict.fromkeys(i for i in always if 0 <= i < len(counts)))[:size]
    taken = set(chosen)
    for token in np.argsort(-counts, kind="stable"):
        if len(chosen) == size:
            break
        if int(token) not in taken:
            chosen.append(int(token))
    return sorted(chosen)


def run(args: argparse.Namespace) -> int:
    from tierlm.config import ConfigError, ModelConfig
    from tierlm.model.loader import ModelNotFoundError, resolve_model_path
    from tierlm.tokenizer import Tokenizer

    try:
        model_dir = resolve_model_path(args.model)
        vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
        tokenizer = Tokenizer.from_pretrained(model_dir)
        if not 1 <= args.size <= vocab_size:
            raise ValueError(f"--size must be between 1 and the vocabulary's {vocab_size:,}, got {args.size}")
        counts = token_counts(tokenizer, args.text, vocab_size)
    except (ConfigError, ModelNotFoundError, ValueError, OSError) as exc:
        raise CliError(str(exc)) from None
    total = int(counts.sum())
    if total == 0:
        raise CliError(f"no tokens in {', '.join(args.text)}")
    ids = draft_vocab(counts, args.size, [*tokenizer.eos_token_ids, *sorted(tokenizer.special_token_ids)])
    Path(args.out).write_text(json.dumps(ids))
    covered = int(counts[ids].sum())
    print(f"{args.out}: {len(ids):,} of {vocab_size:,} token ids; they cover {covered:,} of the text's {total:,} "
          f"tokens ({100 * covered / total:.2f}%)")
    return 0
