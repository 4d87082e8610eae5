"""The local server: a :class:`~agentkv.embedded.engine.LocalEngine` behind vLLM's OpenAI-compatible HTTP API.

Uvicorn serves the ASGI app of :mod:`agentkv.embedded.server.asgi` on 127.0.0.1; :func:`routes.handle` decides,
worker threads run the engine. This module owns the socket, the thread pools, the KV-event publisher and the
lifecycle. It runs in a daemon thread of the caller's process (tests, the demo) or in the foreground (``agentkv
serve``). The served model id and window can be changed while it runs, as when a swap slot loads another model,
and, when asked (``request_log=N``), the last ``N`` requests are kept for tests to inspect. What a client may make
it hold is bounded (:mod:`agentkv.embedded.server.bounds`): no request bodies kept by default, bodies over
``max_body_bytes`` answered 413, clients slower than ``client_timeout_s`` dropped.

Usage::

    with LocalServer.from_size("small", window=2048) as server:
        litellm.completion(model="hosted_vllm/agentkv-small", api_base=server.api_base, messages=...)
        server.max_model_len = 4096
        server.requests        # with request_log=N: [LoggedRequest(method, path, body), ...]
"""

from __future__ import annotations

import atexit
import inspect
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

from agentkv.events import emit
from agentkv.embedded.engine import LocalEngine
from agentkv.embedded.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from agentkv.embedded.server.asgi import app
from agentkv.embedded.server.bounds import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    LoggedRequest,
    RequestLog,
)
from agentkv.embedded.server.connections import deadline_protocol
from agentkv.embedded.server.metrics import ServerMetrics
from agentkv.embedded.server.served import ServeOptions

_RUNNING: dict[str, LocalEngine] = {}
"""Engines served by running LocalServers of this process, by base URL."""


@atexit.register
def _quiesce_at_exit(timeout_s: float = 60.0) -> None:
    """Let in-flight requests (a warm-ahead, say) finish before the interpreter tears torch down."""
    for engine in list(_RUNNING.values()):
        engine.quiesce(timeout_s)


def engine_at(api_base: str | None) -> LocalEngine | None:
    """The in-process engine serving ``api_base`` (with or without ``/v1``), or None.

    This is how a Session finds local engines to hand KV between at escalation.
    """
    if not api_base:
        return None
    base = api_base.rstrip("/")
    return _RUNNING.get(base[: -len("/v1")] if base.endswith("/v1") else base)


_POOL_THREADS = 256
"""Generation threads per server: each in-flight request holds one while it waits for or takes its turns."""
_PARSE_THREADS = 4
"""Threads that validate and plan requests (tokenize, compile grammars), kept apart so that a full generation
pool never delays the 400 for a bad request or the start of a new one."""


class _NoEvents:
    """The publisher when KV events are off: nothing to publish, nothing imported."""

    def shutdown(self) -> None:
        return None


