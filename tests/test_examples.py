"""The examples run end to end with --quick, each in its own process, and print what they claim."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXPECTED = {
    "quickstart": r"quickstart: escalated to slow at turn \d+ with \d+ tokens, [1-9]\d* of them already cached",
    "decorator_loop": r"decorator_loop: \d+ model calls, routes fast( fast)* slow, session closed=True",
    "langchain_agent": r"langchain_agent: handler counters \{'observed': \d+, 'blocked': 1,.*router's last route slow",
    "litellm_hook": r"litellm_hook: \d+ calls observed; the escalated call to slow had [1-9]\d* of \d+ prompt tokens",
    "handoff_local": r"handoff_local: mapped_tokens=[1-9]\d* handoff_fallbacks=0",
    "openai_sdk": r"openai_sdk: escalated to slow at turn \d+ with \d+ tokens, [1-9]\d* of them already cached by 1 warm",
    "agents_sdk": r"agents_sdk: \d+ model calls; escalated to slow at turn \d+ with \d+ tokens, [1-9]\d* of them",
    "langgraph_agent": r"langgraph_agent: \d+ model calls; escalated to slow at turn \d+ with \d+ tokens, [1-9]\d* of",
    "conversations_service": r"conversations_service: (\d+) conversations of 3 tenants through one transport, \1 "
                             r"escalations read their own warm",
    "langchain_middleware": r"langchain_middleware: routes \{'fast': \d+, 'slow': \d+\}; the escalation at call \d+ "
                            r"\(\d+ tokens\) read [1-9]\d* cached tokens, (9[5-9]|100)% of the warm's [1-9]\d* "
                            r"full-block tokens .*SummarizationMiddleware.*: [1-9]\d* summary, routes \{'fast': \d+\}$",
    "litellm_provider": r"litellm_provider: smolagents made \d+ calls through agentkv/fast, routes \{'fast': \d+, "
                        r"'slow': \d+\}; the escalation at call \d+ \(\d+ tokens\) read [1-9]\d* cached tokens, "
                        r"(9[5-9]|100)% of the warm's [1-9]\d* full-block tokens",
}


@pytest.fixture(scope="module")
def runs():
    """All examples started at once (one torch thread each, so two cores are shared fairly), then collected."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {name: subprocess.Popen([sys.executable, str(EXAMPLES / f"{name}.py"), "--quick"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name in EXPECTED}
    results = {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        results[name] = (proc.returncode, output)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_prints_its_summary(runs, name):
    """python examples/<name>.py --quick exits 0 and prints its summary line."""
    code, output = runs[name]
    assert code == 0, output[-3000:]
    assert re.search(EXPECTED[name], output, re.MULTILINE), output[-3000:]
