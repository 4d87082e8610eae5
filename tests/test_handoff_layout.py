"""KV handoff keeps what runs at an escalation apart from what runs offline to make a mapper."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agentkv.handoff.offline.testing import random_learned

MAPS = textwrap.dedent('''
    import sys, torch
    import agentkv.vllm_plugin.worker   # the KV connector's worker half: it loads and applies mappers inside vLLM
    from agentkv import Handoff, Session
    from agentkv.handoff.cache import KVCache
    from agentkv.handoff.registry import load_mapper
    from agentkv.handoff.signature import ModelSignature

    source = ModelSignature(num_layers=3, kv_heads=2, head_dim=8, rope_theta=1e6, model_id="tiny-source")
    for folder in sys.argv[1:]:
        mapper = load_mapper(folder)
        layers = tuple(torch.randn(1, 2, 5, 8) for _ in range(3))
        mapped = mapper.map(KVCache(layers, layers, torch.arange(5)[None], source))
        assert mapped.keys[0].shape == (1, 1, 5, 4), mapped.keys[0].shape
    print(sorted(m for m in sys.modules if m.startswith("agentkv.handoff.offline")))
''')


def test_a_process_that_only_maps_imports_no_offline_code(tmp_path):
    """Loading saved ``ridge`` and ``mlp`` mappers and mapping a cache with them, with the KV connector's worker and
    the Session imported too, imports nothing of ``agentkv.handoff.offline`` (collect, rank, fit, evaluate, bench)."""
    folders = []
    for backend in ("ridge", "mlp"):
        folder = tmp_path / backend
        random_learned(backend).save(folder)
        folders.append(str(folder))
    done = subprocess.run([sys.executable, "-c", MAPS, *folders], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
