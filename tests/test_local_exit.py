"""Exiting Python while an embedded engine is mid-request (a warm-ahead, say) exits cleanly."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    from agentkv import Session
    from agentkv.local.server import LocalServer
    from agentkv.scripted import ScriptedAgent, TOOLS

    fast = LocalServer.from_size("tiny", window=2048, model_id="f").start()
    slow = LocalServer.from_size("small", window=16384, model_id="s").start()
    agent = ScriptedAgent(result_rows=8)
    messages = agent.opening() + agent.next_turn()
    s = Session(fast.backend(name="fast"), slow.backend(name="slow"))
    s.completion(messages=messages, tools=TOOLS[:8], max_tokens=2)
    print(s.ledger[-1].warm, flush=True)    # the warm is now prefilling on slow; the script ends here
''')


def test_exit_with_a_request_in_flight_does_not_abort():
    """The interpreter waits for the engine's in-flight request instead of aborting in torch teardown."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180,
                          env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.stdout.strip().endswith("fire"), done.stdout + done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
