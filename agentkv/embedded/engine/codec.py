"""Text in, token ids out, and back: the embedded engine's tokenizer and chat template in one object.

Two codecs share one small protocol. :class:`TiktokenCodec` is the default: tiktoken ``cl100k_base`` (special-token
look-alikes encoded as text) with agentkv's ChatML/Qwen template, so the engine tokenizes exactly as
:mod:`agentkv.tokens.encodings` counts. :class:`HFCodec` wraps a checkpoint's own tokenizer and, when it has one, its
chat template.

Chat prompts are rendered to text and then encoded without special tokens, as vLLM does for chat requests; the
messages reach the template as vLLM passes them (:mod:`agentkv.embedded.engine.chat_format`: content parts joined with
``"\n"`` unless the template iterates over content, tool-call arguments parsed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from agentkv.embedded.engine.chat_format import content_format, template_messages
from agentkv.tokens import encodings
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE, render_chat


@dataclass(frozen=True)
class ChatRequest:
    """Everything that decides how a conversation renders to prompt text.

    Usage::

        ChatRequest(messages, tools=tools, tool_choice="auto", template_kwargs={"enable_thinking": False})
    """

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


class Codec(Protocol):
    """Anything that renders chats, encodes text and decodes ids for one model."""

    eos_token_ids: frozenset[int]
    vocab_ids: int
    """Ids ``0 .. vocab_ids-1`` may be decoded; the engine never samples others."""
    max_chars_per_token: int
    """The longest token's length: no text longer than ``window * max_chars_per_token`` fits the window."""

    def render(self, chat: ChatRequest) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_strs(self, ids: Sequence[int]) -> list[str]: ...

    def valid_ids(self) -> Sequence[int] | None: ...


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """Drop what the template wrote after the final message's content (``continue_final_message``)."""
    if not messages:
        return text
    final = template_messages(messages[-1:], "string")[0].get("content") or ""
    index = text.rfind(final) if final else -1
    return text[: index + len(final)] if index >= 0 else text


def render_with_template(chat: ChatRequest, template: str | None = None) -> str:
    """``chat`` rendered with a Jinja ``template`` (agentkv's ChatML/Qwen template by default)."""
    text = render_chat(
        template_messages(chat.messages, content_format(template or CHATML_TOOLS_TEMPLATE)),
        chat.tools,
        tool_choice=chat.tool_choice,
        add_generation_prompt=chat.add_generation_prompt and not chat.continue_final_message,
        template=template,
        **dict(chat.template_kwargs),
    )
    return _cut_after_final_message(text, chat.messages) if chat.continue_final_message else text


class TiktokenCodec:
    """tiktoken ``cl100k_base`` with agentkv's ChatML/Qwen template (or another Jinja template)."""

    def __init__(self, encoding: Any | None = None, *, template: str | None = None) -> None:
        self.encoding = encoding or encodings.get_encoding()
        self.template = template
        self.eos_token_ids = frozenset({encodings.eos_token_id(self.encoding)})
        self.vocab_ids = int(self.encoding.n_vocab)
        self.max_chars_per_token = max(len(b) for b in self.encoding.token_byte_values())

    def render(self, chat: ChatRequest) -> str:
        """The prompt text for ``chat``."""
        return render_with_template(chat, self.template)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; cl100k_base has no BOS, so ``add_special_tokens`` changes nothing."""
        return encodings.encode(self.encoding, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.encoding.decode(list(ids), errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's own text, invalid UTF-8 replaced."""
        return [self.encoding.decode_single_token_bytes(i).decode("utf-8", "replace") for i in ids]

    def valid_ids(self) -> Sequence[int]:
        """The ids tiktoken can decode: the ranked byte-pairs plus the named special tokens."""
        specials = self.encoding._special_tokens.values()
        return [*range(len(self.encoding._mergeable_ranks)), *specials]


class HFCodec:
    """A Hugging Face tokenizer; its chat template when it has one, agentkv's otherwise."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset({eos} if eos is not None else set())
        self.vocab_ids = len(tokenizer)
        self.max_chars_per_token = max(len(token) for token in tokenizer.get_vocab())  # as vLLM measures it

    def render(self, chat: ChatRequest) -> str:
        """The prompt text for ``chat``, through the tokenizer's own template when it has one."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not template or not isinstance(template, str):
            return render_with_template(chat)
        return self.tokenizer.apply_chat_template(
            template_messages(chat.messages, content_format(template)),
            tools=list(chat.tools) if chat.tools else None,
            tokenize=False,
            add_generation_prompt=chat.add_generation_prompt and not chat.continue_final_message,
            continue_final_message=chat.continue_final_message,
            **dict(chat.template_kwargs),
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``, with the tokenizer's BOS/EOS only when ``add_special_tokens``."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The tokenizer's own string for each id."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def valid_ids(self) -> None:
        """Every id below ``vocab_ids`` decodes."""
        return None
