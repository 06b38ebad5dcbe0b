"""The `tierlm` command line: one subcommand per tool.

Each subcommand lives in its own module, which exposes `add_parser(subparsers)` (registering its
arguments and a `func`) so this file stays a table of contents. Imports are lazy: `tierlm bench`
must not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that owns it
SUBCOMMANDS = {
    "serve": "tierlm.server.cli",
    "generate": "tierlm.entrypoints.generate_cli",
    "demo-model": "tierlm.demo_model",
    "bench": "tierlm.tools.bench.cli",
    "plan": "tierlm.tools.plan",
    "ple": "tierlm.tools.ple_export",
    "probe-drive": "tierlm.tools.probe_drive",
    "simulate-cache": "tierlm.tools.simulate_cache",
    "quantize": "tierlm.tools.quantize",
    "eval": "tierlm.tools.eval_kld",
    "train-demo": "tierlm.tools.train_demo",
    "draft-vocab": "tierlm.tools.draft_vocab",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierlm", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, module_name in SUBCOMMANDS.items():
        if wanted in SUBCOMMANDS and name != wanted:
            subparsers.add_parser(name)  # listed in --help, not imported
            continue
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2, no traceback."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"tierlm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m tierlm.cli` runs this file as __main__, a second copy of the module: the subcommands raise
    # tierlm.cli's CliError, which this copy's main would not catch, so run the imported module's main
    sys.exit(importlib.import_module("tierlm.cli").main())
