"""The embedded engine: one transformers causal LM, a real prefix cache, greedy or seeded-sampling decode.

A request reuses the longest run of cached 16-token blocks of its prompt (never the final token), prefills only
the rest, and caches every full block of the prompt and of the generated text for the next request. Concurrent
requests take turns on the model through a first-come-first-served :class:`~agentkv.embedded.engine.scheduler.FairLock`:
a prefill is one turn, each decode step another, so running requests interleave token by token and a new one
waits (``waiting``) only until the turn in progress ends. A request whose ``abort`` event is set, or whose
stream is closed, stops at its next step and its KV is freed.

Usage::

    engine = LocalEngine.from_size("small")                    # model id "agentkv-small", window 2048
    ids = engine.tokenize_chat([{"role": "user", "content": "hi"}])
    result = engine.generate(ids, max_tokens=16, cache_salt="tenant-a")
    result.text, result.cached_tokens, result.ttft_s
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from agentkv.events import emit
from agentkv.embedded.engine import kv
from agentkv.embedded.engine.codec import ChatRequest, Codec, HFCodec, TiktokenCodec
from agentkv.embedded.engine.decoding import Detokenizer, Sampler, logit_bias, token_logprob
from agentkv.embedded.engine.limits import ContextLengthExceeded, engine_check
from agentkv.embedded.engine.models import DEFAULT_WINDOWS, build_model, generation_eos_ids, intra_op_threads, load_model
from agentkv.embedded.engine.prefix_cache import PrefixCache
from agentkv.embedded.engine.sampling import SamplingParams, StopChecker, TokenLogprob
from agentkv.embedded.engine.scheduler import Aborted, FairLock, RequestTrace

if TYPE_CHECKING:
    import torch


DEFAULT_CACHE_BUDGET_BYTES = 512 << 20
DEFAULT_PREFILL_CHUNK = 8192
DEFAULT_DECODE_THREADS = 1
"""Decode steps are tiny matmuls: one thread is as fast as two on an idle 2-core machine and several times
faster when other work (another engine's prefill, another process) competes for the cores."""
DEFAULT_EVICTION_POLICY = "fair"
"""Tenant-fair eviction: with one salt group (or none) it evicts exactly as LRU does, and with several it keeps one
tenant's flood from evicting another tenant's hot prefix. ``"lru"`` is vLLM's own order, for comparison."""


@dataclass(frozen=True)
class Delta:
    """One streamed step: the generated token (None for trailing text only), the text it completes, its logprob."""

    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Generation:
    """A finished request. ``token_ids`` includes the EOS token when one ended it; ``text`` does not."""

    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    ttft_s: float
    total_s: float
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob | None, ...] = ()
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, EOS included (as vLLM counts them)."""
        return len(self.token_ids)


@dataclass(frozen=True)
class EngineStats:
    """Counters since the engine started; prefix-cache figures are in tokens, as vLLM's metrics are."""

    requests_started: int
    requests_finished: Mapping[str, int]
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    cache_bytes_used: int
    cache_budget_bytes: int
    cache_blocks: int
    running: int = 0
    waiting: int = 0
    running_kv_bytes: int = 0


@dataclass
class _Counters:
    requests_started: int = 0
    requests_finished: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Sequence:
    """The mutable state of one request while it runs."""

    trace: RequestTrace
    admitted: bool = False
    cache: Any = None
    pins: tuple[int, list[bytes]] = (0, [])
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str = ""
    finish: str | None = None
    stop_reason: int | str | None = None
    ttft: float = 0.0


