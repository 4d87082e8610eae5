"""A warm stuck on a server that never answers cannot hang closing the Session or exiting Python."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import socket
    from agentkv import Backend, RoutePolicy, Session, WarmAheadPolicy, WindowDiscovery
    from agentkv.testing import FakeHttp, models_answer

    hole = socket.socket(); hole.bind(("127.0.0.1", 0)); hole.listen(8)   # accepts, never answers
    base = f"http://127.0.0.1:{hole.getsockname()[1]}/v1"
    slow = Backend("hosted_vllm/big", api_base=base, name="slow", window=100000)
    discovery = WindowDiscovery(http=FakeHttp(lambda method, url, body: models_answer("big", 100000)))

    class Answers:
        def completion(self, **kw):
            if kw["api_base"] == base:
                import litellm
                return litellm.completion(**kw)    # the warm: real litellm into the black hole
            return {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "usage": {}}

    fast = Backend("hosted_vllm/small", api_base="http://127.0.0.1:9/v1", name="fast", window=400)
    s = Session(fast, slow, discovery=discovery, client=Answers(), count_with_server=False,
                routing=RoutePolicy(output_floor=16, min_output=16), warm_ahead=WarmAheadPolicy(timeout_s=3600))
    s.completion(messages=[{"role": "user", "content": "word " * 250}], max_tokens=4)
    assert s.last_route.backend == "fast", s.last_route
    assert s.stats()["warm_fired"] == 1, s.stats()
    hole.settimeout(30)
    conn, _ = hole.accept()              # the warm has connected: it is in flight, waiting for an answer
    s.close()
    print("closed", flush=True)
''')


def test_exit_does_not_wait_for_a_stuck_warm():
    """The interpreter exits after close while a warm hangs on a silent socket: the warm's timeout is an hour, and
    the process is given two minutes (litellm's import is most of what it needs), so an exit that waited for the
    warm would not end at all."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "closed" in done.stdout
