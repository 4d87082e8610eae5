"""The README's main command works: `agentkv demo --quick` runs end to end."""

import subprocess
import sys


def test_demo_quick_shows_a_proactive_route_and_writes_a_plot(tmp_path):
    """The quick demo prints a table with a proactive route, the headline, and writes its PNG."""
    out = tmp_path / "demo.png"
    done = subprocess.run([sys.executable, "-m", "agentkv.cli", "demo", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "slow/proactive" in done.stdout
    assert "warm-ahead" in done.stdout and "cold" in done.stdout and "escalation at turn" in done.stdout
    assert "random weights" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
