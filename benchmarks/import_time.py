"""Print `import agentkv` and `from agentkv import Session` times next to `import litellm`, each in a fresh
interpreter, in one run (every name of agentkv loads on first use: the second figure is what a program that makes a
Session pays).

    python benchmarks/import_time.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

SNIPPET = "import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"


def measure(statement: str, repeats: int = 5) -> float:
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    times = [
        float(subprocess.run([sys.executable, "-c", SNIPPET.format(statement=statement)], env=env, check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1])
        for _ in range(repeats)
    ]
    return statistics.median(times)


def main() -> None:
    agentkv_s = measure("import agentkv")
    session_s = measure("from agentkv import Session")
    litellm_s = measure("import litellm")
    heavy = subprocess.run(
        [sys.executable, "-c",
         "import sys, agentkv; print(sorted(m for m in ('litellm','torch','transformers') if m in sys.modules))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    print(f"import agentkv : {agentkv_s * 1000:8.1f} ms   (heavy modules loaded: {heavy})")
    print(f"from agentkv import Session : {session_s * 1000:8.1f} ms")
    print(f"import litellm : {litellm_s * 1000:8.1f} ms")
    print(f"ratio litellm/agentkv: {litellm_s / agentkv_s:.1f}x")


if __name__ == "__main__":
    main()
