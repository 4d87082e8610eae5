"""Character estimators with a written-down bias, for when no tokenizer is known.

    CharSource().count(payload)      # total = chars / 4 (routing), safe = chars / 3 (clamping)
"""

from __future__ import annotations

import math

from agentkv.events import canonical_json
from agentkv.tokens.payload import Payload, TokenCount
from agentkv.tokens.sources.estimate import FIXED_SLACK

__all__ = ["CharSource"]


class CharSource:
    """Character estimators with a stated bias: chars/4 under-estimates, chars/3 over-estimates."""

    name = "chars"

    def count(self, payload: Payload) -> TokenCount:
        tools = len(canonical_json(list(payload.tools or []))) // 4
        # no tokenizer known: any count from 0 to one token per UTF-8 byte (a loose bound, so an exact
        # source is asked wherever a decision could depend on it)
        return TokenCount(_chars_low(payload), _chars_high(payload), tools, self.name, False, 0,
                          4 * payload.char_count() + FIXED_SLACK)


def _chars_low(payload: Payload) -> int:
    """chars / 4: an under-estimate, for routing (a borderline turn stays on the fast model)."""
    return payload.char_count() // 4


def _chars_high(payload: Payload) -> int:
    """chars / 3: an over-estimate, for clamping the output budget (the clamp errs safe)."""
    return math.ceil(payload.char_count() / 3)
