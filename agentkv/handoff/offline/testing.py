"""Small, faithful stand-ins for testing KV handoff without checkpoints or servers.

    source = tiny_qwen3(seed=0)
    target = depth_upscaled(source, order=(0, 1, 2, 1, 2, 3))     # a related, deeper model
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from agentkv.handoff.cache import KVCache
from agentkv.handoff.signature import ModelSignature

if TYPE_CHECKING:
    from agentkv.handoff.learned import LearnedMapper

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 8192}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}


def tiny_qwen3(seed: int = 0, layers: int = 4, **overrides: Any) -> Any:
    """A random Qwen3 causal LM (hidden 64, 4 query / 2 KV heads of 16), eval mode, float32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**TINY, "num_hidden_layers": layers, **overrides})
    config._attn_implementation = "sdpa"
    config._name_or_path = f"tiny-qwen3-{layers}l-seed{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).eval()


def tiny_llama3(seed: int = 0, layers: int = 2, **overrides: Any) -> Any:
    """A random Llama causal LM with Llama 3.1 ``llama3`` rope scaling (factor 8 from 1024 positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY, "num_hidden_layers": layers, "rope_parameters": dict(LLAMA3_ROPE), **overrides})
    config._attn_implementation = "sdpa"
    config._name_or_path = f"tiny-llama3-{layers}l-seed{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


@torch.no_grad()
def damp_residual_writes(model: Any, factor: float) -> Any:
    """Scale every layer's writes to the residual stream (``o_proj``, ``down_proj``) by ``factor``, in place.

    Trained models have a residual stream that each layer nudges rather than rewrites; random ones don't.
    """
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(factor)
        layer.mlp.down_proj.weight.mul_(factor)
    return model


@torch.no_grad()
def depth_upscaled(source: Any, order: Sequence[int], noise: float = 0.05, seed: int = 1) -> Any:
    """A deeper model whose layer ``i`` is a perturbed copy of source layer ``order[i]`` (SOLAR-style up-scaling).

    Embeddings, final norm and head are copied; each copied matrix gets ``noise * std`` Gaussian noise.
    """
    fields = {**source.config.to_dict(), "num_hidden_layers": len(order)}
    fields.pop("layer_types", None)
    config = source.config.__class__.from_dict(fields)
    config._attn_implementation = "sdpa"
    config._name_or_path = f"{source.config._name_or_path}-upscaled{len(order)}"
    target = type(source)(config).eval()
    target.load_state_dict(source.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed)
    for i, j in enumerate(order):
        target.model.layers[i].load_state_dict(source.model.layers[j].state_dict())
        for p in target.model.layers[i].parameters():
            if p.dim() > 1:
                p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return target


def random_sequences(count: int, length: int, vocab: int = 256, seed: int = 0) -> list[torch.Tensor]:
    """``count`` token sequences of ``length`` uniform ids: each [length] int64."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(count)]


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` intra-op threads, then restore: tiny models are fastest on one, above all on shared cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


TINY_SOURCE = ModelSignature(num_layers=3, kv_heads=2, head_dim=8, rope_theta=1e6, model_id="tiny-source")
TINY_TARGET = ModelSignature(num_layers=2, kv_heads=1, head_dim=4, rope_theta=1e4, model_id="tiny-target")
TINY_SELECTED = ((2, 0), (1, 2))
"""k = 2 source layers per target layer."""


def random_learned(backend: str = "ridge", seed: int = 0, hidden: int = 5) -> LearnedMapper:
    """A ``ridge`` or ``mlp`` mapper for TINY_SOURCE -> TINY_TARGET with random weights of the right shapes.

    No models and no calibration: for file-format and plumbing tests. ridge: weight [32, 4], bias [4];
    mlp: w1 [hidden, 32], b1 [hidden], w2 [4, hidden], b2 [4] per target layer and kind.
    """
    from agentkv.handoff.mapping import KINDS, MapGeometry
    from agentkv.handoff.mlp import MLPMapper
    from agentkv.handoff.ridge import RidgeMapper
    from agentkv.handoff.rope import RopeTable
    from agentkv.handoff.signature import SignaturePair

    def rope(sig: ModelSignature) -> RopeTable:
        return RopeTable(1.0 / sig.rope_theta ** (torch.arange(0, sig.head_dim, 2).float() / sig.head_dim))

    width_in, width_out = 2 * TINY_SOURCE.kv_heads * TINY_SOURCE.head_dim, TINY_TARGET.kv_heads * TINY_TARGET.head_dim
    shapes = ({"weight": (width_in, width_out), "bias": (width_out,)} if backend == "ridge" else
              {"w1": (hidden, width_in), "b1": (hidden,), "w2": (width_out, hidden), "b2": (width_out,)})
    gen = torch.Generator().manual_seed(seed)
    params = {f"{kind}.{t}.{n}": torch.randn(shape, generator=gen)
              for kind in KINDS for t in range(TINY_TARGET.num_layers) for n, shape in shapes.items()}
    geometry = MapGeometry(SignaturePair(TINY_SOURCE, TINY_TARGET), TINY_SELECTED, rope(TINY_SOURCE), rope(TINY_TARGET))
    cls = RidgeMapper if backend == "ridge" else MLPMapper
    return cls(geometry, params, {"k": 2, "evaluation": {"attention_cosine": 0.99}})


def random_cache(signature: ModelSignature, seq: int = 5, seed: int = 0) -> KVCache:
    """A cache of ``signature``'s geometry with random keys/values: each [1, kv_heads, seq, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, signature.kv_heads, seq, signature.head_dim)
    layers = tuple(torch.randn(shape, generator=gen) for _ in range(signature.num_layers))
    return KVCache(layers, layers, torch.arange(seq)[None], signature)
