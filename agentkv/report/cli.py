"""``agentkv report LEDGER --out PNG``: a conversation's life, drawn from a ledger file (``Session.write_ledger``) or
from a JSON-lines event log of agentkv's events (``--session`` picks the conversation).

Whatever it refuses ends in one line on stderr and exit status 2: ``FILE line N: why`` for the input, ``--out …: why``
for the picture's path; the line it prints on success names the path written."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

__all__ = ["DEFAULT_OUT", "add_arguments", "out_path", "run"]

DEFAULT_OUT = "agentkv-report.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ledger", help="a ledger file written by Session.write_ledger (JSON lines)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"the picture to write: .png (or .svg, .pdf, .jpg, .webp, .eps; default {DEFAULT_OUT}; a "
                             f"folder gets {DEFAULT_OUT} inside it, a name without an extension gets .png)")
    parser.add_argument("--title", default=None, help="the picture's title (default: the ledger's file name)")
    parser.add_argument("--session", default=None, help="an event log's conversation (default: the longest)")
    parser.add_argument("--warm-threshold", type=_fraction, default=0.6,
                        help="the warm-ahead line, for an event log (a ledger file records its own)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction of the window (above 0, at most 1)")
    return value


def out_path(raw: str) -> Path:
    """The file ``--out raw`` names: a folder gets :data:`DEFAULT_OUT` inside it, a name without an extension gets
    .png; :class:`ValueError` for "", "-", another extension, or a parent that is not a folder."""
    if raw == "-":
        raise ValueError("--out -: the picture is not written to standard output; name its file")
    if not raw:
        raise ValueError("--out '': empty; name the picture's file")
    path = Path(raw)
    if path.is_dir():
        path = path / DEFAULT_OUT
    elif not path.suffix:
        path = path.with_name(path.name + ".png")
    from agentkv.report.plot import picture_format

    try:
        picture_format(path)
    except ValueError as exc:
        raise ValueError(f"--out {raw}: {exc}") from None
    folder = next(parent for parent in path.parents if parent.exists())
    if not folder.is_dir():
        raise ValueError(f"--out {raw}: {folder} is a file, not a folder")
    return path


def run(args: argparse.Namespace) -> int:
    from agentkv.report.ledger import life_of, read_ledger
    from agentkv.report.plot import draw

    try:
        out = out_path(args.out)
        header, rows = read_ledger(args.ledger, session=args.session, warm_threshold=args.warm_threshold)
    except (OSError, ValueError) as exc:
        return _refuse(str(exc))
    life = life_of(header, rows)
    try:
        path = draw(life, out, title=args.title or f"{args.ledger}: {len(rows)} turns")
    except OSError as exc:
        return _refuse(f"--out {out}: not written ({exc.strerror or exc})")
    escalation = life.escalation_turn
    print(f"{len(rows)} turns, warm at {_some(life.warm_turns)}, escalation at "
          f"{escalation if escalation is not None else 'no turn'}: {path}")
    return 0


def _refuse(why: str) -> int:
    print(f"agentkv report: {why}", file=sys.stderr)
    return 2


def _some(turns: list[int], shown: int = 5) -> str:
    if not turns:
        return "no turn"
    return f"{turns[:shown]}" + (f" and {len(turns) - shown} more" if len(turns) > shown else "")
