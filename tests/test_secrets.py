"""No secret in a repr, an error message or an event: api keys, URL credentials and salts stay out."""

from __future__ import annotations

import asyncio
import socket

import pytest

from agentkv import Backend, Session
from agentkv.http.transport import HttpError, HttpxTransport, redact_url
from agentkv.testing import FakeHttp, capture_events, models_answer
from agentkv.tokens import TokenCounter, payload_from_request

KEY, PASSWORD = "sk-live-0123456789abcdef", "hunter2-pw"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_backend_repr_has_no_api_key_and_no_url_password():
    """repr(Backend) (tracebacks, assertion output) shows neither the api_key nor user:password@ nor header secrets."""
    backend = Backend("hosted_vllm/m", api_base=f"http://admin:{PASSWORD}@10.0.0.5:8000/v1", api_key=KEY,
                      completion_kwargs={"extra_headers": {"Authorization": f"Bearer {KEY}"}, "max_tokens": 64})
    for text in (repr(backend), str(backend), f"{backend}", repr([backend])):
        assert KEY not in text and PASSWORD not in text and "admin" not in text
    assert "http://10.0.0.5:8000/v1" in repr(backend) and "'max_tokens': 64" in repr(backend)


def test_attempt_repr_has_no_api_key_and_no_salt():
    """The Attempt a Session prepares reprs without the backend's key, a caller's api_key kwarg or the tenant's salt."""
    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    fast = Backend("hosted_vllm/m", api_base="http://127.0.0.1:9/v1", api_key=KEY, window=4096)
    with Session(fast, tenant="acme", cache_salt_secret="k", http=http, count_with_server=False) as session:
        attempt = session.prepare({"model": "m", "messages": [{"role": "user", "content": "hi"}], "api_key": KEY,
                                   "extra_headers": {"x-api-key": KEY}})
        salt = session._parts.cache_salt
    text = repr(attempt)
    assert salt and KEY not in text and salt not in text
    assert "'content': 'hi'" in text and "decision=" in text


@pytest.mark.parametrize("url", [
    "http://admin:{pw}@127.0.0.1:{port}/v1/models",
    "http://admin:{pw}@127.0.0.1:{port}/v1/models?key=1",
    "http://admin:p@ss/{pw}@127.0.0.1:{port}/v1/models",
])
def test_http_error_messages_strip_url_credentials_sync_and_async(url):
    """An unreachable server's HttpError names the URL without user:password@, on both paths."""
    url = url.format(pw=PASSWORD, port=_closed_port())
    http = HttpxTransport()
    with pytest.raises(HttpError) as sync_error:
        http.request("GET", url, timeout_s=2.0)

    async def fetch() -> None:
        await http.arequest("GET", url, timeout_s=2.0)

    with pytest.raises(HttpError) as async_error:
        asyncio.run(fetch())
    for error in (sync_error.value, async_error.value):
        assert PASSWORD not in str(error) and "admin" not in str(error) and "127.0.0.1" in str(error)


def test_http_error_status_messages_strip_url_credentials(servers):
    """A 404 from a live server is reported as '404 from http://host/...' without the credentials."""
    fast, _ = servers
    root = fast.api_base.replace("http://", f"http://admin:{PASSWORD}@")
    with pytest.raises(HttpError) as error:
        HttpxTransport().request("GET", root + "/no-such-route", timeout_s=5.0)
    assert error.value.status_code == 404 and PASSWORD not in str(error.value) and "admin" not in str(error.value)


def test_count_events_carry_no_url_credentials():
    """/tokenize failing on a backend whose api_base has credentials logs an event without them."""
    backend = Backend("hosted_vllm/m", api_base=f"http://admin:{PASSWORD}@127.0.0.1:{_closed_port()}/v1")
    counter = TokenCounter.for_backend(backend, http=HttpxTransport(), estimate_first=False)
    with capture_events() as events:
        counter.count(payload_from_request({"messages": [{"role": "user", "content": "hello"}]}))
    reasons = [str(e.get("reason")) for e in events if e["event"] == "count_source_unavailable"]
    assert reasons and all(PASSWORD not in r and "admin" not in r for r in reasons)


def test_redact_url_keeps_urls_without_credentials():
    """A URL without userinfo keeps its scheme, host, port and path; the userinfo and the query string go (a key may
    ride in either)."""
    assert redact_url("http://h:1/v1/models?x=a@b") == "http://h:1/v1/models"
    assert redact_url("https://u:p@h/v1") == "https://h/v1"
