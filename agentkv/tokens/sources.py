"""Token sources: the backend's template, the server's /tokenize, tiktoken, and biased character counts.

Each source counts a :class:`~agentkv.tokens.Payload` or raises
:class:`~agentkv.tokens.CountUnavailable`; :class:`~agentkv.tokens.TokenCounter` tries them best first.
"""

from __future__ import annotations

import math
import re
import sys
import threading
from typing import Any, Callable, Mapping, Sequence

from cachetools import LRUCache

from agentkv._http import HttpError, HttpTransport, default_http
from agentkv.backends import Backend
from agentkv.events import canonical_json, digest, emit
from agentkv.tokens.breaker import CircuitBreaker, shared_breaker
from agentkv.tokens.cuts import Cuts, tokenizer_cuts
from agentkv.tokens.encodings import DEFAULT_ENCODING, get_encoding
from agentkv.tokens.incremental import AppendCounter, JsonSnapshot, PrefixMemo, appends_cleanly
from agentkv.tokens.payload import CountUnavailable, Payload, TokenCount
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE, render_chat

# A point right after a newline and before a non-space character is a pre-token boundary for the
# cl100k-style splitting regexes (cl100k, o200k, Llama-3, Qwen2): no pre-token runs across it, so token
# counts of the pieces add up exactly. Which tokenizers split there is known, not sampled (tokens/cuts.py).
# /tokenize is a fast call (a tokenizer pass on the server); a server that takes longer is treated as
# failing and its breaker opens (:mod:`agentkv.tokens.breaker`).
DEFAULT_TOKENIZE_TIMEOUT_S = 2.0

# Not before a "/": o200k's punctuation pre-token runs on through newlines and slashes (",\n//" is one).
_CHUNK_BOUNDARY = re.compile(r"(?<=\n)(?=[ \t]*\S)(?!/)")
# A newline that is not a chunk boundary: only spaces or tabs, then another whitespace character or the end,
# or a "/" right after it (possessive where the re module has it: the same matches, found without
# backtracking). _GLUED_AT finds each one (a lookahead: "\n\n\n" has two).
_GLUED_NEWLINE = re.compile(r"\n(?:[ \t]*+(?:[^\S \t]|\Z)|/)" if sys.version_info >= (3, 11)
                            else r"\n(?:[ \t]*(?:[^\S \t]|\Z)|/)")
_GLUED_AT = re.compile(r"\n(?=[ \t]*(?:[^\S \t]|\Z)|/)")


def split_lines(text: str) -> tuple[list[str], list[str]]:
    """``text``'s chunks (:data:`_CHUNK_BOUNDARY`), in two lists: ``lines``, chunks that are one line and its
    newline (given without it), and ``rest``, the others (lines joined by blank ones, a last line without a
    newline). Their order is lost; their counts add up to the text's.

    Cutting with ``str.split`` is several times faster than the look-around split; the chunks are the same."""
    ends = text.endswith("\n")
    body = text[:-1] if ends else text
    lines = body.split("\n")
    last = len(lines) - 1  # lines[last] is followed by the text's end, or by its final newline (when ends)
    glued = _glued_lines(body) if _GLUED_NEWLINE.search(body) is not None else []
    rest = []
    for start, stop in reversed(glued):  # lines[start:stop] are one chunk
        rest.append("\n".join(lines[start:stop]) + ("\n" if stop <= last or ends else ""))
        del lines[start:stop]
    if not ends and (not glued or glued[-1][1] <= last):
        tail = lines.pop()
        if tail or not text:
            rest.append(tail)
    return lines, rest


def _glued_lines(body: str) -> list[tuple[int, int]]:
    """``(start, stop)`` for each run of lines that glued newlines join (newline k joins lines k and k + 1)."""
    runs: list[tuple[int, int]] = []
    index, at = 0, 0
    for match in _GLUED_AT.finditer(body):
        index += body.count("\n", at, match.start())
        at = match.start()
        if runs and runs[-1][1] == index + 1:
            runs[-1] = (runs[-1][0], index + 2)
        else:
            runs.append((index, index + 2))
    return runs


def word_cut(line: str) -> int:
    """Where ``line`` splits into two pre-token-bounded pieces: before its first space that follows a
    non-space and precedes one (``  "id":| "inc-7",``); 0 when it has none. The cl100k-style splitting
    regexes only ever start a pre-token with a space, so counts of the two pieces add up
    (:mod:`agentkv.tokens.cuts` says for which tokenizers)."""
    i = line.find(" ", 1)
    while i > 0:
        if not line[i - 1].isspace() and i + 1 < len(line) and not line[i + 1].isspace():
            return i
        i = line.find(" ", i + 1)
    return 0