def _publisher(engine: LocalEngine, config: Any) -> Any:
    """vLLM's publisher for ``config`` wired to the engine's prefix cache; None publishes nothing."""
    if config is None:
        return _NoEvents()
    from agentkv.embedded.server.kv_events import make_publisher

    publisher = make_publisher(config, block_size=engine.prefix_cache.block_size)
    engine.prefix_cache.on_events = publisher.publish_cache_events
    return publisher


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` split into :class:`LocalServer`'s keyword-only options and the engine's keyword arguments."""
    own = {name for name, p in inspect.signature(LocalServer.__init__).parameters.items()
           if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "root"}
    return {k: v for k, v in options.items() if k in own}, {k: v for k, v in options.items() if k not in own}


class LocalServer:
    """vLLM's OpenAI-compatible API for one engine, on 127.0.0.1."""

    def __init__(self, engine: LocalEngine, host: str = "127.0.0.1", port: int = 0, *,
                 root: str | None = None, enable_prompt_tokens_details: bool = True,
                 max_logprobs: int = 20, bound_json: bool = True, kv_events_config: Any = None,
                 request_log: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S) -> None:
        """``enable_prompt_tokens_details`` is on for in-process servers (agentkv's demo, examples and tests read
        ``cached_tokens``); ``agentkv serve`` leaves it off unless ``--enable-prompt-tokens-details``, as vLLM.

        ``request_log``: keep the last N requests for :attr:`requests` (0, the default: keep none).
        ``max_body_bytes``: larger bodies are answered 413. ``client_timeout_s``: a client's time to send a
        request's headers, and again its body."""
        if max_body_bytes < 1 or client_timeout_s <= 0:
            raise ValueError("max_body_bytes and client_timeout_s must be positive")
        self.engine = engine
        self.max_body_bytes, self.client_timeout_s = int(max_body_bytes), float(client_timeout_s)
        self.kv_events = _publisher(engine, kv_events_config)  # vLLM's --kv-events-config
        self.created = int(time.time())
        self.root = root or engine.model_id
        self.options = ServeOptions(enable_prompt_tokens_details, max_logprobs, bound_json)
        self._log = RequestLog(request_log)
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (accepted ones inherit
        # the listener's). Without it, uvicorn's separate header and body writes meet Nagle's algorithm and the
        # client's delayed ACK: ~40 ms on every non-streamed answer (/tokenize, /v1/models) over keep-alive.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._address = self._socket.getsockname()
        self.pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix=f"agentkv-gen-{self._address[1]}")
        self.parse_pool = ThreadPoolExecutor(_PARSE_THREADS, thread_name_prefix=f"agentkv-req-{self._address[1]}")
        self.metrics = ServerMetrics(engine, lambda: self.model_id)
        self._grammars: GrammarCompiler | None = None
        self._compiled: dict[str, CompiledGrammar] = {}
        self._grammar_lock = threading.Lock()
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_size(cls, size: str = "small", *, window: int | None = None, model_id: str | None = None,
                  port: int = 0, **options: Any) -> LocalServer:
        """A server over ``LocalEngine.from_size(size)``, served as ``agentkv-{size}`` unless named.

        ``options``: the server's own keyword options (as :class:`LocalServer` takes them), the rest the engine's.
        """
        server, engine_kwargs = _split_options(options)
        engine = LocalEngine.from_size(size, model_id=model_id, max_model_len=window, **engine_kwargs)
        return cls(engine, port=port, **server)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, window: int | None = None, model_id: str | None = None,
                        port: int = 0, **options: Any) -> LocalServer:
        """A server over a checkpoint folder; the model id defaults to the folder's name (``options`` as above)."""
        server, engine_kwargs = _split_options(options)
        engine = LocalEngine.from_pretrained(path, model_id=model_id, max_model_len=window, **engine_kwargs)
        return cls(engine, port=port, root=str(path), **server)

    # --- where it listens ------------------------------------------------------------------------

    @property
    def host(self) -> str:
        return str(self._address[0])

    @property
    def port(self) -> int:
        return int(self._address[1])

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: where ``/tokenize``, ``/metrics`` and ``/health`` live."""
        return f"http://{self.host}:{self.port}"

    @property
    def api_base(self) -> str:
        """``base_url + "/v1"``: what litellm's ``api_base`` should be."""
        return f"{self.base_url}/v1"

    # --- what it serves, changeable at runtime ---------------------------------------------------

    @property
    def model_id(self) -> str:
        """The served model id (``hosted_vllm/<model_id>`` through litellm)."""
        return self.engine.model_id

    @model_id.setter
    def model_id(self, value: str) -> None:
        self.engine.model_id = value

    @property
    def max_model_len(self) -> int:
        """The window requests are validated against and ``/v1/models`` reports."""
        return self.engine.max_model_len

    @max_model_len.setter
    def max_model_len(self, value: int) -> None:
        self.set_max_model_len(value)

    def set_max_model_len(self, value: int) -> None:
        """Serve with another window from the next request on."""
        if value < 1:
            raise ValueError("max_model_len must be positive")
        self.engine.max_model_len = int(value)
        emit("local.server.window_changed", model_id=self.model_id, max_model_len=int(value))

    def backend(self, *, declare_window: bool = False, **overrides: Any) -> Any:
        """An :class:`agentkv.Backend` addressing this server, with the engine's tokenizer and template.

        The window is left to discovery (``/v1/models``) unless ``declare_window``; ``overrides`` are passed on.
        """
        from agentkv.backends import Backend
        from agentkv.tokens.templates import CHATML_TOOLS_TEMPLATE

        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            tokenizer, template = "cl100k_base", getattr(self.engine.codec, "template", None)
        else:
            template = getattr(tokenizer, "chat_template", None) or CHATML_TOOLS_TEMPLATE
        fields: dict[str, Any] = {"model": f"hosted_vllm/{self.model_id}", "api_base": self.api_base,
                                  "name": self.model_id, "tokenizer": tokenizer, "chat_template": template}
        if declare_window:
            fields["window"] = self.max_model_len
        return Backend(**{**fields, **overrides})

    # --- what the routes ask of the server ------------------------------------------------------

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """``spec`` compiled for this engine's vocabulary (the compiler is built on first use, grammars cached)."""
        import json

        key = json.dumps([spec.kind, spec.value], sort_keys=True, default=str)
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.engine.codec, self.engine.vocab_size,
                                                 sorted(self.engine.codec.eos_token_ids))
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._grammars.compile(spec)
                if len(self._compiled) >= 64:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[key] = compiled
        return compiled

    def observe_params(self, n: int, max_tokens: int) -> None:
        """Record one generating request's ``n`` and ``max_tokens`` in the metrics."""
        self.metrics.observe_params(n, max_tokens)

    def metrics_text(self) -> str:
        """``/metrics`` exposition text."""
        return self.metrics.render()

    # --- request log (opt-in) ------------------------------------------------------------------

    def record(self, method: str, path: str, body: Any, headers: Mapping[str, str] | None = None) -> None:
        """Keep one request (and its headers) in the log, if the server keeps one (called by the routes)."""
        self._log.record(method, path, body, headers)

    @property
    def logs_requests(self) -> bool:
        """Whether this server keeps a request log (``request_log=N``)."""
        return self._log.capacity > 0

    @property
    def requests(self) -> list[LoggedRequest]:
        """The last ``request_log`` requests since :meth:`clear_requests`, oldest first.

        Raises :class:`~agentkv.embedded.server.bounds.RequestLogDisabled` on a server started without a log.
        """
        return self._log.entries()

    def clear_requests(self) -> None:
        """Forget the logged requests."""
        self._log.clear()

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> LocalServer:
        """Serve in a daemon thread; returns self once the server accepts connections."""
        if self._thread is None:
            import uvicorn

            config = uvicorn.Config(app(self), log_level="warning", access_log=False, log_config=None,
                                    timeout_graceful_shutdown=1, lifespan="off",
                                    http=deadline_protocol(self.client_timeout_s))
            self._uvicorn = uvicorn.Server(config)
            self._socket.listen(128)
            self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                            name=f"agentkv-serve-{self.port}", daemon=True)
            self._thread.start()
            while not self._uvicorn.started and self._thread.is_alive():
                time.sleep(0.01)
            _RUNNING[self.base_url] = self.engine
            emit("local.server.started", model_id=self.model_id, base_url=self.base_url,
                 max_model_len=self.max_model_len)
        return self

    def stop(self) -> None:
        """Stop accepting requests, close open connections, join the serving thread, release the port."""
        _RUNNING.pop(self.base_url, None)
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=10)
            if self._thread.is_alive():
                self._uvicorn.force_exit = True
                self._thread.join()
            self._thread = None
        self._socket.close()
        self.metrics.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.parse_pool.shutdown(wait=False, cancel_futures=True)
        self.kv_events.shutdown()
        emit("local.server.stopped", model_id=self.model_id, port=self.port)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
