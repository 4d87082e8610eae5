"""``agentkv gateway``: the OpenAI-compatible gateway in front of a fast and a slow backend.

Usage::

    agentkv gateway --fast http://127.0.0.1:8001/v1 --fast-model qwen3-8b \\
                    --slow http://127.0.0.1:8002/v1 --slow-model qwen3-32b \\
                    [--host 127.0.0.1] [--port 8080] [--api-keys keys.json] [--redis-url redis://...] [--workers N]

Ready when ``GET /health`` answers 200. Limits (body size, timeouts, the conversations held) come from the
environment: see :mod:`agentkv.gateway.config`. starlette and uvicorn are imported only in :func:`run`.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gateway`` subcommand's options: exactly the contract's."""
    parser.add_argument("--fast", required=True, metavar="URL",
                        help="the fast backend's OpenAI base URL (…/v1); URL,URL,… for a pool of replicas")
    parser.add_argument("--fast-model", required=True, metavar="NAME", help="the model id the fast backend serves")
    parser.add_argument("--slow", required=True, metavar="URL",
                        help="the slow backend's OpenAI base URL (…/v1); URL,URL,… for a pool of replicas")
    parser.add_argument("--slow-model", required=True, metavar="NAME", help="the model id the slow backend serves")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help='JSON {"<key>": {"tenant": "<tenant>"}}: every /v1 request then needs a key')
    parser.add_argument("--redis-url", default=None, metavar="URL",
                        help="share warm-ahead guards, windows and corrections across gateway processes")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="processes serving the one port")


def _configure_logging() -> None:
    """One JSON line per event on stderr, from ``AGENTKV_GATEWAY_LOG_LEVEL`` up (info by default; events carry sizes
    and hashes, never prompt text)."""
    import os

    import structlog

    name = (os.environ.get("AGENTKV_GATEWAY_LOG_LEVEL") or "info").strip().upper()
    level = logging.getLevelName(name) if isinstance(logging.getLevelName(name), int) else logging.INFO

    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr), cache_logger_on_first_use=True)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit status (2 for a bad configuration)."""
    from agentkv.errors import ConfigurationError
    from agentkv.gateway.auth import load_api_keys
    from agentkv.gateway.config import GatewayConfig, shown_urls

    try:
        config = GatewayConfig(fast_url=args.fast, fast_model=args.fast_model, slow_url=args.slow,
                               slow_model=args.slow_model, host=args.host, port=args.port, api_keys=args.api_keys,
                               redis_url=args.redis_url, workers=args.workers).with_env_limits()
        if config.api_keys:
            load_api_keys(config.api_keys)  # a bad keys file stops the gateway here, not in every worker
    except ConfigurationError as exc:
        print(f"agentkv gateway: {exc}", file=sys.stderr)
        return 2
    _configure_logging()
    from agentkv.gateway.serve import serve

    print(f"agentkv gateway: http://{config.host}:{config.port}/v1 (fast {config.fast_model} at "
          f"{shown_urls(config.fast_url)}, slow {config.slow_model} at {shown_urls(config.slow_url)}, "
          f"{config.workers} worker(s))", file=sys.stderr, flush=True)
    serve(config)
    return 0
