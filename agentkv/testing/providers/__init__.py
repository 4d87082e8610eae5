"""Fakes of hosted providers' APIs (Anthropic, OpenAI, Gemini), written from each provider's documented prompt-caching
semantics, for tests and benchmarks that drive litellm's real provider code against them over real HTTP.

Each fake runs on 127.0.0.1 only, on a thread of its own, until its ``with`` block ends. What each leaves out of
the real provider is listed in its module's docstring.
"""

from agentkv.testing.providers.anthropic import FakeAnthropic
from agentkv.testing.providers.gemini import FakeGemini
from agentkv.testing.providers.openai import FakeOpenAI

__all__ = ["FakeAnthropic", "FakeGemini", "FakeOpenAI"]
