"""The ``agentkv`` command line: each subcommand lives in its own module, imported only when chosen.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it keeps heavy imports
(torch, transformers, litellm) inside ``run``, so ``agentkv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("agentkv.local.serve_cli", "serve an embedded model over vLLM's OpenAI-compatible API"),
    "demo": ("agentkv.demo", "run the fast/slow ReAct demo on two embedded servers"),
    "calibrate": ("agentkv.handoff.cli", "fit a cross-model KV mapper"),
    "evaluate": ("agentkv.handoff.cli", "evaluate a saved KV mapper"),
    "bench": ("agentkv.handoff.cli", "benchmarks: `agentkv bench handoff`"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        adder = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
        adder(command_parser)
        runner = getattr(module, f"run_{name}", None) or module.run
        command_parser.set_defaults(_run=runner)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
