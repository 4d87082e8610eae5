"""Transient errors are retried with backoff on an injected sleep; nothing else is."""

import pytest

from agentkv.retry import RetryPolicy, is_transient


class Status(Exception):
    def __init__(self, code):
        super().__init__(f"status {code}")
        self.status_code = code


class APIConnectionError(Exception):
    pass


@pytest.mark.parametrize("error,expected", [
    (Status(408), True), (Status(429), True), (Status(500), True), (Status(503), True),
    (Status(400), False), (Status(404), False),
    (APIConnectionError("reset"), True), (TimeoutError(), True), (ValueError("x"), False),
])
def test_transient_classification(error, expected):
    """429, 5xx, timeouts and connection errors are transient; other 4xx and errors are not."""
    assert is_transient(error) is expected


def test_transient_error_is_retried_with_growing_sleeps():
    """A 503 twice then success takes three attempts and two injected sleeps that grow."""
    sleeps, calls = [], []
    policy = RetryPolicy(attempts=3, initial_s=1.0, jitter_s=0.0, sleep=sleeps.append)

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise Status(503)
        return "ok"

    assert policy.call(flaky) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2 and sleeps[1] > sleeps[0]


def test_attempts_are_bounded():
    """A server that keeps failing raises its error after the last attempt."""
    policy = RetryPolicy(attempts=2, sleep=lambda s: None)
    with pytest.raises(Status):
        policy.call(lambda: (_ for _ in ()).throw(Status(500)))


def test_bad_request_is_not_retried():
    """A 400 is raised at once, without sleeping."""
    sleeps = []
    with pytest.raises(Status):
        RetryPolicy(sleep=sleeps.append).call(lambda: (_ for _ in ()).throw(Status(400)))
    assert sleeps == []


async def test_async_retry_awaits_and_retries():
    """The async twin awaits the call and retries on the injected async sleep."""
    calls = []

    async def no_sleep(seconds):
        calls.append(("sleep", seconds))

    async def flaky():
        calls.append("call")
        if calls.count("call") < 2:
            raise Status(429)
        return 7

    assert await RetryPolicy(asleep=no_sleep).acall(flaky) == 7
    assert calls.count("call") == 2
