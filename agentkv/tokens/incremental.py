"""What the previous request of a conversation was, so the next one costs only what it appended.

:class:`PrefixMemo` keeps structural copies of the previous request's messages and of its context
(tool schemas, tool choice, template arguments) and finds, for a new request, how many leading
messages it repeats. Comparing a message with its stored copy costs little when the caller appends
to the same list (the strings are the same objects, so ``==`` stops at their identity), and stays
correct when a message was edited in place (the stored copy still holds the old value).

    memo = PrefixMemo()
    k = memo.common(context, messages)       # leading messages equal to the previous request's
    ...                                      # count messages[k:] only
    memo.store(context, messages, k, figure)
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

__all__ = ["AppendCounter", "JsonSnapshot", "PrefixMemo", "appends_cleanly", "numbers", "same_json", "snapshot"]

F = TypeVar("F")


class PrefixMemo(Generic[F]):
    """The previous request (messages and context) with one figure per message boundary.

    ``figures[i]`` is what the caller computed for ``messages[:i + 1]`` (a cumulative count, a
    per-message count, ...); after a divergence at message ``k`` only ``figures[:k]`` are kept.
    """

    def __init__(self, *, copy_context: bool = True) -> None:
        # copy_context=False: the caller passes contexts it never mutates (snapshots), stored as given and
        # compared by identity: the caller hands the same snapshot again while its context is unchanged as JSON
        # (``==`` would take a new snapshot holding 1.0 where the old one held 1 for the same)
        self._copy_context = copy_context
        self._lock = threading.Lock()
        self._context: Any = None
        self._context_numbers: list[tuple[tuple[Any, ...], Any]] = []
        self._messages: list[Any] = []
        self._numbers: list[tuple[int, tuple[Any, ...], Any]] = []  # (message index, path, number), in order
        self._figures: list[F] = []

    def common(self, context: Any, messages: Sequence[Any]) -> tuple[int, list[F]]:
        """How many leading ``messages`` equal the previous request's, and their figures (0 and [] when
        the context changed)."""
        with self._lock:
            stored = self._messages
            if not stored or not self._same_context(context):
                return 0, []
            n = min(len(stored), len(messages))
            if stored[:n] == list(messages[:n]):  # the usual append: one comparison at C speed
                k = n
            else:
                k = next((i for i, (kept, message) in enumerate(zip(stored, messages)) if kept != message), n)
            k = self._numbers_agree(messages, k)
            return k, self._figures[:k]

    def _numbers_agree(self, messages: Sequence[Any], k: int) -> int:
        """``k``, or the first message before it holding a number of another kind than its stored copy's
        (equal by ``==``, not as JSON: see :func:`same_json`)."""
        for index, path, number in self._numbers:
            if index >= k:
                break
            if not _same_number(_at(messages[index], path), number):
                return index
        return k

    def store(self, context: Any, messages: Sequence[Any], kept: int, figures: Sequence[F]) -> None:
        """Remember ``messages`` (the first ``kept`` are known equal to the stored ones) and one figure
        per message."""
        if len(figures) != len(messages):
            raise ValueError(f"{len(figures)} figures for {len(messages)} messages")
        with self._lock:
            same_context = kept > 0 and self._same_context(context)
            head = self._messages[:kept] if same_context else []
            if not same_context:
                self._context = context if not self._copy_context else snapshot(context)
                self._context_numbers = numbers(self._context) if self._copy_context else []
            added = [snapshot(m) for m in messages[len(head):]]
            self._numbers = [entry for entry in self._numbers if entry[0] < len(head)] if head else []
            self._numbers += [(len(head) + i, path, number) for i, m in enumerate(added) for path, number in numbers(m)]
            self._messages = head + added
            self._figures = list(figures)

    def _same_context(self, context: Any) -> bool:
        if not self._copy_context:
            return self._context is context
        return same_json(self._context, self._context_numbers, context)

    def clear(self) -> None:
        with self._lock:
            self._context, self._messages, self._figures, self._numbers = None, [], [], []


_ATOMS = (str, int, float, bool, type(None))


def snapshot(value: Any) -> Any:
    """A deep copy of JSON-shaped data (plain dicts and lists rebuilt, immutable leaves shared) at a fraction of
    ``copy.deepcopy``'s cost; anything else is deep-copied."""
    kind = type(value)
    if kind is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if kind is list:
        return [snapshot(v) for v in value]
    if kind is tuple:
        return tuple(snapshot(v) for v in value)
    if kind in _ATOMS:
        return value
    return copy.deepcopy(value)


