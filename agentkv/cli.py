"""The ``agentkv`` command line: each subcommand lives in its own module, imported only when chosen.

A subcommand module exposes ``add_<name>_arguments(parser)``/``run_<name>(args)`` (or plain
``add_arguments``/``run``); it keeps heavy imports (torch, transformers, litellm) inside the run
function, so ``agentkv --help`` stays fast and one subcommand's import cannot break another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("agentkv.embedded.server.serve_cli", "serve an embedded model over vLLM's OpenAI-compatible API"),
    "demo": ("agentkv.demo", "run the fast/slow ReAct demo on two embedded servers"),
    "calibrate": ("agentkv.handoff.offline.cli", "fit a cross-model KV mapper"),
    "evaluate": ("agentkv.handoff.offline.cli", "evaluate a saved KV mapper"),
    "bench": ("agentkv.handoff.offline.cli", "benchmarks: `agentkv bench handoff`"),
    "train-family": ("agentkv.embedded.family.cli", "train a small/large model family on the Python stdlib (CPU)"),
    "gateway": ("agentkv.gateway.cli", "an OpenAI-compatible gateway routing between a fast and a slow backend"),
    "report": ("agentkv.report.cli", "draw a conversation's life from its ledger (Session.write_ledger) as a PNG"),
}


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``chosen``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(prog="agentkv", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            adder = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
            adder(command_parser)
            command_parser.set_defaults(_run=getattr(module, f"run_{name}", None) or module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(chosen if chosen in COMMANDS else None).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
