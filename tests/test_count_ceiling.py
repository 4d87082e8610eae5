"""The byte ceiling (agentkv.tokens.ceiling): a short request far from every boundary is decided without
/tokenize even while its backend's tokenizer ratio is unknown; a template that frames past the ceiling ends that;
plain messages are counted without rendering, exactly; and Session.presend vouches only for what is certain."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.tokens import Payload, TemplateSource, TokenCounter
from agentkv.tokens.bound import EstimateBound
from agentkv.tokens.ceiling import TOOLS_PREAMBLE, byte_ceiling
from agentkv.tokens.sources.estimate import TiktokenSource, _plain_text
from test_count_bound import FakeVLLM, prose

TEXT = st.text(alphabet=string.ascii_letters + string.digits + " \n\t.,;:!?()[]{}<>|_-'\"/\\éü中文🙂", min_size=1,
               max_size=60)
EXACT = TemplateSource("cl100k_base")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT), min_size=1, max_size=6))
def test_the_ceiling_is_never_below_an_exact_count(messages):
    """Whatever the text, the ceiling is at least what cl100k with the ChatML template counts."""
    payload = Payload(tuple({"role": role, "content": content} for role, content in messages))
    assert byte_ceiling(payload) >= EXACT.count(payload).total


def test_the_ceiling_counts_tools_and_refuses_media():
    """Tool schemas add their bytes and the template preamble; an image part has no ceiling at all."""
    message = ({"role": "user", "content": "ping"},)
    tools = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},)
    assert byte_ceiling(Payload(message, tools)) > byte_ceiling(Payload(message)) + TOOLS_PREAMBLE
    image = {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}
    assert byte_ceiling(Payload((image,))) is None
    assert byte_ceiling(Payload(None, prompt="héllo")) == len("héllo".encode()) + 32


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["system", "user", "assistant", "tool"]), TEXT)
def test_a_plain_message_is_counted_exactly_without_rendering(role, content):
    """The framing-plus-content count equals the rendered count wherever it is used."""
    source = TiktokenSource()
    message = {"role": role, "content": content}
    if _plain_text(message) is not None:
        assert source._plain_tokens(role, content) == source._rendered_tokens(message)


def test_a_short_request_of_unknown_ratio_needs_one_tokenize_then_none():
    """The first request is counted exactly and its ceiling checked; later short ones decide on [0, ceiling]
    while the ratio is still unknown (a short request shows none)."""
    fake = FakeVLLM(ratio=2.0)
    counter = TokenCounter.for_backend(fake.backend("fast"), http=fake.http)
    counter.bound = EstimateBound()
    short = [Payload(({"role": "user", "content": f"ping {n}"},)) for n in range(5)]
    assert counter.count_for(short[0], lambda low, high: high < 1000).exact
    counter.learn(short[0], fake.tokens(short[0]))
    assert counter.bound.trusts_ceiling and not counter.bound.known
    for payload in short[1:]:
        assert not counter.count_for(payload, lambda low, high: high < 1000).exact
    assert fake.tokenize_calls() == 1
    assert counter.count_for(short[1], lambda low, high: high < 20).exact  # near a boundary: counted


def test_a_template_that_frames_past_the_ceiling_is_never_trusted_to_one_again():
    """An exact count above its ceiling (a template with a long preamble) breaks the ceiling for good: later
    counts are checked against no ceiling, and presend (which needs a trusted one) never vouches again."""
    bound = EstimateBound()
    assert bound.check_ceiling(100, 100) and bound.trusts_ceiling
    assert not bound.check_ceiling(100, 101) and bound.ceiling_broken and not bound.trusts_ceiling
    assert bound.check_ceiling(100, 10) and not bound.trusts_ceiling
    assert bound.check_ceiling(None, 10 ** 6)  # a payload without a ceiling says nothing


def test_presend_vouches_only_for_short_requests_far_from_every_boundary():
    """After one exact count, a short request gets the attempt it will get (fast, as it is); a long one, one with
    a salt of the caller's, a malformed one, or one with stale windows gets None; nothing is recorded."""
    fake = FakeVLLM(ratio=1.0, fast_window=2048)
    with fake.session() as session:
        session.completion(messages=prose(40), max_tokens=8)
        ledger = len(session.ledger)
        body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 8}
        early = session.presend(body)
        assert early is not None and early.decision.role == "fast" and early.decision.reason == "fits"
        assert early.decision.max_tokens == 8 and early.backend is session.fast
        assert session.presend({**body, "max_tokens": 2000}) is None                 # a clamp is possible
        assert session.presend({"messages": prose(600), "max_tokens": 8}) is None    # near the warm threshold
        assert session.presend({**body, "cache_salt": "mine"}) is None
        assert session.presend({"messages": [{"content": "no role"}]}) is None
        assert len(session.ledger) == ledger == 1
        session._parts.discovery._recent.clear()
        assert session.presend(body) is None                                         # windows not fresh
