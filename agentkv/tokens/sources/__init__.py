"""Token sources, best first: the backend's declared template, the server's /tokenize, tiktoken, characters.

Each source counts a :class:`~agentkv.tokens.Payload` or raises :class:`~agentkv.tokens.CountUnavailable`;
:class:`~agentkv.tokens.TokenCounter` tries them best first. One source a module:

- :mod:`~agentkv.tokens.sources.template`: :class:`TemplateSource`, the declared tokenizer and chat template,
  rendered as vLLM renders it (exact);
- :mod:`~agentkv.tokens.sources.server`: :class:`ServerSource`, vLLM's ``POST /tokenize`` (exact);
- :mod:`~agentkv.tokens.sources.provider`: :class:`AnthropicCountSource` and :class:`GeminiCountSource`, a hosted
  provider's count endpoint (exact);
- :mod:`~agentkv.tokens.sources.estimate`: :class:`TiktokenSource`, cl100k over ChatML, with its interval;
- :mod:`~agentkv.tokens.sources.chars`: :class:`CharSource`, character counts with a stated bias.

The chunked encoder the exact local source counts with is :mod:`agentkv.tokens.chunked`.
"""

from agentkv.tokens.chunked import ChunkedEncoder, split_lines, word_cut
from agentkv.tokens.sources.chars import CharSource
from agentkv.tokens.sources.estimate import (
    CROSS_TOKENIZER_MARGIN, FIXED_SLACK, PER_MESSAGE_SLACK, TiktokenSource, estimate_interval,
)
from agentkv.tokens.sources.provider import AnthropicCountSource, GeminiCountSource, provider_source
from agentkv.tokens.sources.server import DEFAULT_TOKENIZE_TIMEOUT_S, ServerSource
from agentkv.tokens.sources.template import TemplateSource

__all__ = [
    "AnthropicCountSource",
    "GeminiCountSource",
    "provider_source",
    "CROSS_TOKENIZER_MARGIN",
    "DEFAULT_TOKENIZE_TIMEOUT_S",
    "FIXED_SLACK",
    "PER_MESSAGE_SLACK",
    "CharSource",
    "ChunkedEncoder",
    "ServerSource",
    "TemplateSource",
    "TiktokenSource",
    "estimate_interval",
    "split_lines",
    "word_cut",
]