class ChunkedEncoder:
    """Counts text by newline-bounded chunks, each tokenized once and memoised by its content.

    Appending one message to a long conversation tokenizes only that message's chunks, and of a line
    not seen before, only what follows its first word when that word was seen (:func:`word_cut`: a
    JSON line's key repeats, its value is new). ``encode`` is ``text -> token ids``; ``cuts`` says
    where this tokenizer is known to count exactly (:func:`~agentkv.tokens.cuts.tokenizer_cuts`:
    ``"words"``, ``"lines"``, or ``"whole"``, the default, for a tokenizer nothing is known about:
    whole texts are counted). As a guard, the first call also checks the cuts on its text and counts
    whole texts (or lines without word cuts) from then on where they do not add up.
    """

    def __init__(self, encode_fn: Callable[[str], Sequence[int]], maxsize: int = 65536, *,
                 cuts: Cuts = "whole") -> None:
        self._encode = encode_fn
        self._cuts = cuts
        # plain dicts (atomic get/set), each emptied when it outgrows maxsize: chunks and line pieces, and
        # lines (a line's count is that of the line and its newline)
        self._memo: dict[str, int] = {}
        self._lines: dict[str, int] = {}
        self._maxsize = maxsize
        self._chunking: bool | None = None
        self._word_cuts = False

    @property
    def splits_exactly(self) -> bool:
        """True once the first count confirmed the declared cuts (never for ``cuts="whole"``)."""
        return bool(self._chunking)

    def count(self, text: str) -> int:
        if self._chunking is None:
            self._chunking, self._word_cuts = self._cuts_hold(text)
        if not self._chunking:
            return len(self._encode(text))
        lines, rest = split_lines(text)
        total = self._sum(self._lines, lines, self._line_count)
        return total + (self._sum(self._memo, rest, self._piece_count) if rest else 0)

    def _sum(self, memo: dict[str, int], keys: list[str], count: Callable[[str], int]) -> int:
        """The summed counts of ``keys``: memo lookups at C speed, each miss counted once by ``count``."""
        counts = list(map(memo.get, keys))
        if None in counts:
            for i, key in enumerate(keys):
                if counts[i] is None:
                    counted = memo.get(key)  # a chunk repeated within this text is counted once
                    counts[i] = memo[key] = count(key) if counted is None else counted
            if len(memo) > self._maxsize:
                memo.clear()
        return sum(counts)  # type: ignore[arg-type]

    def _line_count(self, line: str) -> int:
        """Tokens of ``line`` and its newline: its first word and the rest apart when they split exactly."""
        cut = word_cut(line) if self._word_cuts else 0
        if cut == 0:
            return len(self._encode(line + "\n"))
        memo, head = self._memo, line[:cut]
        counted = memo.get(head)
        if counted is None:
            counted = memo[head] = len(self._encode(head))
        return counted + len(self._encode(line[cut:] + "\n"))

    def _piece_count(self, piece: str) -> int:
        return len(self._encode(piece))

    def _cuts_hold(self, text: str) -> tuple[bool, bool]:
        """Whether the declared cuts (chunks; word cuts within lines) count as the whole text does, checked on
        ``text``: a guard, the declaration decides (a tokenizer whose cuts are unknown is never cut)."""
        if self._cuts == "whole":
            return False, False
        sample = text if len(text) < 200_000 else text[:200_000]
        whole = len(self._encode(sample))
        chunks = _CHUNK_BOUNDARY.split(sample)
        pieces = sum(len(self._encode(c)) for c in chunks)
        if whole != pieces:
            emit("chunked_count_disabled", level="warning", whole=whole, chunked=pieces)
            return False, False
        if self._cuts != "words":
            return True, False
        words = sum(len(self._encode(p)) for c in chunks for p in _word_pieces(c))
        if words != whole:
            emit("word_cuts_disabled", level="warning", whole=whole, chunked=words)
        return True, words == whole


def _word_pieces(chunk: str) -> tuple[str, ...]:
    cut = word_cut(chunk)
    return (chunk[:cut], chunk[cut:]) if cut else (chunk,)


