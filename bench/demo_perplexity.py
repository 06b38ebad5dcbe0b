"""Held-out per-token perplexity of the trained demo model against its own checkpoint at 5% of the steps.

Both checkpoints are loaded by tierlm as served (`load_model`, their own dtype) and scored on the same
held-out Python files: the paths the run held out (train_log.json beside the final model), read from this
machine's standard library and site-packages, tokenized with the model's tokenizer, cut into windows of the
training length. Perplexity = exp(mean next-token cross-entropy), through the training forward, whose
logits equal the engine's prefill (tests/test_train_demo.py). The issue's target: final <= 0.5 x early.

    python bench/demo_perplexity.py --final /tmp/run/code-tiny --early /tmp/run/code-tiny-5pct --device cuda

Results go to bench/results/demo_perplexity_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

from tierlm.demo_model import ENDOFTEXT
from tierlm.model.loader import load_model
from tierlm.tools.train_demo.corpus import read_files, source_roots, token_stream
from tierlm.tools.train_demo.train import device_name, heldout_loss, heldout_windows

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.5


def perplexity(model_dir: Path, texts: list[str], seq_len: int, tokens: int, batch: int, device: torch.device) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stream = token_stream(tokenizer, texts, tokenizer.token_to_id(ENDOFTEXT))
    windows = heldout_windows(stream, seq_len, tokens, device)
    model, _ = load_model(model_dir, device=device)
    loss = heldout_loss(model, windows, batch, autocast=False)
    return {"model": str(model_dir), "tokens": int(windows[:, 1:].numel()), "loss": loss, "perplexity": math.exp(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--final", type=Path, default=ROOT / "tierlm" / "default_model", help="the trained model")
    parser.add_argument("--early", type=Path, required=True, help="its checkpoint at 5%% of the steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="held-out tokens to score (default: the run's)")
    parser.add_argument("--batch", type=int, default=16, help="windows per forward")
    args = parser.parse_args()
    log_path = args.final / "train_log.json"
    if not log_path.exists():
        print(f"{log_path} is missing: --final must be a folder `tierlm train-demo` wrote", file=sys.stderr)
        return 2
    run = json.loads(log_path.read_text())
    stdlib_only = run["recipe"]["stdlib_only"]
    texts, found = read_files(run["corpus"]["heldout_paths"], source_roots(stdlib_only))
    if not texts:
        print("none of the run's held-out files exist on this machine", file=sys.stderr)
        return 2
    seq_len, tokens = run["recipe"]["seq_len"], args.tokens or run["recipe"]["eval_tokens"]
    device = torch.device(args.device)
    rows = {name: perplexity(folder, texts, seq_len, tokens, args.batch, device)
            for name, folder in (("early", args.early), ("final", args.final))}
    ratio = rows["final"]["perplexity"] / rows["early"]["perplexity"]
    print(f"held-out: {len(found)} of the run's {len(run['corpus']['heldout_paths'])} files, "
          f"{rows['final']['tokens']:,} tokens in windows of {seq_len}")
    print(f"{'checkpoint':>12}{'step':>8}{'perplexity':>14}")
    for name in ("early", "final"):
        print(f"{name:>12}{run[name]['step']:>8}{rows[name]['perplexity']:>14.2f}")
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"final / early = {ratio:.3f} ({verdict} the target <= {TARGET_RATIO})")
    result = {"device": device_name(device), "files": len(found), "seq_len": seq_len, **rows, "ratio": ratio,
              "steps": {"early": run["early"]["step"], "final": run["final"]["step"]}}
    slug = re.sub(r"[^a-z0-9_]+", "-", device_name(device).lower()).strip("-")
    out = ROOT / "bench" / "results" / f"demo_perplexity_{slug}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
