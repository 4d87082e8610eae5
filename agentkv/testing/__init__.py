"""What tests of agents that use agentkv need: the HTTP seam served by a function, a clock that moves when told,
agentkv's events captured, scripted replies for random-weight models, fakes of hosted providers' APIs, and servers.

    from agentkv.testing import FakeClock, FakeHttp, capture_events, models_answer

    http = FakeHttp(lambda method, url, body: models_answer("m", 4096))
    with capture_events() as events:
        Session(fast, slow, http=http, discovery=WindowDiscovery(http=http)).completion(messages=messages)
    assert any(e["event"] == "route" for e in events)

- :mod:`agentkv.testing.http`: :class:`FakeHttp` (the one HTTP seam, sync, async and raw), :func:`models_answer`;
- :mod:`agentkv.testing.clock`: :class:`FakeClock`; :mod:`agentkv.testing.events`: :func:`capture_events`;
- :mod:`agentkv.testing.scripted`: :class:`ScriptedReplies` (litellm) and :class:`ScriptedTransport` (httpx);
- :mod:`agentkv.testing.providers`: fakes of Anthropic's, OpenAI's and Gemini's APIs with their documented prompt
  caching, on 127.0.0.1, for litellm's real provider code;
- :mod:`agentkv.testing.servers`: servers started for a ``with`` block (:func:`~agentkv.testing.servers.embedded_servers`
  loads torch, :func:`~agentkv.testing.servers.redis_server` runs the binary): imported only where used.

Importing this package imports neither torch, nor redis, nor litellm, and starts nothing.
"""

from agentkv.testing.clock import FakeClock
from agentkv.testing.events import capture_events
from agentkv.testing.http import FakeAnswer, FakeHttp, HttpCall, models_answer
from agentkv.testing.scripted import ScriptedReplies, ScriptedTransport

__all__ = ["FakeAnswer", "FakeClock", "FakeHttp", "HttpCall", "ScriptedReplies", "ScriptedTransport",
           "capture_events", "models_answer"]