class TemplateSource:
    """Exact counts from the backend's own tokenizer and chat template.

    With ``incremental`` (the default), a request that extends the previous one counted by this
    source renders and tokenizes only the appended messages and the template's closing
    (:class:`~agentkv.tokens.incremental.AppendCounter`); anything else is rendered in full.
    """

    name = "template"

    def __init__(self, tokenizer: Any, chat_template: str | None = None, *, incremental: bool = True) -> None:
        tiktoken_name = isinstance(tokenizer, str) and _is_tiktoken_name(tokenizer)
        self._hf = None if tiktoken_name else _hf_tokenizer(tokenizer)
        self._encode = _encode_fn(self._hf if self._hf is not None else get_encoding(tokenizer), self._hf is not None)
        self._encoder = ChunkedEncoder(self._encode, cuts=tokenizer_cuts(tokenizer if self._hf is None else self._hf))
        self._template = chat_template
        self._tool_memo: LRUCache[str, int] = LRUCache(256)
        # see _context: the last snapshot (with its numbers) and its tool tokens, replaced together (one assignment)
        self._last_context: tuple[JsonSnapshot, int] | None = None
        self._appended = AppendCounter(self._render_parts, self._encoder.count,
                                       f"{_tokenizer_name(tokenizer)}|{digest(chat_template or '', 16)}",
                                       lean=_without_tools) if incremental else None
        if self._appended is not None:
            self._appended.enabled = appends_cleanly(self._template_text())

    def _template_text(self) -> str:
        if self._template is not None:
            return self._template
        hf_template = getattr(self._hf, "chat_template", None) if self._hf is not None else None
        return hf_template if isinstance(hf_template, str) else CHATML_TOOLS_TEMPLATE

    def render(self, payload: Payload, *, add_generation_prompt: bool = True) -> str:
        """The text the server would tokenize for this payload."""
        if payload.messages is None:
            return payload.prompt or ""
        kwargs = dict(payload.template_kwargs or {})
        if self._hf is not None:
            if payload.tool_choice is not None:
                kwargs.setdefault("tool_choice", payload.tool_choice)  # visible to templates that render it
            return str(self._hf.apply_chat_template(
                [dict(m) for m in payload.messages], tools=list(payload.tools or []) or None,
                chat_template=self._template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs,
            ))
        return render_chat(
            payload.messages, payload.tools, tool_choice=payload.tool_choice,
            add_generation_prompt=add_generation_prompt, template=self._template, **kwargs,
        )

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
        if not payload.tools:
            return 0
        key = digest([payload.tools, payload.tool_choice])
        if key not in self._tool_memo:
            bare = Payload(messages=(), tools=payload.tools, tool_choice=payload.tool_choice,
                           template_kwargs=payload.template_kwargs)
            self._tool_memo[key] = self._encoder.count(self.render(bare, add_generation_prompt=False))
        return self._tool_memo[key]


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


