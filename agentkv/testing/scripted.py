"""Scripted model replies for agents whose model has random weights: every request goes out for real (token counts,
windows and cache hits stay real), then the answer's message is replaced by the script's next step.

    client = ScriptedReplies([[("search", '{"q": "disk"}')], "It was compaction."])      # a litellm-shaped client
    transport = ScriptedTransport([[("search", '{"q": "disk"}')], "Done."])               # an httpx transport
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["ScriptedReplies", "ScriptedTransport"]


class ScriptedReplies:
    """A litellm-compatible client for agent tests whose model has random weights.

    Each request goes out for real through litellm (token counts, windows, cache hits stay real);
    then the reply's message is replaced by the script's next step: a string is a final answer, a list
    of ``(name, json_arguments)`` pairs is a turn of tool calls. Warm-ahead requests (``max_tokens=1``)
    and requests past the end of the script pass through untouched.

        client = ScriptedReplies([[("search", '{"q": "disk"}')], "It was compaction."])
        Session(fast, slow, client=client).run("why?", tools={"search": search})
    """

    def __init__(self, script: list[Any]) -> None:
        from agentkv._support.env import import_litellm

        self.litellm = import_litellm()
        self.script = list(script)

    def _replace(self, response: Any, kwargs: dict[str, Any]) -> Any:
        if kwargs.get("max_tokens") == 1 or not self.script:
            return response
        step = self.script.pop(0)
        if isinstance(step, str):
            response.choices[0].message = self.litellm.Message(content=step)
        else:
            response.choices[0].message = self.litellm.Message(content="", tool_calls=[
                {"id": f"call_{len(self.script)}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(step)])
        return response

    def completion(self, **kwargs: Any) -> Any:
        return self._replace(self.litellm.completion(**kwargs), kwargs)

    async def acompletion(self, **kwargs: Any) -> Any:
        return self._replace(await self.litellm.acompletion(**kwargs), kwargs)


class ScriptedTransport:
    """An httpx transport (sync and async) for agents on OpenAI-SDK clients whose model has random weights.

    Every request goes out for real through ``inner`` (token counts, windows, cache hits stay real);
    then the JSON answer of a chat completion has its message replaced by the script's next step, as
    :class:`ScriptedReplies` does: a string is a final answer, a list of ``(name, json_arguments)``
    pairs a turn of tool calls. Streams, one-token warms and requests past the script pass untouched.

        transport = AgentKVTransport(session, inner=ScriptedTransport([[("search", '{"q": "disk"}')], "Done."]))
    """

    def __init__(self, script: list[Any], inner: Any = None, async_inner: Any = None) -> None:
        import httpx

        self.script = list(script)
        self._inner = inner or httpx.HTTPTransport()
        self._async_inner = async_inner or httpx.AsyncHTTPTransport()

    def handle_request(self, request: Any) -> Any:
        return self._scripted(request, self._inner.handle_request(request), lambda r: r.read())

    async def handle_async_request(self, request: Any) -> Any:
        response = await self._async_inner.handle_async_request(request)
        if self._scriptable(request, response):
            await response.aread()
        return self._scripted(request, response, lambda r: None)

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._async_inner.aclose()

    def _scriptable(self, request: Any, response: Any) -> bool:
        import json

        if not self.script or response.status_code != 200 or not request.url.path.endswith("/chat/completions"):
            return False
        body = json.loads(request.content or b"{}")
        return not body.get("stream") and body.get("max_tokens") != 1

    def _scripted(self, request: Any, response: Any, read: Callable[[Any], Any]) -> Any:
        from agentkv.integrations.openai import json_response

        if not self._scriptable(request, response):
            return response
        read(response)
        answer = response.json()
        answer["choices"][0]["message"] = _scripted_message(self.script.pop(0), len(self.script))
        answer["choices"][0]["finish_reason"] = "tool_calls" if answer["choices"][0]["message"].get("tool_calls") \
            else "stop"
        return json_response(200, answer, response.extensions)


def _scripted_message(step: Any, left: int) -> dict[str, Any]:
    if isinstance(step, str):
        return {"role": "assistant", "content": step}
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{left}_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(step)]}
