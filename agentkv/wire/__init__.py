"""What goes on the wire for each API agentkv speaks, shared by the Session, the OpenAI transport and the gateway.

- :mod:`agentkv.wire.openai`: OpenAI's ``/chat/completions`` and ``/completions`` bodies as a try sends them (the
  backend's model id, the clamped budget, the tenant's salt, a handoff's import), what of a body is counted, a
  backend's error answer as the error the Session reads, and the usage read from a stream's SSE lines.
- :mod:`agentkv.wire.usage`: what an answer reports (usage, cached tokens, finish reason), JSON or streamed;
- :mod:`agentkv.wire.kv_transfer`: the ``kv_transfer_params`` a client and the KV connector inside vLLM exchange
  (exports, imports, their salts).
"""
