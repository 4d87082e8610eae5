"""Time ``parse_overflow`` on adversarial error texts at doubling sizes, side by side.

A linear parser takes about twice as long when the text doubles (ratio ~2); a quadratic one about
four times. Also times the case that used to raise: a number of more than 4,300 digits.

    python benchmarks/overflow_parse.py
"""

from __future__ import annotations

import time
from typing import Callable

from agentkv import overflow
from agentkv.overflow import parse_overflow

DECODER = "The decoder prompt (length 17000) plus the number of requested output tokens "
V3_HEAD = "This model's maximum context length is 16384 tokens. However, your request has "
V1_HEAD = "This model's maximum context length is 16384 tokens. However, you requested "

INPUTS: dict[str, Callable[[int], str]] = {
    "repeated decoder wording": lambda size: (DECODER * (size // len(DECODER) + 1))[:size],
    "repeated window wording": lambda size: (V1_HEAD * (size // len(V1_HEAD) + 1))[:size],
    "one long digit run": lambda size: V3_HEAD + "9" * size + " input tokens",
    "digits and commas": lambda size: "max_tokens=" + "1," * (size // 2) + " cannot be greater",
}
SIZES = (48_000, 96_000, 192_000, 385_000)


def best_of(text: str, repeats: int = 3) -> float:
    """The fastest of ``repeats`` parses, in seconds (an exception counts as a parse and is reported)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            parse_overflow(text)
        except ValueError:
            pass  # reported separately by outcome()
        times.append(time.perf_counter() - start)
    return min(times)


def outcome(text: str) -> str:
    """What the parser returns for ``text`` (or the exception it raises)."""
    try:
        found = parse_overflow(text)
    except Exception as error:  # noqa: BLE001 - the benchmark reports what escaped
        return f"raises {type(error).__name__}"
    return "None" if found is None else found.variant


def table() -> None:
    """One row per adversarial input: time at each size and the doubling ratios."""
    for name, make in INPUTS.items():
        figures = [best_of(make(size)) for size in SIZES]
        ratios = " ".join(f"{b / a:4.1f}x" for a, b in zip(figures, figures[1:]))
        cells = " ".join(f"{s // 1000:>4} KB {t * 1000:9.2f} ms" for s, t in zip(SIZES, figures))
        print(f"{name:26s} {cells} | doubling ratios {ratios} | result {outcome(make(SIZES[-1]))}")


def main() -> None:
    print(f"parse_overflow as shipped (SCAN_LIMIT={getattr(overflow, 'SCAN_LIMIT', None)}):")
    table()
    if hasattr(overflow, "SCAN_LIMIT"):
        overflow.SCAN_LIMIT = 10**9  # the patterns alone, every character scanned: linear or not?
        print("patterns alone, scan limit lifted:")
        table()
        overflow.SCAN_LIMIT = 65_536
    digits = V3_HEAD + "7" * 4_301 + " input tokens"
    print(f"{'4,301-digit window':26s} {best_of(digits) * 1000:9.3f} ms -> {outcome(digits)}")


if __name__ == "__main__":
    main()
