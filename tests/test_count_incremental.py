"""Exact accounting that costs what was appended: incremental template counts equal full renderings."""

import copy
import json

from agentkv.testing import capture_events
from agentkv.tokens import Payload, TemplateSource, TiktokenSource
from agentkv.tokens.incremental import PrefixMemo
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": f"lookup_{i}", "description": "Look a host up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for i in range(6)]


def trace(steps):
    msgs = [{"role": "system", "content": "You are an SRE agent."}, {"role": "user", "content": "Why is node-7 slow?"}]
    for i in range(steps):
        msgs.append({"role": "assistant", "content": f"Step {i}.", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "lookup_1", "arguments": json.dumps({"q": i})}}]})
        rows = [{"id": f"r-{i}-{j}", "msg": "p99 latency\n  rose  after compaction", "n": i * j} for j in range(4)]
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps(rows, indent=1)})
    return msgs


def counts(source, conversations, tools=TOOLS):
    return [source.count(Payload(tuple(m), tuple(tools) if tools else None)).total for m in conversations]


def test_each_appended_turn_counts_exactly_what_a_full_rendering_counts():
    """Turn by turn, the incremental count equals a full render-and-tokenize, and most turns were incremental."""
    msgs = trace(12)
    growing = [msgs[:n] for n in range(1, len(msgs) + 1)]
    incremental, full = TemplateSource("cl100k_base"), TemplateSource("cl100k_base", incremental=False)
    assert counts(incremental, growing) == counts(full, growing)
    assert incremental._appended.incremental_turns >= len(growing) - 3


def test_a_diverged_prefix_falls_back_to_a_full_count():
    """An edited earlier message (even edited in place), other tools, or a shorter history are counted in full."""
    msgs = trace(6)
    source, full = TemplateSource("cl100k_base"), TemplateSource("cl100k_base", incremental=False)
    counts(source, [msgs[:n] for n in range(1, len(msgs) + 1)])
    msgs[3]["content"] = msgs[3]["content"] + " (edited)"  # the caller's own list, mutated in place
    cases = [msgs, msgs[:5], msgs + [{"role": "user", "content": "and?"}]]
    assert counts(source, cases) == counts(full, cases)
    assert counts(source, [msgs], TOOLS[:2]) == counts(full, [msgs], TOOLS[:2])
    assert counts(source, [msgs], None) == counts(full, [msgs], None)


def _with_tool_marker(condition):
    marker = "{%- if " + condition + " %}{{- 'LATEST RESULT\\n' }}{%- endif %}\n{%- endfor %}"
    template = CHATML_TOOLS_TEMPLATE.replace("{%- endfor %}\n{%- if add_generation_prompt", marker + "\n{%- if add_gen")
    assert template != CHATML_TOOLS_TEMPLATE
    return template


def test_a_template_that_rewrites_earlier_turns_is_caught_and_counted_in_full():
    """A template whose rendering of earlier messages changes as messages are appended (and that no marker
    gives away) fails its check, says so, and every count stays exact."""
    template = _with_tool_marker("message.role == 'tool' and message is sameas (messages | last)")
    msgs = trace(5)
    growing = [msgs[:n] for n in range(1, len(msgs) + 1)]
    with capture_events() as events:
        got = counts(TemplateSource("cl100k_base", template), growing)
    assert got == counts(TemplateSource("cl100k_base", template, incremental=False), growing)
    assert [e for e in events if e["event"] == "incremental_count_disabled"]


def test_a_template_that_looks_at_the_last_message_is_never_counted_incrementally():
    """A template using loop.last (as Qwen3's reasoning stripping looks at the last query) is counted in full."""
    template = _with_tool_marker("loop.last and message.role == 'tool'")
    msgs = trace(5)
    growing = [msgs[:n] for n in range(1, len(msgs) + 1)]
    source = TemplateSource("cl100k_base", template)
    assert counts(source, growing) == counts(TemplateSource("cl100k_base", template, incremental=False), growing)
    assert source._appended.incremental_turns == 0


def test_the_estimate_reuses_the_previous_requests_message_counts():
    """The tiktoken estimate of an extended request equals a fresh estimate of it."""
    msgs = trace(8)
    warm, cold = TiktokenSource(), TiktokenSource()
    counts(warm, [msgs[:n] for n in range(1, len(msgs))])
    assert counts(warm, [msgs]) == counts(cold, [msgs])


