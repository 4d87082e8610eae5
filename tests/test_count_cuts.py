"""Counts cut at newlines and first words add up only for tokenizers known to split there (tokens/cuts.py)."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agentkv.tokens import ChunkedEncoder, Payload, TemplateSource
from agentkv.tokens.cuts import KNOWN_SPLIT_PATTERNS, config_cuts, tokenizer_cuts
from agentkv.tokens.encodings import get_encoding
from agentkv.tokens.chunked import _CHUNK_BOUNDARY, word_cut
from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# pieces that stress pre-tokenizers: numbers, contractions, CJK, emoji, tabs, NBSP and other Unicode spaces,
# carriage returns, combining marks, indentation, blank lines, JSON
PIECES = ["\n", "\n", "\n\n", "  ", "    ", "\t", " ", "\r", "\r\n", "\u00a0", "\u3000", "\u2028", "\x1c", "\x0b",
          "a", "b c", "Foo", "x", "1", "123", "4567", "1.5", "'s", "'T", "don't", "数据库", "は", "😀", "🎉",
          "e\u0301", "\u0301", "Straße", "{", "},", '"id":', '"inc-7",', "<|im_end|>", "->", "/", "//", "é", "ǅx"]
TEXTS = st.lists(st.sampled_from(PIECES), max_size=24).map("".join)


def cut_points(text):
    """Every place ChunkedEncoder may cut ``text``: chunk starts, and each chunk's first-word cut."""
    points, start = set(), 0
    for chunk in _CHUNK_BOUNDARY.split(text):
        if start:
            points.add(start)
        if word_cut(chunk):
            points.add(start + word_cut(chunk))
        start += len(chunk)
    return sorted(points)


def pieces(text):
    bounds = [0, *cut_points(text), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name", sorted(KNOWN_SPLIT_PATTERNS))
@settings(max_examples=250, deadline=None)
@given(text=TEXTS)
@example(text='"inc-7",\n//x\n/y')
def test_known_split_patterns_never_cross_a_cut(name, text):
    """For each accepted tokenizers Split regex, the pre-tokens of a text are those of its pieces, in order."""
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(KNOWN_SPLIT_PATTERNS[name]), "isolated")
    whole = [p for p, _ in split.pre_tokenize_str(text)]
    assert [p for piece in pieces(text) for p, _ in split.pre_tokenize_str(piece)] == whole


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
@settings(max_examples=400, deadline=None)
@given(text=TEXTS)
@example(text='f();\n// a comment\n  // indented')  # o200k: ";\n//" is one pre-token
def test_tiktoken_encodings_never_cross_a_cut(name, text):
    """cl100k and o200k: a text's token ids are its pieces' ids, in order, and a ChunkedEncoder counts it exactly."""
    enc = get_encoding(name)
    assert tokenizer_cuts(name) == "words"
    assert [t for piece in pieces(text) for t in enc.encode_ordinary(piece)] == enc.encode_ordinary(text)
    assert ChunkedEncoder(enc.encode_ordinary, cuts="words").count(text) == len(enc.encode_ordinary(text))


