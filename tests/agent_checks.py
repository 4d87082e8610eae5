"""What the framework tests measure, from the servers' side: the one warm, its tokens, the escalation's cached share."""

from __future__ import annotations

import json
import urllib.request

from conftest import chat_requests

WARM_KEYS = ("messages", "tools", "tool_choice", "chat_template_kwargs")


def tokenize(server, body):
    """The server's own token ids for a chat body (its ``/tokenize``)."""
    request = {"model": server.model_id, **{k: body[k] for k in WARM_KEYS if k in body}}
    req = urllib.request.Request(server.api_base.removesuffix("/v1") + "/tokenize", json.dumps(request).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as answer:
        return json.load(answer)["tokens"]


def the_warm(slow):
    """The one warm-ahead request the slow server received (a one-token, non-streaming chat request)."""
    warms = [b for b in chat_requests(slow) if b.get("max_tokens") == 1 and not b.get("stream")]
    assert len(warms) == 1, f"{len(warms)} warms reached slow"
    return warms[0]


def escalated_request(slow):
    """The first real (not warm) request the slow server received."""
    return next(b for b in chat_requests(slow) if b.get("max_tokens") != 1)


def shared_prefix(a, b):
    """How many leading token ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check_escalation(session, slow, cached_tokens):
    """0 overflows at fast, one warm fired at >= 60% of the fast window, the warm a token prefix of the
    escalation (>= 95% of its tokens) and the escalation's server-reported cached tokens >= 80% of the
    warm's tokens. Returns (cached, warmed) for the report."""
    stats = session.stats()
    assert stats["overflow_errors"] == 0 and stats["warm_fired"] == 1 and stats["escalations"] == 1
    fired = next(row for row in session.ledger if row.warm == "fire")
    assert fired.input_tokens >= 0.6 * 2048
    warm = the_warm(slow)
    warm_ids, escalation_ids = tokenize(slow, warm), tokenize(slow, escalated_request(slow))
    assert shared_prefix(warm_ids, escalation_ids) >= 0.95 * len(warm_ids)
    assert cached_tokens >= 0.8 * len(warm_ids), (cached_tokens, len(warm_ids))
    assert stats["escalations_after_warm"] == 1
    return cached_tokens, len(warm_ids)
