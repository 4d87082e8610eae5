"""What the gateway tests share: a gateway in a thread over the embedded servers, the scripted conversation,
and reading what the backends received and what /metrics says."""

from __future__ import annotations

import copy
import json
import os
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentkv.demo.script import TOOLS, ScriptedAgent
from conftest import chat_requests

KEYS = {"sk-acme-1": {"tenant": "acme"}, "sk-globex-1": {"tenant": "globex"}}
ACME, GLOBEX = "sk-acme-1", "sk-globex-1"
SECRET = os.environ["AGENTKV_CACHE_SALT_SECRET"]  # conftest sets it
TOOLS8 = TOOLS[:8]


def config_fields(fresh, tmp_path, **overrides):
    """GatewayConfig keywords for a gateway over the fresh servers, with the test keys file, on a free port."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    fields = dict(fast_url=fresh["fast"].api_base, fast_model=fresh["fast"].model_id, slow_url=fresh["slow"].api_base,
                  slow_model=fresh["slow"].model_id, port=0, api_keys=str(keys))
    fields.update(overrides)
    return fields


def conversation(result_rows=1):
    """The scripted agent's messages, turn after turn (the model's tool calls are scripted)."""
    agent = ScriptedAgent(result_rows=result_rows)
    messages = agent.opening()
    while True:
        yield copy.deepcopy(messages)
        messages += agent.next_turn()


def warms(server):
    """The one-token warm-ahead requests a server received."""
    return [b for b in chat_requests(server) if b.get("max_tokens") == 1 and not b.get("stream")]


def routed(server):
    """The requests a server received that were not warms."""
    return [b for b in chat_requests(server) if b.get("max_tokens") != 1]


def wait_for(predicate, what, timeout_s=60.0):
    """Poll ``predicate`` until it holds; fail the test (naming ``what``) if it never does."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.02)


def metric(root, name, **labels):
    """A sample's value from ``GET /metrics`` (0.0 when absent)."""
    text = httpx.get(root + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def aborted(server):
    """How many requests the embedded engine has aborted."""
    return server.engine.stats().requests_finished.get("abort", 0)
