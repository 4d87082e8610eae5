"""Token accounting: count exactly what the backend will receive, incrementally, turn by turn.

- :mod:`agentkv.tokens.payload`: what a request sends (:class:`Payload`) and what a count says
  (:class:`TokenCount`);
- :mod:`agentkv.tokens.sources`: the sources, best first, one a module: the backend's template, the
  server's ``/tokenize``, tiktoken, biased character counts;
- :mod:`agentkv.tokens.chunked`: :class:`ChunkedEncoder`, text counted by memoised newline-bounded chunks;
- :mod:`agentkv.tokens.counter`: :class:`TokenCounter`, the ladder that tries them, estimate first;
- :mod:`agentkv.tokens.incremental`: the previous request, so a turn costs what it appended;
- :mod:`agentkv.tokens.cuts`: where a tokenizer is known to count a text as the sum of its pieces;
- :mod:`agentkv.tokens.breaker`: :class:`CircuitBreaker`, so a failing ``/tokenize`` is not waited on;
- :mod:`agentkv.tokens.encodings`, :mod:`agentkv.tokens.templates`: offline tiktoken encodings and
  the ChatML/Qwen tools template.

    counter = TokenCounter.for_backend(Backend("hosted_vllm/m", api_base=..., tokenizer="cl100k_base"))
    counter.count(payload_from_request({"messages": messages, "tools": tools}))
"""

from agentkv.tokens.breaker import CircuitBreaker
from agentkv.tokens.counter import TokenCounter
from agentkv.tokens.payload import CountUnavailable, Payload, TokenCount, TokenSource, payload_from_request
from agentkv.tokens.sources import CharSource, ChunkedEncoder, ServerSource, TemplateSource, TiktokenSource

__all__ = [
    "CharSource",
    "CircuitBreaker",
    "ChunkedEncoder",
    "CountUnavailable",
    "Payload",
    "ServerSource",
    "TemplateSource",
    "TiktokenSource",
    "TokenCount",
    "TokenCounter",
    "TokenSource",
    "payload_from_request",
]
