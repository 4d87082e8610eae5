"""Exact counts from the backend's own tokenizer and chat template, declared on the :class:`~agentkv.Backend`.

    source = TemplateSource("/models/qwen3-8b", chat_template=template)   # or a tiktoken encoding name
    source.count(payload)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from cachetools import LRUCache

from agentkv.events import digest, emit
from agentkv.tokens.chunked import ChunkedEncoder
from agentkv.tokens.content_format import detect_content_format
from agentkv.tokens.conversation import vllm_conversation, vllm_tools
from agentkv.tokens.cuts import tokenizer_cuts
from agentkv.tokens.encodings import get_encoding
from agentkv.tokens.incremental import AppendCounter, JsonSnapshot, appends_cleanly
from agentkv.tokens.payload import CountUnavailable, Payload, TokenCount
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE, render_chat

__all__ = ["TemplateSource"]


class TemplateSource:
    """Exact counts from the backend's own tokenizer and chat template.

    ``tokenizer`` is a tiktoken encoding name (rendered with :func:`~agentkv.tokens.templates.render_chat`, as
    the embedded engine renders), or a transformers tokenizer or its local path: then the conversation and tools
    are what vLLM hands the template (:mod:`agentkv.tokens.conversation`: content parts flattened per the
    template's content format, tool-call arguments parsed and re-rendered, tools as vLLM dumps them), rendered by
    ``apply_chat_template``. ``tools`` of a count is the difference the tool schemas make to a one-message
    conversation. A template that refuses a conversation, or a media part, raises
    :class:`~agentkv.tokens.CountUnavailable` (the server counts).

    With ``incremental`` (the default), a request that extends the previous one counted by this
    source renders and tokenizes only the appended messages and the template's closing
    (:class:`~agentkv.tokens.incremental.AppendCounter`); anything else is rendered in full.
    """

    name = "template"

    def __init__(self, tokenizer: Any, chat_template: str | None = None, *, incremental: bool = True) -> None:
        tiktoken_name = isinstance(tokenizer, str) and _is_tiktoken_name(tokenizer)
        self._hf: Any = None if tiktoken_name else _hf_tokenizer(tokenizer)
        self._encode = _encode_fn(self._hf if self._hf is not None else get_encoding(tokenizer), self._hf is not None)
        self._encoder = ChunkedEncoder(self._encode, cuts=tokenizer_cuts(tokenizer if self._hf is None else self._hf))
        self._template = chat_template
        self._hf_templates: dict[bool, str | None] = {}
        self._tool_memo: LRUCache[str, int] = LRUCache(256)
        # see _context: the last snapshot (with its numbers) and its tool tokens, replaced together (one assignment)
        self._last_context: tuple[JsonSnapshot, int] | None = None
        self._appended = AppendCounter(self._render_parts, self._encoder.count,
                                       f"{_tokenizer_name(tokenizer)}|{digest(chat_template or '', 16)}",
                                       lean=_without_tools) if incremental else None
        if self._appended is not None:
            self._appended.enabled = appends_cleanly(self._template_text())

    def _template_text(self) -> str:
        return self.chat_template or CHATML_TOOLS_TEMPLATE

    @property
    def chat_template(self) -> str | None:
        """The template text this source renders with (the tokenizer's own when none was declared; None when a
        transformers tokenizer has none)."""
        if self._hf is None:
            return self._template or CHATML_TOOLS_TEMPLATE
        return self._hf_template(False)

    def _hf_template(self, tools: bool) -> str | None:
        """The template transformers picks (a tokenizer may name a ``tool_use`` template for requests with tools)."""
        if tools not in self._hf_templates:
            getter = getattr(self._hf, "get_chat_template", None)
            try:
                found = getter(self._template, [{}] if tools else None) if callable(getter) else (
                    self._template or getattr(self._hf, "chat_template", None))
            except (ValueError, TypeError, KeyError):  # no template at all, or a dict of named ones without default
                found = None
            self._hf_templates[tools] = found if isinstance(found, str) else None
        return self._hf_templates[tools]

    def render(self, payload: Payload, *, add_generation_prompt: bool = True) -> str:
        """The text the server would tokenize for this payload: for a transformers tokenizer, as vLLM renders it
        (:mod:`agentkv.tokens.conversation`); else with :func:`~agentkv.tokens.templates.render_chat`, as the
        embedded engine renders it. A template that refuses the conversation raises
        :class:`~agentkv.tokens.CountUnavailable`."""
        if payload.messages is None:
            return payload.prompt or ""
        from jinja2 import TemplateError

        if self._hf is not None:
            return self._render_hf(payload, add_generation_prompt)
        try:
            return render_chat(
                payload.messages, payload.tools, tool_choice=payload.tool_choice,
                add_generation_prompt=add_generation_prompt, template=self._template, **dict(payload.template_kwargs or {}),
            )
        except TemplateError as exc:
            raise _refused(exc) from exc

    def _render_hf(self, payload: Payload, add_generation_prompt: bool) -> str:
        """vLLM's rendering: its conversation and tools, its template arguments (no ``tool_choice``: vLLM passes
        none), transformers' ``apply_chat_template``."""
        from jinja2 import TemplateError

        template = self._hf_template(bool(payload.tools))
        if template is None:
            raise CountUnavailable("the tokenizer has no chat template and none was declared")
        conversation = vllm_conversation(payload.messages or (), detect_content_format(template), template)
        kwargs = {k: v for k, v in (payload.template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
        try:
            return str(self._hf.apply_chat_template(
                conversation, tools=vllm_tools(payload.tools), chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=False, **kwargs,
            ))
        except (TemplateError, ValueError) as exc:  # the template's own refusal, or an empty conversation
            raise _refused(exc) from exc

    def token_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of the rendered payload (for prefix diagnostics)."""
        return list(self._encode(self.render(payload, add_generation_prompt=add_generation_prompt)))

    def count(self, payload: Payload) -> TokenCount:
        context, tools = self._context(payload)
        total = None
        if self._appended is not None and payload.messages and self._encoder.splits_exactly:
            total = self._appended.count(payload.messages, context)
        if total is None:
            total = self._encoder.count(self.render(payload))
        return TokenCount(total, total, min(tools if payload.messages is not None else 0, total), self.name, True)

    def _context(self, payload: Payload) -> tuple[tuple[Any, Any, Any], int]:
        """A snapshot of the payload's render context (tools, tool choice, template arguments) and its tool
        tokens: the previous request's own snapshot when equal (one comparison per request; the memo behind
        :meth:`count` then compares it by identity), else a new deep copy, safe from later in-place edits."""
        context = (payload.tools, payload.tool_choice, payload.template_kwargs)
        last = self._last_context
        if last is not None and last[0].matches(context):
            return last[0].value, last[1]
        snapshot = JsonSnapshot(context)
        tools, tool_choice, template_kwargs = snapshot.value
        tool_tokens = self._tools_tokens(Payload((), tools, tool_choice, template_kwargs=template_kwargs))
        self._last_context = (snapshot, tool_tokens)
        return snapshot.value, tool_tokens

    def _render_parts(self, messages: Sequence[Mapping[str, Any]], context: tuple[Any, Any, Any],
                      add_generation_prompt: bool) -> str:
        tools, tool_choice, template_kwargs = context
        payload = Payload(tuple(messages), tools, tool_choice, template_kwargs=template_kwargs)
        return self.render(payload, add_generation_prompt=add_generation_prompt)

    def _tools_tokens(self, payload: Payload) -> int:
        """The tokens the tool schemas add: a one-message conversation rendered with and without them (an empty
        conversation is refused by transformers), 0 when the template refuses either."""
        if not payload.tools:
            return 0
        key = digest([payload.tools, payload.tool_choice])
        if key not in self._tool_memo:
            with_tools = Payload(_PROBE, payload.tools, payload.tool_choice, template_kwargs=payload.template_kwargs)
            bare = Payload(_PROBE, template_kwargs=payload.template_kwargs)
            try:
                counts = [self._encoder.count(self.render(p, add_generation_prompt=False)) for p in (with_tools, bare)]
            except CountUnavailable:
                counts = [0, 0]
            self._tool_memo[key] = max(0, counts[0] - counts[1])
        return self._tool_memo[key]


_PROBE: tuple[Mapping[str, Any], ...] = ({"role": "user", "content": ""},)
# apply_chat_template's own arguments, set by the renderer (vLLM refuses chat_template and tokenize in
# chat_template_kwargs, and overrides the generation prompt), or changing what it returns
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "sanitize_control_tokens"})


def _refused(exc: Exception) -> CountUnavailable:
    emit("chat_template_refused", level="debug", error=type(exc).__name__, reason=str(exc)[:200])
    return CountUnavailable(f"the chat template refused the conversation: {type(exc).__name__}: {exc}")


def _without_tools(context: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """The render context without tool schemas (most templates render them in the first turn only)."""
    return None, None, context[2]


def _tokenizer_name(tokenizer: Any) -> str:
    if isinstance(tokenizer, str):
        return tokenizer
    return f"{type(tokenizer).__name__}:{getattr(tokenizer, 'name_or_path', id(tokenizer))}"


def _is_tiktoken_name(name: str) -> bool:
    return name in {"cl100k_base", "o200k_base", "p50k_base", "r50k_base", "o200k_harmony"}


def _hf_tokenizer(tokenizer: Any) -> Any:
    if not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)


def _encode_fn(tokenizer: Any, is_hf: bool) -> Callable[[str], Sequence[int]]:
    if is_hf:
        return lambda text: tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode_ordinary  # type: ignore[no-any-return]  # = encode(tokenizer, text) without its copy
