"""Against a real vLLM 0.32: every overflow wording it sends is parsed, and the window it states is learned.

The wordings are triggered on the fast server (max_model_len 2048) through litellm's ``hosted_vllm``
provider, as a Session receives them; the token-id prompt (whose wording states the exact length) goes
raw over httpx, since litellm's chat path cannot send token ids. A Session given a fast window far too
large (``Backend(..., window=99999)``) pays one 400 on the first request and none on its repeat.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest

from agentkv import Backend, Session, WindowDiscovery
from agentkv.overflow import Overflow, overflow_from_error, parse_overflow

SENTENCE = "the quick brown fox jumps over the lazy dog. "  # about 21 tokens on the tier's tokenizer


def _litellm():
    from agentkv._support.env import import_litellm

    litellm = import_litellm()
    litellm.suppress_debug_info = True
    return litellm


def _refusal(server, **kwargs: Any) -> BaseException:
    """The exception litellm raises for a request the server refuses."""
    try:
        _litellm().completion(model=server.litellm_model, api_base=server.base_url, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the refusal is what the test reads
        return exc
    pytest.fail(f"the server accepted a request it should refuse: {sorted(kwargs)}")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_prompt_alone_over_the_window_gives_the_window(vllm_fast):
    """vLLM 0.32's 'at least L+1 input tokens ... even without any output tokens' reads as L with a lower bound."""
    error = _refusal(vllm_fast, messages=_user(f"{uuid.uuid4()} " + SENTENCE * 150), max_tokens=4)
    found = overflow_from_error(error)
    assert found == Overflow("prompt_over_window", vllm_fast.window, vllm_fast.window + 1, prompt_is_lower_bound=True)


def test_token_id_prompt_over_the_window_states_its_exact_length(vllm_fast):
    """A prompt of token ids is not cut at L+1: the same wording, without 'at least', states its exact length."""
    answer = httpx.post(f"{vllm_fast.base_url}/completions", timeout=30,
                        json={"model": vllm_fast.model, "prompt": [5] * 3000, "max_tokens": 4})
    assert answer.status_code == 400
    assert parse_overflow(answer.text) == Overflow("prompt_over_window", vllm_fast.window, 3000)


def test_character_pre_check_gives_the_window(vllm_fast):
    """A prompt over the pre-tokenisation character limit reads as L with a token lower bound above L."""
    error = _refusal(vllm_fast, messages=_user(f"{uuid.uuid4()} " + "a" * 140_000), max_tokens=4)
    found = overflow_from_error(error)
    assert found is not None and found.variant == "prompt_characters"
    assert found.max_context == vllm_fast.window and found.prompt_is_lower_bound
    assert found.prompt_tokens is not None and found.prompt_tokens > vllm_fast.window


@pytest.mark.parametrize("budget_key", ["max_tokens", "max_completion_tokens"])
def test_output_budget_over_the_window_gives_the_window(vllm_fast, budget_key):
    """'max_tokens=M' and 'max_completion_tokens=M cannot be greater than max_model_len=L' read as L and M."""
    error = _refusal(vllm_fast, messages=_user(f"hello {uuid.uuid4()}"), **{budget_key: 5000})
    assert overflow_from_error(error) == Overflow("max_tokens_over_window", vllm_fast.window, None, 5000)


class RefusalCounter:
    """litellm, counting the 400s it raises (every request a server refused)."""

    def __init__(self) -> None:
        self.refused = 0

    def completion(self, **kwargs: Any) -> Any:
        try:
            return _litellm().completion(**kwargs)
        except Exception as exc:
            self.refused += getattr(exc, "status_code", None) == 400
            raise

    async def acompletion(self, **kwargs: Any) -> Any:
        try:
            return await _litellm().acompletion(**kwargs)
        except Exception as exc:
            self.refused += getattr(exc, "status_code", None) == 400
            raise


def _too_large_session(fast_server, slow_server, client: RefusalCounter) -> Session:
    fast = Backend(fast_server.litellm_model, api_base=fast_server.base_url, window=99999, name="fast")
    slow = Backend(slow_server.litellm_model, api_base=slow_server.base_url, name="slow")
    return Session(fast, slow, client=client, discovery=WindowDiscovery(), count_exactly=True)


def _over_fast_request() -> dict[str, Any]:
    """About 3,200 tokens: over fast's real window, well inside slow's."""
    return {"messages": _user(f"{uuid.uuid4()} " + SENTENCE * 150), "max_tokens": 1}


def test_a_declared_window_too_large_costs_one_400_not_one_per_repeat(vllm_fast, vllm_slow):
    """With fast declared at 99999 tokens, the first request recovers on slow and its repeat goes to slow unrefused."""
    client = RefusalCounter()
    request = _over_fast_request()
    with _too_large_session(vllm_fast, vllm_slow, client) as session:
        session.completion(**request)
        assert (client.refused, session.last_route.role) == (1, "slow")
        session.completion(**request)
        assert (client.refused, session.last_route.role, session.last_route.reason) == (1, "slow", "proactive")
        assert session.stats()["overflow_errors"] == 1


def test_a_declared_window_too_large_costs_one_400_on_the_async_path(vllm_fast, vllm_slow):
    """The async twin: one 400 for the first request, none for its repeat."""
    client = RefusalCounter()
    request = _over_fast_request()

    async def twice() -> tuple[int, str | None]:
        async with _too_large_session(vllm_fast, vllm_slow, client) as session:
            await session.acompletion(**request)
            await session.acompletion(**request)
            return session.stats()["overflow_errors"], session.last_route.role

    assert asyncio.run(twice()) == (1, "slow")
    assert client.refused == 1