class LocalEngine:
    """An in-process model with a vLLM-style prefix cache; concurrent requests take fair turns."""

    def __init__(
        self,
        model: Any,
        codec: Codec | None = None,
        *,
        model_id: str = "agentkv",
        max_model_len: int | None = None,
        cache_budget_bytes: int = DEFAULT_CACHE_BUDGET_BYTES,
        block_size: int = 16,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefill_threads: int | None = None,
        decode_threads: int | None = DEFAULT_DECODE_THREADS,
        num_blocks: int | None = None,
        eviction_policy: str = DEFAULT_EVICTION_POLICY,
    ) -> None:
        """``num_blocks`` bounds the prefix cache in blocks as well as bytes (vLLM's ``--num-gpu-blocks-override``);
        ``eviction_policy`` is ``"fair"`` (the salt group furthest over its fair share loses its coldest block
        first) or ``"lru"`` (vLLM's order): see :mod:`agentkv.embedded.engine.eviction`."""
        self.model = model
        self.codec: Codec = codec or TiktokenCodec()
        self.model_id = model_id
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.prefill_threads = prefill_threads
        self.decode_threads = decode_threads
        self.prefix_cache = PrefixCache(block_size=block_size, budget_bytes=cache_budget_bytes, num_blocks=num_blocks,
                                        policy=eviction_policy)
        self._bias = logit_bias(self.codec, int(model.config.vocab_size))
        self._lock = FairLock()  # one turn on the model and the prefix cache at a time, first come first served
        self._stats_lock = threading.Lock()  # counters only, so metrics never wait for a request
        self._counters = _Counters()
        self._running: dict[int, int] = {}  # id(request) -> tokens of KV it holds
        self._waiting = 0
        self.observers: list[Any] = []
        """Callables given a :class:`~agentkv.embedded.engine.scheduler.RequestTrace` when a request ends (metrics)."""
        emit("local.engine.ready", model_id=model_id, max_model_len=self.max_model_len,
             layers=self.num_layers, parameters=sum(p.numel() for p in model.parameters()))

    @classmethod
    def from_size(
        cls, size: str = "small", *, seed: int = 0, model_id: str | None = None, max_model_len: int | None = None,
        model_overrides: Mapping[str, Any] | None = None, **engine_kwargs: Any,
    ) -> LocalEngine:
        """An engine over ``build_model(size, seed=seed)``, served as ``agentkv-{size}`` by default."""
        model = build_model(size, seed=seed, **dict(model_overrides or {}))
        window = max_model_len or DEFAULT_WINDOWS.get(size)
        return cls(model, model_id=model_id or f"agentkv-{size}", max_model_len=window, **engine_kwargs)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, model_id: str | None = None, **engine_kwargs: Any
    ) -> LocalEngine:
        """An engine over a checkpoint folder, with its own tokenizer and chat template when it has them."""
        model, tokenizer = load_model(path)
        codec: Codec = HFCodec(tokenizer) if tokenizer is not None else TiktokenCodec()
        codec.eos_token_ids = codec.eos_token_ids | generation_eos_ids(model)
        return cls(model, codec, model_id=model_id or Path(path).name, **engine_kwargs)

    # --- shapes and tokenizers -------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    @property
    def kv_heads(self) -> int:
        return int(self.model.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        config = self.model.config
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values one token occupies across all layers."""
        size = next(self.model.parameters()).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * size

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (what ``logit_bias`` ids are checked against, as vLLM does)."""
        return int(self.model.config.vocab_size)

    @property
    def encoding(self) -> Any:
        """The tiktoken encoding, or None when a checkpoint's own tokenizer is in use."""
        return getattr(self.codec, "encoding", None)

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer, or None when tiktoken is in use."""
        return getattr(self.codec, "tokenizer", None)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: Any = None, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat endpoint would tokenize for this conversation."""
        return self.codec.render(ChatRequest(messages, tools, tool_choice, add_generation_prompt,
                                             continue_final_message, dict(chat_template_kwargs or {})))

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], *args: Any, **kwargs: Any) -> list[int]:
        """The token ids the chat endpoint prefills for this conversation (arguments as :meth:`render`)."""
        return self.codec.encode(self.render(messages, *args, **kwargs), add_special_tokens=False)

    def encode_chat(self, chat: ChatRequest, *, add_special_tokens: bool = False) -> list[int]:
        """The token ids of a rendered :class:`~agentkv.embedded.engine.codec.ChatRequest` (what the server prefills)."""
        return self.codec.encode(self.codec.render(chat), add_special_tokens=add_special_tokens)

    def tokenize_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain prompt."""
        return self.codec.encode(prompt, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``; invalid UTF-8 becomes U+FFFD."""
        return self.codec.decode(token_ids)

    # --- requests --------------------------------------------------------------------------------

    def generate(
        self, token_ids: Sequence[int], max_tokens: int | None = None, *, cache_salt: str | None = None,
        temperature: float = 0.0, seed: int | None = None, params: SamplingParams | None = None,
        abort: threading.Event | None = None,
    ) -> Generation:
        """Run one request to completion (raises :class:`ContextLengthExceeded` when the prompt leaves no room)."""
        for item in self.stream(token_ids, max_tokens, cache_salt=cache_salt, temperature=temperature, seed=seed,
                                params=params, abort=abort):
            if isinstance(item, Generation):
                return item
        raise RuntimeError("stream ended without a result")  # pragma: no cover

    def stream(
        self, token_ids: Sequence[int], max_tokens: int | None = None, *, cache_salt: str | None = None,
        temperature: float = 0.0, seed: int | None = None, params: SamplingParams | None = None,
        abort: threading.Event | None = None,
    ) -> Iterator[Delta | Generation]:
        """Yield a :class:`Delta` per generated token, then the :class:`Generation`; validates eagerly.

        ``params`` carries every sampling field; without it ``max_tokens``, ``temperature`` and ``seed`` are
        used (a None seed samples with seed 0, as before). Setting ``abort`` stops the request at its next step.
        """
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if params is None:
            params = SamplingParams(max_tokens=int(max_tokens or 0), temperature=temperature,
                                    seed=0 if seed is None else seed)
        error = engine_check(len(prompt), self.max_model_len)
        if error is not None:
            raise ContextLengthExceeded(error)
        room = self.max_model_len - len(prompt)
        if params.max_tokens > room:  # the window ends generation ("length"), as vLLM's scheduler caps it
            params = replace(params, max_tokens=room)
        return self._run(prompt, params, cache_salt, abort or threading.Event())

    def prefill_logits(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[torch.Tensor, int]:
        """Prefill like a request (reusing and filling the prefix cache) without sampling.

        Returns the next-token logits ``[vocab]`` after the last token and how many tokens came from the cache.
        Counts as a prefix-cache query in :meth:`stats`, not as a request.
        """
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        with self._lock:
            _, cached, logits, _ = self._prefill(prompt, cache_salt)
        return logits, cached

    def quiesce(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the requests in flight, then hold the engine so no other starts.

        For interpreter exit: torch work cut off by finalization can abort the process. Returns False
        when the requests in flight did not finish in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._lock.acquire(timeout=left):
                return False
            with self._stats_lock:
                idle = not self._running and not self._waiting
            if idle:
                return True
            self._lock.release()
            time.sleep(0.01)

    def _turn(self, abort: threading.Event) -> None:
        """Wait for this request's turn on the model, giving up if it is aborted meanwhile."""
        if not self._lock.acquire(cancel=abort):
            raise Aborted()

    def _run(self, prompt: list[int], params: SamplingParams, salt: str | None, abort: threading.Event
             ) -> Iterator[Delta | Generation]:
        trace = RequestTrace(len(prompt), params.max_tokens, arrival=time.perf_counter())
        state = _Sequence(trace)
        with self._stats_lock:
            self._waiting += 1
        try:
            yield from self._steps(prompt, params, salt, abort, state)
        except Aborted:
            state.finish = "abort"
        finally:
            self._end(prompt, salt, state)
        result = Generation(state.generated, state.text, len(prompt), trace.cached_tokens, state.finish,
                            state.ttft, trace.finished - trace.arrival, state.stop_reason, tuple(state.logprobs),
                            state.prompt_logprobs)
        emit("local.request.finished", model_id=self.model_id, prompt_tokens=len(prompt),
             cached_tokens=trace.cached_tokens, completion_tokens=len(state.generated), finish_reason=state.finish,
             ttft_s=round(state.ttft, 4), total_s=round(result.total_s, 4))
        yield result  # after the request's KV is released: the engine is free once the caller sees the result

    def _steps(self, prompt: list[int], params: SamplingParams, salt: str | None, abort: threading.Event,
               state: _Sequence) -> Iterator[Delta]:
        """Prefill, then sample and decode one token per turn until a stop condition; fills ``state``."""
        trace = state.trace
        self._turn(abort)
        if abort.is_set():  # its client left while it waited: never prefill it
            self._lock.release()
            raise Aborted()
        try:
            with self._stats_lock:
                self._waiting -= 1
                self._running[id(state)] = len(prompt)
            state.admitted = True
            trace.scheduled = time.perf_counter()
            self._count(requests_started=1)
            state.cache, trace.cached_tokens, logits, chain = self._prefill(prompt, salt)
            state.pins = self.prefix_cache.pin(chain)  # in use until the request ends: never evicted meanwhile
            trace.prefill_tokens = len(prompt) - trace.cached_tokens
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = self._prompt_logprobs(prompt, params.prompt_logprobs)
        finally:
            self._lock.release()
        state.ttft = time.perf_counter() - trace.arrival
        eos = self.codec.eos_token_ids
        sampler = Sampler(params, self._bias, () if params.ignore_eos else eos)
        detokenizer = Detokenizer(self.codec, skip=eos | set(params.stop_token_ids))
        stopper = StopChecker(params.stop, include=params.include_stop_str_in_output)
        while True:
            if abort.is_set():
                state.finish = "abort"
                return
            with intra_op_threads(self.decode_threads):  # vector ops on [vocab]: 1 thread avoids pool contention
                token, logprob = sampler(logits)
            trace.token_times.append(time.perf_counter())
            state.generated.append(token)
            state.logprobs.append(logprob)
            text = ""
            if token in eos and not params.ignore_eos:
                state.finish = "stop"
            elif token in params.stop_token_ids:
                state.finish, state.stop_reason = "stop", token
            else:
                text, hit = stopper.push(detokenizer.push(token))
                if hit is not None:
                    state.finish, state.stop_reason = "stop", hit
            if state.finish is None and len(state.generated) >= params.max_tokens:
                state.finish = "length"
            if state.finish is not None:
                text += stopper.push(detokenizer.flush())[0] + stopper.flush()
            state.text = stopper.text
            yield Delta(token, text, logprob)
            if state.finish is not None:
                return
            self._turn(abort)
            try:
                with intra_op_threads(self.decode_threads):
                    logits = self._forward([token], state.cache, len(prompt) + len(state.generated) - 1)
                with self._stats_lock:
                    self._running[id(state)] = len(prompt) + len(state.generated)
            finally:
                self._lock.release()

    def _prompt_logprobs(self, prompt: list[int], top: int) -> list[TokenLogprob | None]:
        """Logprobs of each prompt token given the ones before it (None for the first), computed afresh."""
        import torch

        with torch.inference_mode(), intra_op_threads(self.prefill_threads):
            positions = torch.arange(len(prompt)).unsqueeze(0)
            logits = self.model(input_ids=torch.tensor([prompt]), position_ids=positions).logits[0]  # (T, V)
        return [None] + [token_logprob(logits[i - 1], prompt[i], top) for i in range(1, len(prompt))]

    def _end(self, prompt: list[int], salt: str | None, state: _Sequence) -> None:
        """Cache the sequence's blocks, free its KV, count it, and tell the observers."""
        trace = state.trace
        finish = state.finish or "abort"
        state.finish = finish
        if state.admitted and state.cache is not None:
            with self._lock:
                try:
                    self._store(prompt + state.generated, state.cache, salt)
                finally:
                    self.prefix_cache.unpin(state.pins)  # evictable again, the prompt's tail colder than its head
        state.cache = None
        with self._stats_lock:
            if state.admitted:
                self._running.pop(id(state), None)
            else:
                self._waiting -= 1
        if state.admitted:
            self._count(prompt_tokens=len(prompt), generation_tokens=len(state.generated), finished=finish)
        trace.finished, trace.finish_reason = time.perf_counter(), finish
        for observer in list(self.observers):
            observer(trace)

    def _prefill(self, prompt: list[int], salt: str | None) -> tuple[Any, int, torch.Tensor, list[bytes]]:
        """Restore the longest cached prefix (never the last token), prefill the rest, cache the prompt.

        Returns the KV, the tokens that came from the cache, the next-token logits and the prompt's block keys."""
        import torch

        reusable = (len(prompt) - 1) // self.block_size * self.block_size
        blocks = self.prefix_cache.match(self.prefix_cache.hashes(prompt[:reusable], salt))
        cached = len(blocks) * self.block_size
        with torch.inference_mode(), intra_op_threads(self.prefill_threads):
            cache = kv.cache_from_blocks(blocks, self.model.config)
            logits = self._forward(prompt[cached:], cache, cached)
            chain = self._store(prompt, cache, salt)
        self._count(prefix_cache_queries=len(prompt), prefix_cache_hits=cached)
        return cache, cached, logits, chain

    def _forward(self, ids: list[int], cache: Any, start: int) -> torch.Tensor:
        """Feed ``ids`` at positions ``start..`` in chunks; the next-token logits ``[vocab]`` of the last one."""
        import torch

        logits = None
        with torch.inference_mode():
            for offset in range(0, len(ids), self.prefill_chunk):
                chunk = ids[offset : offset + self.prefill_chunk]
                first = start + offset
                positions = torch.arange(first, first + len(chunk)).unsqueeze(0)  # (1, T)
                out = self.model(input_ids=torch.tensor([chunk]), position_ids=positions, cache=cache,
                                 use_cache=True, logits_to_keep=1)
                logits = out.logits[0, -1]
        assert logits is not None
        return logits

    def _store(self, tokens: list[int], cache: Any, salt: str | None) -> list[bytes]:
        """Cache every full block of ``tokens`` whose KV ``cache`` holds and the prefix cache lacks; their keys."""
        import torch

        held = tokens[: cache.get_seq_length()]
        keys, values = kv.layer_kv(cache)
        chain = self.prefix_cache.hashes(held, salt)
        with torch.inference_mode():
            self.prefix_cache.insert(chain, lambda i: kv.block_from_layers(keys, values, i, self.block_size))
        return chain

    # --- KV access for handoff ------------------------------------------------------------------

    def cached_prefix_kv(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """The cached KV of the longest run of leading full blocks of ``token_ids``.

        Returns ``(n_tokens, keys, values)``; keys and values are per layer ``[1, kv_heads, n_tokens, head_dim]``
        (zero-length when nothing is cached). Unlike a request, this may cover the final token.
        """
        import torch

        with self._lock:
            blocks = self.prefix_cache.match(self.prefix_cache.hashes(list(token_ids), cache_salt))
            with torch.inference_mode():
                keys, values = kv.stack_blocks(blocks)
        if not blocks:
            keys, values = self._empty_kv(), self._empty_kv()
        return len(blocks) * self.block_size, keys, values

    def install_prefix_kv(
        self, token_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
        cache_salt: str | None = None,
    ) -> int:
        """Cache externally computed KV for ``token_ids`` under this engine's hash chain.

        keys, values: per layer ``[1, kv_heads, seq, head_dim]``; only full blocks within both ``seq`` and
        ``len(token_ids)`` are used, and blocks already cached are kept. Returns how many leading tokens of
        ``token_ids`` the cache now covers.
        """
        seq = kv.check_layer_shapes(keys, values, layers=self.num_layers, kv_heads=self.kv_heads,
                                    head_dim=self.head_dim)
        dtype = next(self.model.parameters()).dtype
        keys = [k.detach().to("cpu", dtype) for k in keys]
        values = [v.detach().to("cpu", dtype) for v in values]
        usable = min(seq, len(token_ids)) // self.block_size * self.block_size
        with self._lock:
            hashes = self.prefix_cache.hashes(list(token_ids[:usable]), cache_salt)
            covered = self.prefix_cache.insert(hashes, lambda i: kv.block_from_layers(keys, values, i,
                                                                                      self.block_size))
        emit("local.prefix_cache.installed", model_id=self.model_id, tokens=covered * self.block_size)
        return covered * self.block_size

    def _empty_kv(self) -> list[torch.Tensor]:
        import torch

        dtype = next(self.model.parameters()).dtype
        return [torch.zeros(1, self.kv_heads, 0, self.head_dim, dtype=dtype) for _ in range(self.num_layers)]

    # --- bookkeeping -----------------------------------------------------------------------------

    def _count(self, finished: str | None = None, **increments: int) -> None:
        with self._stats_lock:
            for name, amount in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + amount)
            if finished is not None:
                self._counters.requests_finished[finished] += 1

    def stats(self) -> EngineStats:
        """A snapshot of the request and prefix-cache counters; never waits for a running request."""
        with self._stats_lock:
            c = self._counters
            return EngineStats(c.requests_started, dict(c.requests_finished), c.prompt_tokens,
                               c.generation_tokens, c.prefix_cache_queries, c.prefix_cache_hits,
                               self.prefix_cache.bytes_used, self.prefix_cache.budget_bytes,
                               len(self.prefix_cache), len(self._running), self._waiting,
                               sum(self._running.values()) * self.kv_bytes_per_token)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (vLLM's ``/reset_prefix_cache``)."""
        with self._lock:
            self.prefix_cache.clear()
