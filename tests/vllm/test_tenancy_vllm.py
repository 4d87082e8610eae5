"""Against a real vLLM 0.32: agentkv's cache_salt rules are the server's, and a caller's salt cannot move a tenant."""

from __future__ import annotations

import uuid

import httpx
import pytest

from agentkv import Backend, Session, WindowDiscovery, derive_cache_salt
from agentkv.tenancy import cache_salt_problem

SECRET = "tier-tenancy-secret"
SALTS = ["", "a/b", "a@b", "a\\b", "a\x00b", "x" * 129, 5, "x" * 128, "é" * 128, "tenant-a",
         derive_cache_salt(SECRET, "t")]


@pytest.mark.parametrize("salt", SALTS)
def test_cache_salt_problem_agrees_with_the_server(vllm_fast, salt):
    """vLLM answers 400 exactly for the salts cache_salt_problem refuses, and 200 for the others."""
    answer = httpx.post(f"{vllm_fast.base_url}/chat/completions", timeout=30, json={
        "model": vllm_fast.model, "max_tokens": 1, "cache_salt": salt,
        "messages": [{"role": "user", "content": f"salt check {uuid.uuid4()}"}]})
    assert answer.status_code == (400 if cache_salt_problem(salt) else 200), answer.text[:300]
    if answer.status_code == 400:
        assert answer.json()["error"]["param"] == "cache_salt"


def test_a_caller_salt_does_not_move_a_tenant_out_of_its_cache_group(vllm_fast):
    """Session(tenant="tenant-B").completion(..., cache_salt="X") hits the blocks tenant-B's salt cached: it went
    out under tenant-B's salt, not "X" (which has nothing cached)."""
    messages = [{"role": "user", "content": f"{uuid.uuid4()} " + "the disk on host seven is slow. " * 40}]
    tenant_salt = derive_cache_salt(SECRET, "tenant-B")
    primed = httpx.post(f"{vllm_fast.base_url}/chat/completions", timeout=60, json={
        "model": vllm_fast.model, "max_tokens": 1, "messages": messages, "cache_salt": tenant_salt})
    assert primed.status_code == 200 and primed.json()["usage"]["prompt_tokens"] >= 256
    fast = Backend(vllm_fast.litellm_model, api_base=vllm_fast.base_url, name="fast")
    with Session(fast, tenant="tenant-B", cache_salt_secret=SECRET, discovery=WindowDiscovery()) as session:
        answer = session.completion(messages=messages, max_tokens=1, cache_salt="X", extra_body={"cache_salt": "X"})
    assert answer.usage.prompt_tokens_details.cached_tokens >= 128
