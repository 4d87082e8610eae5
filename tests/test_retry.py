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
    """A 503 is retried, each wait longer than the one before (exponential backoff, no jitter)."""
    policy = RetryPolicy(attempts=3, initial_s=1.0, jitter_s=0.0)
    waits = [policy.retry_after(Status(503), tries=n, limit=3) for n in (1, 2)]
    assert waits == [1.0, 2.0]


def test_attempts_are_bounded():
    """The last try's failure is not retried: the send gives up with its error."""
    policy = RetryPolicy(attempts=2)
    assert policy.retry_after(Status(500), tries=1, limit=policy.limit()) is not None
    assert policy.retry_after(Status(500), tries=2, limit=policy.limit()) is None


def test_bad_request_is_not_retried():
    """A 400 is never retried."""
    assert RetryPolicy().retry_after(Status(400), tries=1, limit=3) is None


def test_a_429_is_retried_and_the_wait_is_capped():
    """A 429 is transient; no wait is ever longer than max_s."""
    policy = RetryPolicy(attempts=10, initial_s=1.0, max_s=3.0, jitter_s=0.0)
    assert [policy.retry_after(Status(429), tries=n, limit=10) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]


def test_a_call_takes_at_most_the_tries_it_is_given_and_never_more_than_the_policy():
    """limit(left) lowers the bound for one send (what is left of a turn's tries); it never raises it; a policy that
    does not retry gives each send one try."""
    policy = RetryPolicy(attempts=3)
    assert [policy.limit(given) for given in (1, 2, 10, None)] == [1, 2, 3, 3]
    assert RetryPolicy(retry_transient=False).limit(3) == 1


def test_a_turn_closes_a_backend_that_is_down_refused_it_or_had_its_tries():
    """TurnTries says why a backend takes no more of a turn; a refusal closes it only where refusals count."""
    from agentkv.retry import TurnTries

    turn = TurnTries()
    assert turn.closed("fast", 3) == "" and turn.left("fast", 3) == 3
    turn.refused.add("fast")
    assert turn.closed("fast", 3) == "refused this request as too long"
    assert turn.closed("fast", 3, refusal_closes=False) == ""
    turn.sent["fast"] += 3
    assert turn.closed("fast", 3, refusal_closes=False) == "has had its 3 tries this turn"
    turn.down.add("slow")
    assert turn.closed("slow", 3) == "is down this turn"


@pytest.mark.parametrize("timeouts", [False, True])
def test_a_read_timeout_is_an_outage_only_when_asked(timeouts):
    """A timeout under the wrapper (litellm's Timeout over httpx's ReadTimeout) is transient, and an outage only with
    timeouts=True; a connect timeout is always one."""
    from agentkv.retry import is_outage

    class ReadTimeout(Exception):
        pass

    class ConnectTimeout(Exception):
        pass

    class Timeout(Exception):
        status_code = 408

    for cause, always in ((ReadTimeout("read"), False), (ConnectTimeout("connect"), True)):
        try:
            try:
                raise cause
            except Exception as inner:
                raise Timeout("litellm.Timeout") from inner
        except Timeout as error:
            assert is_transient(error) and is_outage(error, timeouts=timeouts) is (always or timeouts)
