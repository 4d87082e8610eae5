"""The README's Python blocks run as written: one namespace, in order, against two embedded servers."""

import ast
import asyncio
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
URLS = ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1")


def python_blocks(text):
    """The README's ```python blocks, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def search_logs(query: str) -> str:
    """Search the service logs."""
    return "compaction at 03:12"


@pytest.mark.slow
def test_the_readmes_python_blocks_run_as_written():
    """Every Python block of the README runs, top-level ``await`` included, with the names it assumes bound
    (``messages``, ``tools``, ``search_logs``) and its two backend URLs pointed at embedded servers serving the
    models it names; the sessions it opens are closed by its own ``with`` blocks."""
    from agentkv.embedded.server import LocalServer

    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2 and all(url in blocks[0] for url in URLS)
    fast = LocalServer.from_size("tiny", window=2048, model_id="qwen3-8b")
    slow = LocalServer.from_size("tiny", window=16384, model_id="qwen3-32b", seed=1)
    with fast, slow:
        namespace = {
            "messages": [{"role": "user", "content": "Why did disk latency spike at 03:12?"}],
            "tools": [{"type": "function", "function": {"name": "search_logs", "description": "Search the logs.",
                       "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}],
            "search_logs": search_logs,
        }
        for block in blocks:
            for url, server in zip(URLS, (fast, slow)):
                block = block.replace(url, server.api_base)
            code = compile(block, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)  # a coroutine when the block awaits
            if asyncio.iscoroutine(result):
                asyncio.run(result)
        assert namespace["resp"].choices[0].message is not None
        assert namespace["result"].stop_reason and namespace["s"].closed
        assert sum(namespace["s"].stats()["requests"].values()) >= 1


def test_the_readmes_layout_names_every_part_and_only_parts_that_exist():
    """The Layout block names every top-level module and folder of agentkv/, and each ``x.py`` or ``x/`` it names
    exists: at the top level, or inside the folder its line (or the line it continues) starts with."""
    text = README.read_text()
    block = text[text.index("## Layout"):]
    block = block[block.index("```\n") + 4:]
    block = block[:block.index("```")]
    package = README.parent / "agentkv"
    top = {p.name for p in package.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir())}
    named, missing, folder = set(), [], package
    for line in block.splitlines()[1:]:
        head = re.match(r"  (\w+)/", line)
        if head:
            folder = package / head.group(1)
        elif re.match(r"  \S", line):
            folder = package
        for token in re.findall(r"\b(\w+\.py|\w+/)", line):
            name = token.rstrip("/")
            if (package / name).exists():
                named.add(name)
            elif not (folder / name).exists():
                missing.append(token)
    assert top - named == set(), f"not in the README's layout: {sorted(top - named)}"
    assert missing == [], f"named in the README's layout but not in agentkv/: {missing}"
