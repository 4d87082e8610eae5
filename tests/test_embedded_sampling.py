"""Stop strings and request bounds are pure decisions, checked here without a model."""

from __future__ import annotations

import pytest

from agentkv.embedded.engine.sampling import StopChecker


def feed(checker: StopChecker, pieces: list[str]) -> tuple[str, str | None]:
    sent, hit = "", None
    for piece in pieces:
        out, hit = checker.push(piece)
        sent += out
        if hit is not None:
            return sent, hit
    return sent + checker.flush(), hit


def test_stop_string_split_across_deltas_is_never_half_sent():
    """A stop string arriving in pieces is caught, and none of its characters are sent."""
    checker = StopChecker(("END",))
    sent, hit = feed(checker, ["abc E", "N", "D more"])
    assert (sent, hit) == ("abc ", "END") and checker.text == "abc "


def test_include_stop_str_in_output_keeps_it():
    """With include_stop_str_in_output the text runs through the stop string and no further."""
    sent, hit = feed(StopChecker(("\n\n",), include=True), ["one\n", "\ntwo"])
    assert (sent, hit) == ("one\n\n", "\n\n")


def test_the_earliest_of_several_stops_wins():
    """When two stop strings appear, the text is cut at the first one."""
    sent, hit = feed(StopChecker(("b", "xyz")), ["xyzab"])
    assert (sent, hit) == ("", "xyz")


def test_without_a_stop_everything_is_released_by_the_end():
    """Held-back characters that never became a stop string are sent at the end."""
    checker = StopChecker(("STOP",))
    out, hit = checker.push("abcST")
    assert hit is None and out == "ab"
    assert out + checker.flush() == "abcST"


@pytest.mark.parametrize("pieces", [["a", "b", "c"], ["abc"], ["", "abc", ""]])
def test_no_stops_streams_everything_at_once(pieces):
    """Without stop strings nothing is held back."""
    checker = StopChecker(())
    assert "".join(checker.push(p)[0] for p in pieces) == "abc" and checker.flush() == ""