def test_prefix_memo_finds_the_repeated_messages_and_sees_in_place_edits():
    """The memo counts leading equal messages, treats equal copies as equal and an in-place edit as a change."""
    memo: PrefixMemo[int] = PrefixMemo()
    msgs = trace(2)
    memo.store("ctx", msgs, 0, list(range(len(msgs))))
    assert memo.common("ctx", copy.deepcopy(msgs) + [{"role": "user", "content": "x"}]) == (len(msgs), list(range(6)))
    assert memo.common("other", msgs) == (0, [])
    msgs[2]["tool_calls"][0]["function"]["arguments"] = "{}"
    assert memo.common("ctx", msgs) == (2, [0, 1])


def test_a_template_that_renders_tools_in_later_turns_is_counted_with_them():
    """Appended messages are first rendered without tool schemas; a template that shows them in every user
    turn fails that check and is counted with the schemas, exactly."""
    template = CHATML_TOOLS_TEMPLATE.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '')",
        "{{- '<|im_start|>' + message.role + '\\n' + ('[tools on] ' if tools else '') + (message.content or '')")
    assert template != CHATML_TOOLS_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(8):
        msgs += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    growing = [msgs[:n] for n in range(1, len(msgs) + 1)]
    with capture_events() as events:
        got = counts(TemplateSource("cl100k_base", template), growing)
    assert got == counts(TemplateSource("cl100k_base", template, incremental=False), growing)
    assert [e for e in events if e["event"] == "incremental_count_disabled"]


def test_split_lines_cuts_exactly_where_the_chunk_boundary_regex_cuts():
    """The str.split cutter yields the look-around regex's chunks (as a multiset) on seeded random texts
    with blank lines, tabs, carriage returns and Unicode spaces."""
    import random

    from agentkv.tokens.chunked import _CHUNK_BOUNDARY, split_lines

    rng = random.Random(14)
    alphabet = ["\n", "\n", " ", "\t", "\r", "a", "{", "\u00a0", "\x0b", "\u2028", "x\n", "\n\n", "\n \t ", "/", "\n/"]
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        lines, rest = split_lines(text)
        expected = [c for c in _CHUNK_BOUNDARY.split(text) if c]
        assert sorted([line + "\n" for line in lines] + [c for c in rest if c]) == sorted(expected), repr(text)


def test_tool_schemas_edited_in_place_are_counted_again():
    """The context snapshot is a copy: a tool schema mutated in place between two requests changes the count
    as a fresh source would see it."""
    tools = copy.deepcopy(TOOLS)
    msgs = trace(3)
    source, full = TemplateSource("cl100k_base"), TemplateSource("cl100k_base", incremental=False)
    before = source.count(Payload(tuple(msgs), tuple(tools)))
    tools[2]["function"]["description"] = "Look a host up, with its full incident history and owners."
    after = source.count(Payload(tuple(msgs + [{"role": "user", "content": "more"}]), tuple(tools)))
    expected = full.count(Payload(tuple(msgs + [{"role": "user", "content": "more"}]), tuple(tools)))
    assert (after.total, after.tools) == (expected.total, expected.tools) and after.tools > before.tools


def test_a_line_cut_at_its_first_word_counts_as_the_whole_line():
    """For cl100k and o200k, a line's tokens are those of its first word plus the rest (seeded random lines of
    JSON, code, prose, CJK and emoji), so a new JSON value costs only its own tokens."""
    import random

    from agentkv.tokens.encodings import get_encoding
    from agentkv.tokens.chunked import word_cut

    rng = random.Random(7)
    words = ['"id":', '"inc-39-7",', "return", "x", "*", "2", "数据库", "😀🎉", "naïve", "  ", "\t", "'s", "’t",
             "p99", "1234567", "-->", "", "Straße", "<|im_end|>", "{", "},", "a.b(c)", "\u00a0"]
    for name in ("cl100k_base", "o200k_base"):
        enc = get_encoding(name)
        for _ in range(2000):
            line = rng.choice(["", " ", "  ", "\t"]) + " ".join(rng.choice(words) for _ in range(rng.randint(1, 8)))
            cut = word_cut(line)
            if cut:
                pieces = len(enc.encode_ordinary(line[:cut])) + len(enc.encode_ordinary(line[cut:] + "\n"))
                assert pieces == len(enc.encode_ordinary(line + "\n")), (name, line)


def test_a_tokenizer_whose_words_do_not_add_up_is_counted_without_word_cuts():
    """A tokenizer that merges across spaces (one token per run of text between newlines) fails the first
    call's check: word cuts stay off and every count is still that of the whole text."""
    import re

    from agentkv.tokens import ChunkedEncoder

    def runs(text):
        return re.findall(r"[^\n]+|\n", text)

    encoder = ChunkedEncoder(runs, cuts="words")  # declared wrongly: the first text shows it
    texts = ['{\n  "id": "inc-1",\n  "host": "node-4"\n}\n', '  "id": "inc-2",\n  "host": "node-9"\n', "a b\n\nc d e\n"]
    assert [encoder.count(t) for t in texts] == [len(runs(t)) for t in texts]
    assert encoder.splits_exactly and not encoder._word_cuts


