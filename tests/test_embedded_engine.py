"""The embedded engine: prefix-cache reuse is exact, salts isolate, memory stays in budget, KV moves in and out."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentkv.embedded.engine.codec import TiktokenCodec  # noqa: E402
from agentkv.embedded.engine.decoding import logit_bias  # noqa: E402
from agentkv.embedded.engine import Delta, Generation, LocalEngine  # noqa: E402
from agentkv.embedded.engine.limits import ContextLengthExceeded  # noqa: E402
from agentkv.embedded.engine.models import DEFAULT_WINDOWS, MODEL_SIZES, build_model  # noqa: E402
from agentkv.embedded.engine.sampling import SamplingParams  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant that answers briefly. " * 8},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture
def engine(model):
    return LocalEngine(model, model_id="agentkv-tiny", max_model_len=2048)


def full_prefill_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def test_sizes_share_kv_geometry():
    """Every model size has the same KV heads and head_dim, and large is deeper and wider than small."""
    geometry = {(s["num_key_value_heads"], s["head_dim"]) for s in MODEL_SIZES.values()}
    assert len(geometry) == 1
    small, large = MODEL_SIZES["small"], MODEL_SIZES["large"]
    assert large["num_hidden_layers"] > small["num_hidden_layers"]
    assert large["hidden_size"] > small["hidden_size"]
    assert small["vocab_size"] >= 100277 and DEFAULT_WINDOWS["large"] == 16384


def test_build_model_is_reproducible_from_its_seed():
    """Two models built with the same seed have identical weights; another seed differs."""
    first, second, other = (build_model("tiny", seed=s, vocab_size=256) for s in (1, 1, 2))
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(first.state_dict()[weight], second.state_dict()[weight])
    assert not torch.equal(first.state_dict()[weight], other.state_dict()[weight])


def test_cached_prefix_logits_match_a_full_prefill(engine, model):
    """Next-token logits of a prompt served mostly from cached blocks equal a full prefill's."""
    ids = engine.tokenize_chat(MESSAGES)
    engine.prefill_logits(ids)
    longer = ids + engine.tokenize_prompt(" And of Italy? Answer in one word please.")
    logits, cached = engine.prefill_logits(longer)
    assert cached == len(ids) // 16 * 16 and cached > 0
    torch.testing.assert_close(logits, full_prefill_logits(model, longer), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_matches_a_full_prefill(model):
    """Prefilling in small chunks gives the same logits as one forward pass."""
    engine = LocalEngine(model, max_model_len=2048, prefill_chunk=24)
    ids = engine.tokenize_chat(MESSAGES)
    logits, _ = engine.prefill_logits(ids)
    torch.testing.assert_close(logits, full_prefill_logits(model, ids), rtol=1e-4, atol=1e-4)


def test_a_repeated_prompt_never_reuses_its_final_token(engine):
    """A prompt of exactly whole blocks served again reuses all but its last block, so logits are computed."""
    ids = list(range(1000, 1064))
    engine.prefill_logits(ids)
    _, cached = engine.prefill_logits(ids)
    assert cached == 48


def test_a_repeated_request_reports_cached_tokens_and_the_same_output(engine):
    """The second identical request hits the cache for its full blocks and, greedy, says the same thing."""
    ids = engine.tokenize_chat(MESSAGES)
    first = engine.generate(ids, 6)
    second = engine.generate(ids, 6)
    assert first.cached_tokens == 0
    assert second.cached_tokens == (len(ids) - 1) // 16 * 16
    assert second.token_ids == first.token_ids


def test_generated_blocks_are_cached_for_the_next_turn(engine):
    """A follow-up prompt that extends prompt + reply reuses blocks that were computed while decoding."""
    ids = engine.tokenize_chat(MESSAGES)
    reply = engine.generate(ids, 40)
    follow_up = ids + reply.token_ids + engine.tokenize_prompt("<|im_end|>\n<|im_start|>user\nWhy?")
    assert engine.generate(follow_up, 1).cached_tokens == (len(ids) + 39) // 16 * 16


def test_different_salts_never_hit_each_others_blocks(engine):
    """A prompt cached under one salt is cold under another and under no salt, and warm under its own."""
    ids = engine.tokenize_chat(MESSAGES)
    engine.generate(ids, 1, cache_salt="tenant-a")
    assert engine.generate(ids, 1, cache_salt="tenant-b").cached_tokens == 0
    assert engine.generate(ids, 1).cached_tokens == 0
    assert engine.generate(ids, 1, cache_salt="tenant-a").cached_tokens > 0


def test_cache_memory_stays_within_budget(model):
    """With a budget of a few blocks, many distinct prompts never push the cache past it."""
    engine = LocalEngine(model, max_model_len=2048, cache_budget_bytes=20 * 16 * 2 * 2 * 2 * 64 * 4)
    for i in range(8):
        engine.generate(list(range(2000 + 100 * i, 2000 + 100 * i + 90)), 2)
        stats = engine.stats()
        assert stats.cache_bytes_used <= stats.cache_budget_bytes
    assert engine.prefix_cache.evictions > 0


def test_stream_yields_deltas_then_the_generation(engine):
    """stream() yields one Delta per token whose texts join to the final text, then the Generation."""
    items = list(engine.stream(engine.tokenize_chat(MESSAGES), 8))
    *deltas, result = items
    assert isinstance(result, Generation) and all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == result.text
    assert [d.token_id for d in deltas if d.token_id is not None] == result.token_ids


def test_generation_stops_at_eos(model):
    """When the chosen token is an EOS id, generation stops there with 'stop' and the EOS adds no text."""
    engine = LocalEngine(model, max_model_len=2048)
    ids = engine.tokenize_chat(MESSAGES)
    first = engine.generate(ids, 1).token_ids[0]
    engine.codec.eos_token_ids = frozenset({first})
    result = engine.generate(ids, 10)
    assert result.finish_reason == "stop" and result.token_ids == [first] and result.text == ""


def test_max_tokens_ends_with_length(engine):
    """A request that runs out of max_tokens finishes with 'length' and exactly max_tokens tokens."""
    result = engine.generate(engine.tokenize_chat(MESSAGES), 5)
    assert result.finish_reason == "length" and result.completion_tokens == 5


def test_seeded_sampling_is_reproducible(engine):
    """With temperature > 0 the same seed gives the same tokens."""
    ids = engine.tokenize_chat(MESSAGES)
    first = engine.generate(ids, 8, temperature=1.0, seed=7)
    assert engine.generate(ids, 8, temperature=1.0, seed=7).token_ids == first.token_ids


def test_invalid_utf8_is_replaced_not_raised(engine):
    """Decoding a lone UTF-8 continuation byte token yields U+FFFD instead of an exception."""
    lone_byte = engine.encoding.encode_single_token(bytes([0xA1]))
    assert engine.decode([lone_byte]) == "\ufffd"


def test_sampling_never_picks_undecodable_ids():
    """Ids tiktoken cannot decode (model padding, unused special slots) get a -inf logit bias."""
    codec = TiktokenCodec()
    bias = logit_bias(codec, MODEL_SIZES["small"]["vocab_size"])
    assert torch.isinf(bias[100261]) and torch.isinf(bias[100300])
    assert bias[codec.encoding.eot_token] == 0 and bias[42] == 0


def test_a_prompt_over_the_window_raises_vllms_engine_message(engine):
    """generate() refuses a prompt that leaves no room for one output token, with vLLM's engine-level wording."""
    engine.max_model_len = 64
    with pytest.raises(ContextLengthExceeded, match=r"The decoder prompt \(length \d+\) is longer than the maximum "
                                                    "model length of 64"):
        engine.generate(engine.tokenize_chat(MESSAGES), 10)


def test_generation_stops_at_the_end_of_the_window(engine):
    """A budget past the window is cut at the window ("length"), as vLLM's scheduler caps a request."""
    ids = engine.tokenize_chat(MESSAGES)
    engine.max_model_len = len(ids) + 3
    result = engine.generate(ids, params=SamplingParams(max_tokens=50, ignore_eos=True))
    assert (result.completion_tokens, result.finish_reason) == (3, "length")


def test_cached_prefix_kv_returns_per_layer_tensors(engine):
    """cached_prefix_kv gives [1, kv_heads, n, head_dim] per layer for the cached full blocks."""
    ids = engine.tokenize_chat(MESSAGES)
    engine.generate(ids, 1)
    n, keys, values = engine.cached_prefix_kv(ids)
    assert n == len(ids) // 16 * 16
    assert len(keys) == len(values) == engine.num_layers
    assert keys[0].shape == (1, engine.kv_heads, n, engine.head_dim)


def test_cached_prefix_kv_is_empty_when_nothing_is_cached(engine):
    """With a cold cache the tensors have zero length, not a missing layer."""
    n, keys, _ = engine.cached_prefix_kv(list(range(64)))
    assert n == 0 and keys[0].shape == (1, engine.kv_heads, 0, engine.head_dim)


def test_installed_kv_is_served_to_the_next_request(model):
    """KV installed from another engine makes a request hit the cache and reproduce the donor's logits."""
    donor, target = (LocalEngine(model, max_model_len=2048) for _ in range(2))
    ids = donor.tokenize_chat(MESSAGES)
    donor.prefill_logits(ids)
    n, keys, values = donor.cached_prefix_kv(ids)
    assert target.install_prefix_kv(ids, keys, values, cache_salt="s") == n
    logits, cached = target.prefill_logits(ids, cache_salt="s")
    assert cached == (len(ids) - 1) // 16 * 16
    torch.testing.assert_close(logits, full_prefill_logits(model, ids), rtol=1e-4, atol=1e-4)


def test_install_rejects_kv_of_the_wrong_shape(engine):
    """Installing KV with a different head_dim is refused rather than cached."""
    bad = [torch.zeros(1, engine.kv_heads, 32, engine.head_dim + 1)] * engine.num_layers
    with pytest.raises(ValueError, match="expected"):
        engine.install_prefix_kv(list(range(32)), bad, bad)


def test_stats_count_requests_and_cache_tokens(engine):
    """stats() counts requests, prompt tokens, and prefix-cache queries and hits in tokens."""
    ids = engine.tokenize_chat(MESSAGES)
    engine.generate(ids, 2)
    second = engine.generate(ids, 2)
    stats = engine.stats()
    assert stats.requests_started == 2 and stats.requests_finished == {"length": 2}
    assert stats.prompt_tokens == stats.prefix_cache_queries == 2 * len(ids)
    assert stats.prefix_cache_hits == second.cached_tokens and stats.generation_tokens == 4


def test_an_abandoned_stream_releases_the_engine(engine):
    """Closing a stream part-way frees the lock and counts the request as aborted."""
    ids = engine.tokenize_chat(MESSAGES)
    stream = engine.stream(ids, 20)
    next(stream)
    stream.close()
    assert engine.generate(ids, 1).completion_tokens == 1
    assert engine.stats().requests_finished["abort"] == 1


def test_fair_lock_grants_in_arrival_order():
    """Waiters get a FairLock in the order they asked, and a cancelled waiter leaves the queue without it."""
    import threading
    import time

    from agentkv.embedded.engine.scheduler import FairLock

    lock, order, cancel = FairLock(), [], threading.Event()
    lock.acquire()

    def take(name):
        if lock.acquire(cancel=cancel if name == "gone" else None):
            order.append(name)
            lock.release()

    threads = []
    for name in ("a", "gone", "b", "c"):
        threads.append(threading.Thread(target=take, args=(name,)))
        threads[-1].start()
        while lock.waiting < len(threads):
            time.sleep(0.001)
    cancel.set()
    while lock.waiting > 3:
        time.sleep(0.001)
    lock.release()
    for thread in threads:
        thread.join()
    assert order == ["a", "b", "c"] and lock.acquire(blocking=False)  # and the lock is free again
