"""``agentkv report LEDGER --out PNG``: a conversation's life, drawn from a ledger file (``Session.write_ledger``) or
from a JSON-lines event log of agentkv's events (``--session`` picks the conversation)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ledger", help="a ledger file written by Session.write_ledger (JSON lines)")
    parser.add_argument("--out", default="agentkv-report.png", help="the PNG to write (default agentkv-report.png)")
    parser.add_argument("--title", default=None, help="the picture's title (default: the ledger's file name)")
    parser.add_argument("--session", default=None, help="an event log's conversation (default: the longest)")
    parser.add_argument("--warm-threshold", type=float, default=0.6,
                        help="the warm-ahead line, for an event log (a ledger file records its own)")


def run(args: argparse.Namespace) -> int:
    from agentkv.report.ledger import life_of, read_ledger
    from agentkv.report.plot import draw

    try:
        header, rows = read_ledger(args.ledger, session=args.session, warm_threshold=args.warm_threshold)
    except (OSError, ValueError) as exc:
        print(f"agentkv report: {exc}", file=sys.stderr)
        return 2
    life = life_of(header, rows)
    path = draw(life, args.out, title=args.title or f"{args.ledger}: {len(rows)} turns")
    escalation = life.escalation_turn
    print(f"{len(rows)} turns, warm at {life.warm_turns or 'no turn'}, escalation at "
          f"{escalation if escalation is not None else 'no turn'}: {path}")
    return 0
