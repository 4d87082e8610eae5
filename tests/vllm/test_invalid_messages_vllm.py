"""A malformed message agentkv refuses (InvalidRequestError, before any call) is one real vLLM 0.32 refuses too."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentkv import Backend, InvalidRequestError, Session
from malformed_messages import ABSENT_CONTENT_ACCEPTED_BY_VLLM, MALFORMED


@pytest.mark.parametrize("case", list(MALFORMED))
def test_refused_here_and_by_vllm(vllm_fast, case):
    """agentkv names the message and field on the sync and async path; vLLM answers the same messages with a 400."""
    messages, index, field = MALFORMED[case]
    s = Session(Backend(vllm_fast.litellm_model, api_base=vllm_fast.base_url, window=vllm_fast.window))
    for call in (lambda: s.count(messages=messages), lambda: asyncio.run(s.aroute(messages=messages))):
        with pytest.raises(InvalidRequestError) as raised:
            call()
        assert (raised.value.index, raised.value.field) == (index, field)
    answer = httpx.post(f"{vllm_fast.base_url}/chat/completions", timeout=30,
                        json={"model": vllm_fast.model, "messages": messages, "max_tokens": 1})
    assert answer.status_code == (200 if case in ABSENT_CONTENT_ACCEPTED_BY_VLLM else 400), answer.text[:200]