def test_prefix_memo_tells_numbers_of_another_kind_apart():
    """1, 1.0 and True are == in Python but render differently: the memo treats a message or a context whose
    number changed kind (in place) as changed."""
    memo: PrefixMemo[int] = PrefixMemo()
    msgs = [{"role": "user", "content": "a"}, {"role": "tool", "content": "r", "n": 1}, {"role": "user", "content": "b"}]
    ctx = {"default": 1, "flag": True}
    memo.store(ctx, msgs, 0, [1, 2, 3])
    assert memo.common(ctx, msgs) == (3, [1, 2, 3])
    msgs[1]["n"] = 1.0
    assert memo.common(ctx, msgs) == (1, [1])
    msgs[1]["n"] = 1
    ctx["flag"] = 1
    assert memo.common(ctx, msgs) == (0, [])


def test_an_agent_loop_mutating_its_own_lists_in_place_is_counted_and_sent_exactly():
    """An agent that appends to one messages list, edits messages and tool schemas in place (numbers changing
    kind included) and reuses its tools list gets, on every turn, the count a fresh source gives and the tools
    litellm would send, with a declared template and with the estimate."""
    from agentkv import Backend, Session
    from agentkv._session.attempts import as_litellm_sends

    class Recording:
        def __init__(self):
            self.sent = []

        def completion(self, **kwargs):
            self.sent.append(copy.deepcopy(kwargs))
            return {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    def tool(i):
        return {"type": "function", "function": {"name": f"t{i}", "description": "Look up.", "strict": True, "parameters": {
            "type": "object", "properties": {"q": {"type": "number", "default": 1}}, "additionalProperties": False}}}

    def default(value):
        tools[1]["function"]["parameters"]["properties"]["q"]["default"] = value

    def edit(index, text):
        messages[index]["content"] += text

    steps = [lambda: None, lambda: edit(-1, " more"), lambda: tools[0]["function"].update(description="Edited."),
             lambda: tools.append(tool(len(tools))), lambda: edit(1, "!"), lambda: default(1.0), lambda: default(True),
             lambda: tools.pop(), lambda: messages.append({"role": "tool", "tool_call_id": "c", "content": "{\n  \"n\": 2\n}"}),
             lambda: messages[-1].update(n=1), lambda: messages[-1].update(n=1.0), lambda: default(-0.0), lambda: default(0.0)]
    for declared in ("cl100k_base", None):
        tools = [tool(i) for i in range(3)]
        messages = [{"role": "system", "content": "Agent."}, {"role": "user", "content": "go"}]
        client = Recording()
        truth = TemplateSource("cl100k_base", incremental=False) if declared else None
        with Session(Backend("hosted_vllm/m", window=32768, tokenizer=declared), client=client) as session:
            for step in steps:
                step()
                messages.append({"role": "user", "content": "next"})
                session.completion(messages=messages, tools=tools, max_tokens=16)
                sent = as_litellm_sends("hosted_vllm/m", {"tools": copy.deepcopy(tools)})["tools"]
                assert json.dumps(client.sent[-1]["tools"]) == json.dumps(sent)
                payload = Payload(tuple(copy.deepcopy(messages)), tuple(sent))
                fresh = truth.count(payload) if truth else TiktokenSource().count(payload)
                row = session.ledger[-1]
                assert (row.input_tokens, row.tool_tokens) == (fresh.total, fresh.tools), step


def test_the_prefix_report_sees_a_message_the_caller_edited_in_place():
    """An agent that truncates an old tool result in its own messages list between two turns gets a prefix
    report that names that message and a broken prefix (the previous request is kept as it was sent)."""
    from agentkv import Backend, Session

    class Instant:
        def completion(self, **kwargs):
            return {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}

    messages = trace(3)
    with Session(Backend("hosted_vllm/m", window=32768, tokenizer="cl100k_base"), client=Instant()) as session:
        session.completion(messages=messages, max_tokens=4)
        messages[3]["content"] = messages[3]["content"][:40]  # in place: the same dict, a shorter result
        messages.append({"role": "user", "content": "and now?"})
        session.completion(messages=messages, max_tokens=4)
        report = session.prefix_report()
    assert report.divergence_message == 3 and not report.intact