class JsonSnapshot:
    """A deep copy of JSON-shaped data (:func:`snapshot`) and where it holds numbers, kept to tell whether a
    later value still renders the same (:meth:`matches`, :func:`same_json`) after its owner edited it in place."""

    __slots__ = ("numbers", "value")

    def __init__(self, value: Any) -> None:
        self.value = snapshot(value)
        self.numbers = numbers(self.value)

    def matches(self, value: Any) -> bool:
        """Whether ``value`` renders to the same JSON as the copy."""
        return same_json(self.value, self.numbers, value)


def numbers(value: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """Where JSON-shaped ``value`` holds a number or a bool, and which one (see :func:`same_json`)."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    _numbers(value, (), found)
    return found


def _numbers(value: Any, path: tuple[Any, ...], found: list[tuple[tuple[Any, ...], Any]]) -> None:
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            _numbers(item, (*path, key), found)
    elif kind is list or kind is tuple:
        for index, item in enumerate(value):
            _numbers(item, (*path, index), found)
    elif kind is int or kind is float or kind is bool:
        found.append((path, value))


def same_json(stored: Any, stored_numbers: list[tuple[tuple[Any, ...], Any]], value: Any) -> bool:
    """``stored == value`` as the JSON they render to: ``==`` takes 1, 1.0 and True for one another (and -0.0
    for 0.0), so each of ``stored``'s numbers (:func:`numbers`) is also compared by kind. Equal structures
    compare at C speed; only the few numbers are looked up one by one."""
    if stored != value:
        return False
    try:
        return all(_same_number(_at(value, path), number) for path, number in stored_numbers)
    except (LookupError, TypeError):  # numbers of another snapshot (a race): not known equal
        return False


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _same_number(current: Any, number: Any) -> bool:
    return type(current) is type(number) and (type(number) is not float or repr(current) == repr(number))


# Incremental counts are checked against a full rendering on the first turns of each template (and of
# each set of roles appended: a user turn is checked apart from tool results), then on one turn in
# SPOT_CHECK_EVERY: a template whose rendering of earlier messages changes as messages are appended
# is caught and counted in full from then on.
VERIFY_FIRST = 4
SPOT_CHECK_EVERY = 64

# Templates that look at a message's position from the end (``loop.last``, the last user query as in
# Qwen3's reasoning stripping, the message count) render earlier messages differently as the
# conversation grows: they are counted in full without trying.
POSITION_MARKERS = ("loop.last", "loop.revindex", "loop.length", "loop.nextitem", "messages|length",
                    "messages | length", "messages[-", "last_query", "namespace(", "reasoning_content")


def appends_cleanly(template: str) -> bool:
    """False for a template that visibly renders a message by its position from the end."""
    return not any(marker in template for marker in POSITION_MARKERS)

_VERIFIED: dict[str, int] = {}
_BROKEN: set[str] = set()
_STATE_LOCK = threading.Lock()


class AppendCounter:
    """Exact counts of a chat rendering that render and tokenize only the messages a turn appended.

    ``render(messages, context, add_generation_prompt)`` is the template (``context`` is a snapshot the caller
    never mutates: it is kept as given and compared by identity first); ``count_text`` tokenizes
    (and must count a concatenation cut at a newline before a non-space as the sum of its parts: the
    :class:`~agentkv.tokens.ChunkedEncoder` guarantee); ``template_key`` names the template and
    tokenizer for the once-per-template check. :meth:`count` returns None when it cannot count
    exactly this way (a template that failed its check, a rendering that does not split cleanly):
    the caller then counts in full. Prefix figures are kept only where the rendering ends with a
    newline, so that every cut is a pre-token boundary.
    """

    def __init__(self, render: Callable[[Sequence[Any], Any, bool], str], count_text: Callable[[str], int],
                 template_key: str, lean: Callable[[Any], Any] | None = None) -> None:
        self._render = render
        self._count_text = count_text
        self._key = template_key
        # ``lean(context)``: the context without what only the first message renders (tool schemas), tried
        # for the appended messages first; its own checks fall back to the whole context
        self._lean = lean
        self._lean_anchor: str | None = None
        self.enabled = True
        self._memo: PrefixMemo[int | None] = PrefixMemo(copy_context=False)
        self._anchor: tuple[str, str, int] | None = None  # rendering of messages[:1], closing, its tokens
        self._turns = 0
        self._lock = threading.Lock()
        self.incremental_turns = 0

    def count(self, messages: Sequence[Any], context: Any) -> int | None:
        """The exact count of ``messages`` rendered with the generation prompt, or None (count in full)."""
        if not self.enabled or self._key in _BROKEN:
            return None
        with self._lock:  # one request at a time: the memo and the anchor move together
            return self._count(messages, context)

    def _count(self, messages: Sequence[Any], context: Any) -> int | None:
        k, figures = self._memo.common(context, messages)
        base = _last_known(figures)
        if base == 0 or self._anchor is None:
            return self._full(messages, context, k)
        prefix = figures[base - 1]
        assert prefix is not None
        anchor, closing, closing_tokens = self._anchor
        key, delta_context = self._variant(context)
        if key != self._key and self._lean_anchor is not None:
            anchor = self._lean_anchor
        delta = ""
        if base < len(messages):
            rendered = self._render([messages[0], *messages[base:]], delta_context, False)
            if not rendered.startswith(anchor):
                return self._full(messages, context, k)
            delta = rendered[len(anchor):]
        if not (_joins("\n", delta) and _joins(delta or "\n", closing)):  # the prefix ends with a newline
            return self._full(messages, context, k)
        cumulative = prefix + (self._count_text(delta) if delta else 0)
        total = cumulative + closing_tokens
        checked = f"{key}|{','.join(sorted({str(m.get('role')) for m in messages[base:]}))}"
        if self._check_due(checked) and not self._verified(key, checked, messages, context, total):
            return None
        last = cumulative if not delta or delta.endswith("\n") else None
        self._memo.store(context, messages, k, [*figures[:base], *[None] * (len(messages) - base - 1), last]
                         if base < len(messages) else figures[:len(messages)])
        self.incremental_turns += 1
        return total

    def _full(self, messages: Sequence[Any], context: Any, kept: int) -> int | None:
        """Count in full, remembering the prefix figure when the rendering splits cleanly."""
        whole = self._render(messages, context, True)
        bare = self._render(messages, context, False)
        anchor = self._render(messages[:1], context, False)
        anchor_closing = self._render(messages[:1], context, True)
        closing = whole[len(bare):]
        if not (whole.startswith(bare) and anchor_closing == anchor + closing and _joins(bare, closing)):
            self._memo.clear()
            return None
        cumulative = self._count_text(bare)
        self._anchor = (anchor, closing, self._count_text(closing) if closing else 0)
        self._lean_anchor = self._render(messages[:1], self._lean(context), False) if self._lean else None
        last = cumulative if bare.endswith("\n") else None
        self._memo.store(context, messages, kept, [*[None] * (len(messages) - 1), last])
        return cumulative + self._anchor[2]

    def _variant(self, context: Any) -> tuple[str, Any]:
        """The check key and the context to render appended messages with: lean while it holds."""
        lean = f"{self._key}|lean"
        if self._lean is None or lean in _BROKEN:
            return self._key, context
        return lean, self._lean(context)

    def _check_due(self, checked: str) -> bool:
        """Due on the first turns of each (template, variant, roles appended), then one in SPOT_CHECK_EVERY."""
        self._turns += 1
        with _STATE_LOCK:
            return _VERIFIED.get(checked, 0) < VERIFY_FIRST or self._turns % SPOT_CHECK_EVERY == 0

    def _verified(self, key: str, checked: str, messages: Sequence[Any], context: Any, total: int) -> bool:
        full = self._count_text(self._render(messages, context, True))
        with _STATE_LOCK:
            if full == total:
                _VERIFIED[checked] = _VERIFIED.get(checked, 0) + 1
                return True
            _BROKEN.add(key)
        from agentkv.events import emit

        emit("incremental_count_disabled", level="warning", template=key[-17:], full=full, incremental=total)
        self._memo.clear()
        return False


def _last_known(figures: Sequence[Any]) -> int:
    """How many leading messages the last known figure covers (0 when none is known)."""
    for i in range(len(figures) - 1, -1, -1):
        if figures[i] is not None:
            return i + 1
    return 0


def _joins(left: str, right: str) -> bool:
    """True when tokenizing ``left + right`` counts as tokenizing each: a cut after a newline, before a
    non-space character other than "/" (a pre-token boundary of the cl100k-style splitters,
    :mod:`agentkv.tokens.cuts`), or an empty side."""
    return not left or not right or (left.endswith("\n") and not right[0].isspace() and right[0] != "/")
