"""`tierlm train-demo`: train the embedded default model, a small Qwen4-Exp code model, from scratch.

Everything it reads is on the machine already: Python source files of this interpreter's standard library
and site-packages (`corpus`), a BPE tokenizer learnt from them, and tierlm's own model trained through a
batched, differentiable forward of the same modules (`batched_forward`), under a time budget (`train`).
It writes two checkpoint folders that `tierlm generate` / `tierlm serve` load as they are (`export`): the
final model, with train_log.json and loss.png beside it, and the model at 5% of the steps (the baseline of
`bench/demo_perplexity.py`). The architectures and training settings live in `recipe`.

The committed default (`models/default_model`) comes from one run on an H200 (16 cores, no network):
    python3 -m tierlm train-demo /tmp/run/code-tiny --size code --device cuda --max-minutes 6.8
    python3 bench/demo_perplexity.py --final /tmp/run/code-tiny --early /tmp/run/code-tiny-5pct --device cuda
(train_log.json beside the weights records the corpus, tokens seen, wall time and device). `--size smoke`
runs the same pipeline at toy sizes on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _run(args: argparse.Namespace) -> int:
    import torch

    from tierlm.cli import CliError
    from tierlm.tools.train_demo.recipe import RECIPES
    from tierlm.tools.train_demo.train import run_training

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is visible to torch here")
    recipe = RECIPES[args.size].with_overrides(
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        max_train_bytes=None if args.max_train_mb is None else int(args.max_train_mb * 1e6),
        eval_tokens=args.eval_tokens,
    )
    if recipe.seq_len <= recipe.text_config["indexer_budget"]:
        raise CliError(f"--seq-len {recipe.seq_len} must exceed the QSA budget "
                       f"({recipe.text_config['indexer_budget']}) so that the indexer's selection trains")
    early = args.early_out or args.out_dir.with_name(args.out_dir.name + "-5pct")
    for folder in (args.out_dir, early):
        if (folder / "config.json").exists() and not args.force:
            raise CliError(f"{folder} already holds a checkpoint; pass --force to replace it")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run_training(args.out_dir, early, recipe, args.seed, device, args.max_minutes, args.max_steps,
                 log=lambda line: print(f"train-demo: {line}", file=sys.stderr, flush=True))
    return 0


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from tierlm.tools.train_demo.recipe import RECIPES

    parser = subparsers.add_parser(
        "train-demo",
        help="train the small default Qwen4-Exp code model on this machine's Python sources",
        description="Train a small Qwen4-Exp (GDN, QSA, MoE, hyper-connections, PLE, an MTP head) and its BPE "
        "tokenizer on the Python sources of this interpreter's standard library and site-packages; write "
        "the final checkpoint (with train_log.json and loss.png) and the one at 5%% of the steps.",
    )
    parser.add_argument("out_dir", metavar="DIR", type=Path, help="folder for the final checkpoint")
    parser.add_argument("--early-out", type=Path, default=None, metavar="DIR",
                        help="folder for the checkpoint at 5%% of the steps (default: DIR-5pct)")
    parser.add_argument("--size", choices=sorted(RECIPES), default="code",
                        help="code: the default model (a GPU, minutes); smoke: toy sizes (a CPU, seconds)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when there is one")
    parser.add_argument("--max-minutes", type=_positive(float), default=7.0,
                        help="wall-clock budget of the whole run, preparation and writing included")
    parser.add_argument("--max-steps", type=_positive(int), default=None,
                        help="train exactly this many steps (default: as many as the budget allows)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the windows drawn")
    parser.add_argument("--batch-size", type=_positive(int), default=None, help="windows per step (recipe's)")
    parser.add_argument("--seq-len", type=_positive(int), default=None, help="tokens per window (recipe's)")
    parser.add_argument("--lr", type=_positive(float), default=None, help="peak learning rate (recipe's)")
    parser.add_argument("--max-train-mb", type=_positive(float), default=None,
                        help="cap on the training files' size in MB (recipe's)")
    parser.add_argument("--eval-tokens", type=_positive(int), default=None,
                        help="held-out tokens per perplexity measurement (recipe's)")
    parser.add_argument("--force", action="store_true", help="replace checkpoints already in the folders")
    parser.set_defaults(func=_run)