def _bpe(pre_tokenizer, normalizer=None, merges=(), added=()):
    """A tiny byte-level BPE tokenizer (no download), as transformers wraps it."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in added])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_level(split):
    pre = tokenizers.pre_tokenizers
    return pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def _llama3_like():
    pattern = tokenizers.Regex(KNOWN_SPLIT_PATTERNS["llama3"])
    merges = [("Ġ", "b"), ("Ġb", "a"), ("Ġba", "r"), ("f", "o"), ("fo", "o"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("1", "2")]
    return _bpe(_byte_level(tokenizers.pre_tokenizers.Split(pattern, "isolated")), tokenizers.normalizers.NFC(),
                merges, ["<|im_start|>", "<|im_end|>"])


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_a_llama3_shaped_hf_tokenizer_is_cut_at_words_and_counts_exactly(text):
    """A tokenizers pipeline shaped like Llama-3's or Qwen2's (known Split regex, byte-level BPE, NFC) is
    accepted for word cuts, and its chunked count equals a whole encode."""
    tok = _llama3_like()
    assert tokenizer_cuts(tok) == "words"

    def encode(t):
        return tok.encode(t, add_special_tokens=False)

    assert ChunkedEncoder(encode, cuts="words").count(text) == len(encode(text))


def _newline_only_with_cross_space_merges():
    """Pre-tokens are whole lines; BPE merges "foo bar" into one token across its space."""
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[^\n]*\n?"), "isolated")
    merges = [("f", "o"), ("fo", "o"), ("Ġ", "b"), ("Ġb", "a"), ("Ġba", "r"), ("foo", "Ġbar")]
    return _bpe(_byte_level(split), merges=merges, added=["<|im_start|>", "<|im_end|>"])


def _truth(tok, source, payload):
    return len(tok.encode(source.render(payload), add_special_tokens=False))


def test_a_tokenizer_that_passes_a_first_text_check_is_still_not_cut_unless_known_to_split():
    """A tokenizer whose first text adds up at word cuts, but which merges across a space in a later text,
    is counted exactly on both (cuts come from its declared pipeline, not from a sample)."""
    tok = _newline_only_with_cross_space_merges()
    assert tokenizer_cuts(tok) == "whole"
    source = TemplateSource(tok, CHATML_TOOLS_TEMPLATE)
    first = Payload(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "List the hosts."}))
    later = Payload((*first.messages, {"role": "assistant", "content": "foo bar"}, {"role": "user", "content": "ok"}))
    assert source.count(first).total == _truth(tok, source, first)
    assert source.count(later).total == _truth(tok, source, later)


def test_gpt2_regex_encodings_are_counted_whole():
    """p50k (GPT-2's regex) keeps a run of newlines apart at a text's end and glues a newline to the next line's
    indentation: after a ChatML first text that adds up, a blank line and indented code still count exactly."""
    enc = get_encoding("p50k_base")
    source = TemplateSource("p50k_base")
    first = Payload(({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}))
    later = [Payload((*first.messages, {"role": "tool", "tool_call_id": "c1", "content": content}))
             for content in ("Done.\n\nThanks", "def f():\n    return 1\n")]
    for payload in (first, *later):
        assert source.count(payload).total == len(enc.encode_ordinary(source.render(payload)))


def test_o200k_is_not_cut_before_a_slash_that_starts_a_line():
    """o200k's punctuation pre-token runs on through a newline into slashes (";\n//"): a tool result with
    comment lines and paths counts exactly after a first text that added up."""
    enc = get_encoding("o200k_base")
    source = TemplateSource("o200k_base")
    first = Payload(({"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}))
    code = "int main() {\n  f();\n}\n// done;\n/usr/bin/x:\n/etc\n  // indented"
    later = Payload((*first.messages, {"role": "tool", "tool_call_id": "c1", "content": code}))
    for payload in (first, later):
        assert source.count(payload).total == len(enc.encode_ordinary(source.render(payload)))


def test_sentencepiece_gpt2_and_stripping_pipelines_are_never_cut():
    """Metaspace (Llama-2, Mistral: a prefix on every encode call), GPT-2's byte-level regex, a prefix space,
    an unknown Split regex, NFKC, and added tokens that strip or hold whitespace all count whole texts;
    WordPiece/BERT's whitespace splitting and the cl100k family count at word cuts."""
    pre, norm = tokenizers.pre_tokenizers, tokenizers.normalizers
    known = pre.Split(tokenizers.Regex(KNOWN_SPLIT_PATTERNS["qwen2"]), "isolated")

    def cuts(pre_tokenizer, normalizer=None, added=()):
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.add_tokens(list(added))
        return tokenizer_cuts(tok)

    assert cuts(pre.Metaspace(prepend_scheme="first", split=False)) == "whole"
    assert cuts(pre.Metaspace(prepend_scheme="always")) == "whole"
    assert cuts(pre.ByteLevel(add_prefix_space=False)) == "whole"
    assert cuts(_byte_level(pre.Split(tokenizers.Regex(r" ?\w+|\s+"), "isolated"))) == "whole"
    assert cuts(pre.Sequence([known, pre.ByteLevel(add_prefix_space=True, use_regex=False)])) == "whole"
    assert cuts(_byte_level(known), norm.NFKC()) == "whole"
    assert cuts(_byte_level(known), added=[tokenizers.AddedToken("<x>", rstrip=True)]) == "whole"
    assert cuts(_byte_level(known), added=[tokenizers.AddedToken("\n\n")]) == "whole"
    assert cuts(_byte_level(known), norm.NFC(), added=[tokenizers.AddedToken("<|im_end|>")]) == "words"
    assert cuts(pre.BertPreTokenizer(), norm.BertNormalizer()) == "words"
    assert cuts(pre.WhitespaceSplit(), norm.Sequence([norm.NFD(), norm.StripAccents(), norm.Lowercase()])) == "words"
    assert cuts(None) == "whole" and tokenizer_cuts(object()) == "whole" and tokenizer_cuts("unknown") == "whole"
    assert config_cuts({"pre_tokenizer": {"type": "Sequence", "pretokenizers": []}}) == "whole"


def test_a_bert_wordpiece_tokenizer_counts_exactly_at_word_cuts():
    """WordPiece behind BERT's normalizer and whitespace/punctuation splitter adds up at every cut."""
    vocab = {"[UNK]": 0, "a": 1, "##b": 2, "b": 3, "c": 4, "##c": 5, "foo": 6, "##o": 7, "f": 8, ":": 9, '"': 10}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = tokenizers.normalizers.BertNormalizer()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    assert tokenizer_cuts(tok) == "words"
    texts = ['{\n  "ab": foo\n}\n', "abc cb\n\tfoo  a\r\nb c", "数据 a\n  b   cc\n\n  foo"]
    encoder = ChunkedEncoder(lambda t: tok.encode(t, add_special_tokens=False).ids, cuts="words")
    assert [encoder.count(t) for t in texts] == [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]


def test_a_declared_llama3_shaped_tokenizer_counts_each_turn_incrementally_and_exactly():
    """Turn by turn, a Llama-3-shaped HF tokenizer with a ChatML template is counted incrementally (its cuts are
    known) and every count equals an encode of the full rendering."""
    tok = _llama3_like()
    source = TemplateSource(tok, CHATML_TOOLS_TEMPLATE)
    msgs = [{"role": "system", "content": "You are an SRE agent."}, {"role": "user", "content": "Why is node-7 slow?"}]
    for i in range(8):
        msgs.append({"role": "assistant", "content": f"Step {i}: foo bar."})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": '{\n  "id": "inc-%d",\n  "p99": 12%d\n}' % (i, i)})
        payload = Payload(tuple(msgs))
        assert source.count(payload).total == _truth(tok, source, payload)
    assert source._appended.incremental_turns >= 5
