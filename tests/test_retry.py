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


def test_a_call_takes_at_most_the_tries_it_is_given_and_never_more_than_the_policy():
    """attempts= lowers the bound for one call (what is left of a turn's tries); it never raises it."""
    calls = []

    def failing():
        calls.append(1)
        raise Status(503)

    policy = RetryPolicy(attempts=3, sleep=lambda s: None)
    for given, expected in ((1, 1), (2, 2), (10, 3), (None, 3)):
        calls.clear()
        with pytest.raises(Status):
            policy.call(failing, attempts=given)
        assert len(calls) == expected


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