class ServerSource:
    """Exact counts from vLLM's ``POST /tokenize`` (chat form), cached per payload digest.

    ``http`` is the HTTP seam (:func:`agentkv._http.default_http` unless given). A server without
    ``/tokenize`` (404/405) is remembered and not asked again by this source. A timeout, a failed
    connection or a 5xx opens ``breaker`` (by default the process's breaker for this URL,
    :func:`~agentkv.tokens.breaker.shared_breaker`): until its back-off ends, the source is not asked
    and the counter's next source answers. The sync and the async methods share one cache and one
    body builder; only the transport call differs.
    """

    name = "server"

    def __init__(self, backend: Backend, *, http: HttpTransport | None = None,
                 timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S, maxsize: int = 512,
                 breaker: CircuitBreaker | None = None) -> None:
        if backend.server_root is None:
            raise CountUnavailable(f"backend {backend.label!r} has no api_base to ask /tokenize")
        self._backend = backend
        self._url = f"{backend.server_root}/tokenize"
        self._http = http or default_http()
        self._timeout_s = timeout_s
        self.breaker = breaker or shared_breaker(self._url)
        self._memo: LRUCache[str, dict[str, Any]] = LRUCache(maxsize)
        self._lock = threading.Lock()
        self.unsupported = False
        self.last_max_model_len: int | None = None

    def request_body(self, payload: Payload, **overrides: Any) -> dict[str, Any]:
        """The chat-form (or prompt-form) /tokenize body for this payload."""
        if payload.messages is None:
            return {"model": self._backend.served_model, "prompt": payload.prompt or "", **overrides}
        body: dict[str, Any] = {"model": self._backend.served_model, "messages": [dict(m) for m in payload.messages],
                                "add_generation_prompt": True}
        if payload.tools:
            body["tools"] = list(payload.tools)
        if payload.tools and payload.tool_choice is not None:
            body["tool_choice"] = payload.tool_choice  # templates may render it; vLLM ignores the field
        if payload.template_kwargs:
            body["chat_template_kwargs"] = dict(payload.template_kwargs)
        body.update(overrides)
        return body

    def tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The server's answer for ``body``, from the cache when the same body was sent before."""
        key, cached = self._remembered(body)
        if cached is not None:
            return cached
        self._admit()
        try:
            answer = self._http.post_json(self._url, dict(body), timeout_s=self._timeout_s)
        except HttpError as exc:
            raise self._unavailable(exc) from exc
        self.breaker.succeeded()
        return self._remember(key, self._checked(answer))

    async def atokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`tokenize` over async HTTP, sharing the same cache."""
        key, cached = self._remembered(body)
        if cached is not None:
            return cached
        self._admit()
        try:
            answer = await self._http.apost_json(self._url, dict(body), timeout_s=self._timeout_s)
        except HttpError as exc:
            raise self._unavailable(exc) from exc
        self.breaker.succeeded()
        return self._remember(key, self._checked(answer))

    def count(self, payload: Payload) -> TokenCount:
        total = self.tokenize(self.request_body(payload))["count"]
        return self._count(total, [self.tokenize(body)["count"] for body in self._tool_probes(payload)])

    async def acount(self, payload: Payload) -> TokenCount:
        """:meth:`count` over async HTTP."""
        total = (await self.atokenize(self.request_body(payload)))["count"]
        return self._count(total, [(await self.atokenize(body))["count"] for body in self._tool_probes(payload)])

    def token_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> list[int]:
        """The server's token ids for the payload."""
        body = self.request_body(payload, add_generation_prompt=add_generation_prompt)
        return list(self.tokenize(body).get("tokens") or [])

    async def atoken_ids(self, payload: Payload, *, add_generation_prompt: bool = True) -> list[int]:
        """:meth:`token_ids` over async HTTP."""
        body = self.request_body(payload, add_generation_prompt=add_generation_prompt)
        return list((await self.atokenize(body)).get("tokens") or [])

    def _count(self, total: int, probes: list[int]) -> TokenCount:
        tools = max(0, probes[0] - probes[1]) if probes else 0
        return TokenCount(total, total, min(tools, total), self.name, True)

    def _tool_probes(self, payload: Payload) -> list[dict[str, Any]]:
        """Two /tokenize bodies whose counts differ by the tool schemas' tokens (none without tools)."""
        if not payload.tools or payload.messages is None:
            return []
        probe = ({"role": "user", "content": ""},)
        return [self.request_body(Payload(probe, payload.tools), add_generation_prompt=False),
                self.request_body(Payload(probe), add_generation_prompt=False)]

    def _remembered(self, body: Mapping[str, Any]) -> tuple[str, dict[str, Any] | None]:
        if self.unsupported:
            raise CountUnavailable("server has no /tokenize")
        key = digest(body, 24)
        with self._lock:
            return key, self._memo.get(key)

    def _remember(self, key: str, answer: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            self._memo[key] = answer
        return answer

    def _admit(self) -> None:
        if not self.breaker.allow():
            raise CountUnavailable("/tokenize circuit open after a recent timeout or server error")

    def _unavailable(self, exc: HttpError) -> CountUnavailable:
        if exc.status_code in (404, 405):
            self.unsupported = True
        if exc.timed_out or exc.status_code is None or exc.status_code >= 500:
            self.breaker.failed()
            emit("count_source_breaker_open", level="warning", source=self.name, backend=self._backend.label,
                 status=exc.status_code, timed_out=exc.timed_out)
        else:
            self.breaker.succeeded()  # it answered: the server is up, this body was refused
        return CountUnavailable(f"/tokenize failed: {exc}")

    def _checked(self, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, Mapping) or not isinstance(answer.get("count"), int):
            raise CountUnavailable("/tokenize answered without an integer 'count'")
        self.last_max_model_len = answer.get("max_model_len") or self.last_max_model_len
        return dict(answer)


class TiktokenSource:
    """Approximate counts: tiktoken on each message, plus the ChatML template's measured overheads.

    ``safe`` adds :data:`CROSS_TOKENIZER_MARGIN`, since the backend's own tokenizer may count more.

    Each message is counted once, memoised by its content; each distinct tool set once.
    """

    name = "tiktoken"

    def __init__(self, encoding: str = DEFAULT_ENCODING, maxsize: int = 65536) -> None:
        self._exact = TemplateSource(encoding, incremental=False)
        self._messages: LRUCache[str, int] = LRUCache(maxsize)
        self._tools: LRUCache[str, int] = LRUCache(256)
        self._lock = threading.Lock()
        # the last request's per-message counts, and its context (a snapshot: see TemplateSource._context)
        self._previous: PrefixMemo[int] = PrefixMemo(copy_context=False)
        self._last_context: JsonSnapshot | None = None
        self._last_tools: int | None = None
        self._priming: int | None = None

    def count(self, payload: Payload) -> TokenCount:
        if payload.messages is None:
            total = self._exact.count(payload).total
            return _estimate(total, 0, 1, self.name)
        context = self._snapshot((payload.tools, payload.tool_choice))
        kept, counts = self._previous.common(context, payload.messages)
        # kept > 0 means the same tools as the previous request: their count is reused without hashing
        tools = self._last_tools if kept and self._last_tools is not None else self._tools_tokens(payload)
        counts += [self._message_tokens(m) for m in payload.messages[kept:]]
        self._previous.store(context, payload.messages, kept, counts)
        self._last_tools = tools
        total = sum(counts) + self._reply_priming() + tools
        return _estimate(total, tools, len(counts), self.name)

    def _snapshot(self, context: tuple[Any, Any]) -> tuple[Any, Any]:
        """The previous request's own copy of ``context`` when equal (one comparison), else a new copy."""
        last = self._last_context
        if last is not None and last.matches(context):
            kept: tuple[Any, Any] = last.value  # the same object: the memo behind the count compares by identity
            return kept
        self._last_context = snapshot = JsonSnapshot(context)
        copied: tuple[Any, Any] = snapshot.value
        return copied

    def _message_tokens(self, message: Mapping[str, Any]) -> int:
        key = digest(message, 24)
        with self._lock:
            cached = self._messages.get(key)
        if cached is None:
            cached = self._exact.count(Payload((message,)), ).total - self._reply_priming()
            with self._lock:
                self._messages[key] = cached
        return cached

    def _tools_tokens(self, payload: Payload) -> int:
        if not payload.tools:
            return 0
        key = digest([payload.tools, payload.tool_choice], 24)
        with self._lock:
            cached = self._tools.get(key)
        if cached is None:
            cached = self._exact.count(Payload((), payload.tools, payload.tool_choice)).total - self._reply_priming()
            with self._lock:
                self._tools[key] = cached
        return cached

    def _reply_priming(self) -> int:
        if self._priming is None:
            self._priming = self._exact.count(Payload(())).total
        return self._priming


# cl100k is not the backend's tokenizer: other BPE vocabularies differ by up to ~15% on the same text.
CROSS_TOKENIZER_MARGIN = 0.15


# Beyond the proportional margin, another template may spend a different number of tokens on each
# message's framing (role headers, separators; ChatML written as text costs about 10 in cl100k, a
# special-token header 3 to 5) and on a fixed preamble (a default system prompt, a date line).
PER_MESSAGE_SLACK = 8
FIXED_SLACK = 32


def estimate_interval(total: int, messages: int) -> tuple[int, int]:
    """``(low, high)`` around a cl100k/ChatML estimate: the backend's exact count lies in it when its
    tokenizer counts the same text within :data:`CROSS_TOKENIZER_MARGIN` of cl100k either way and its
    template's framing differs by at most the slacks. ``benchmarks/count_bounds.py`` measures it."""
    slack = FIXED_SLACK + PER_MESSAGE_SLACK * messages
    low = math.floor(total / (1 + CROSS_TOKENIZER_MARGIN)) - slack
    return max(0, low), _with_margin(total) + slack


def _estimate(total: int, tools: int, messages: int, source: str) -> TokenCount:
    low, high = estimate_interval(total, messages)
    return TokenCount(total, _with_margin(total), tools, source, False, low, high)


def _with_margin(total: int) -> int:
    """The tiktoken count raised by the cross-tokenizer margin: the safe figure for clamping."""
    return math.ceil(total * (1 + CROSS_TOKENIZER_MARGIN))


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
