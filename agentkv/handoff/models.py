"""Small adapters over transformers causal LMs: signatures, attention modules, and model SPECs."""

from __future__ import annotations

from typing import Any

from agentkv.handoff.errors import SignatureMismatchError
from agentkv.handoff.signature import ModelSignature, SignaturePair

EMBEDDED_SIZES = ("tiny", "small", "large")


def signature_of(model_or_signature: Any) -> ModelSignature:
    """A model's (anything with ``.config``) signature; a signature is returned as is."""
    if isinstance(model_or_signature, ModelSignature):
        return model_or_signature
    config = model_or_signature.config
    return ModelSignature.from_config(config, model_id=str(getattr(config, "_name_or_path", "") or ""))


def verify_pair(pair: SignaturePair | None, source: Any = None, target: Any = None) -> None:
    """Raise :class:`SignatureMismatchError` unless the given models (or signatures) fit ``pair``."""
    if pair is None:
        return
    for side, expected, given in (("source", pair.source, source), ("target", pair.target, target)):
        reason = None if given is None else expected.mismatch(signature_of(given))
        if reason is not None:
            raise SignatureMismatchError(f"mapper {side} is {expected.describe()}; {reason}")


def decoder_layers(model: Any) -> Any:
    """The decoder layer list (``model.model.layers``)."""
    return getattr(model, "model", model).layers


def attention_modules(model: Any) -> list[Any]:
    """Every decoder layer's ``self_attn`` module."""
    return [layer.self_attn for layer in decoder_layers(model)]


def model_device(model: Any) -> Any:
    """The device of the model's first parameter."""
    return next(model.parameters()).device


def load_spec(spec: str, *, device: str = "cpu", dtype: Any = None, seed: int = 0) -> tuple[Any, Any]:
    """A model SPEC -> ``(model, codec)``: an embedded size (``small``/``large``) or a checkpoint folder.

    The codec (``agentkv.embedded.engine.codec``) turns corpus text into the model's token ids.
    """
    from agentkv.embedded.engine import codec as codecs
    from agentkv.embedded.engine import models

    if spec in EMBEDDED_SIZES:
        model, codec = models.build_model(spec, seed=seed, dtype=dtype), codecs.TiktokenCodec()
        if not getattr(model.config, "_name_or_path", ""):  # keep agentkv.embedded's id if it ever sets one
            model.config._name_or_path = f"agentkv-embedded-{spec}-seed{seed}"
        return model.to(device), codec
    model, tokenizer = models.load_model(spec)
    model.config._name_or_path = spec
    codec = codecs.HFCodec(tokenizer) if tokenizer is not None else codecs.TiktokenCodec()
    return model.to(device=device, dtype=dtype), codec


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes a cache: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward_with_cache(model: Any, input_ids: Any, cache: Any) -> Any:
    """One forward step that appends to ``cache``. input_ids: [batch, new_tokens]."""
    return model(input_ids, use_cache=True, **{cache_kwarg(model): cache})


def output_cache(output: Any) -> Any:
    """The cache a forward returned, under either field name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
