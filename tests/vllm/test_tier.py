"""The tier itself: real vLLM 0.32 servers with the properties the other tier tests rely on."""

from __future__ import annotations

import uuid

import httpx


def _chat(server, messages, **body):
    answer = httpx.post(server.base_url + "/chat/completions", timeout=60,
                        json={"model": server.model, "messages": messages, "max_tokens": 1, **body})
    answer.raise_for_status()
    return answer.json()


def test_servers_are_real_vllm_032(vllm_fast, vllm_slow):
    """Both servers answer with vLLM 0.32's system fingerprint and report the tier's windows."""
    for server in (vllm_fast, vllm_slow):
        reply = _chat(server, [{"role": "user", "content": f"fingerprint {uuid.uuid4()}"}])
        assert reply["system_fingerprint"].startswith("vllm-0.32.0")
        models = httpx.get(server.base_url + "/models", timeout=10).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(server.model, server.window)]


def test_cpu_prefix_cache_blocks_are_128_tokens(vllm_fast):
    """A repeated prompt is served from cache in whole 128-token blocks (the CPU backend's block size)."""
    text = f"{uuid.uuid4()} " + "the quick brown fox jumps over the lazy dog " * 60
    messages = [{"role": "user", "content": text}]
    first = _chat(vllm_fast, messages, cache_salt=f"tier-{uuid.uuid4().hex}")
    salt = f"tier-{uuid.uuid4().hex}"
    _chat(vllm_fast, messages, cache_salt=salt)
    again = _chat(vllm_fast, messages, cache_salt=salt)
    prompt, cached = again["usage"]["prompt_tokens"], again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] == prompt > 256
    assert cached % 128 == 0 and prompt - 128 <= cached < prompt


def test_content_parts_are_joined_with_newlines(vllm_fast):
    """The tier's template takes content only as a string, so vLLM joins text parts with a newline."""
    parts = [{"type": "text", "text": "alpha beta"}, {"type": "text", "text": "gamma delta"}]
    listed = _chat(vllm_fast, [{"role": "user", "content": parts}])["usage"]["prompt_tokens"]
    joined = _chat(vllm_fast, [{"role": "user", "content": "alpha beta\ngamma delta"}])["usage"]["prompt_tokens"]
    assert listed == joined


def test_tokenizer_is_far_from_cl100k(vllm_fast):
    """English costs the tier's tokenizer at least 1.5x what cl100k counts (the estimate's prior is wrong)."""
    from agentkv.tokens.encodings import get_encoding

    text = "Please summarise the deployment notes and tell me which services restarted overnight. " * 20
    served = httpx.post(vllm_fast.root + "/tokenize", timeout=30,
                        json={"model": vllm_fast.model, "prompt": text, "add_special_tokens": False}).json()["count"]
    assert served >= 1.5 * len(get_encoding("cl100k_base").encode(text))
