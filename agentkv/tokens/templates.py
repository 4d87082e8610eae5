"""The ChatML/Qwen-style chat template agentkv writes, and a deterministic renderer for any template.

The template renders tool schemas into the system turn (a ``# Tools`` section, one JSON line per tool
inside ``<tools>``, ``<tool_call>`` instructions), assistant tool calls and tool results, the way Qwen3's
template does. The embedded engine serves it, and a :class:`~agentkv.Backend` configured with it and
``tokenizer="cl100k_base"`` counts tokens exactly as that engine will.

Usage::

    text = render_chat(messages, tools=tools, add_generation_prompt=True)
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping, Sequence

CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- if tool_choice is string and tool_choice == 'required' %}
{{- '\\n\\nYou must call at least one function.' }}
{%- elif tool_choice is mapping %}
{{- '\\n\\nYou must call the function ' + tool_choice.function.name + '.' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in (message.tool_calls or []) %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{%- if call.function.arguments is string %}{{- call.function.arguments }}{%- else %}{{- call.function.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _tojson(value: Any) -> str:
    """JSON as chat templates write it: keys in the caller's order, no ASCII escaping."""
    return json.dumps(value, ensure_ascii=False)


@lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _text_content(content: Any) -> Any:
    """Flatten OpenAI content parts (``[{"type": "text", "text": ...}]``) to text."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return content


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of ``messages`` with text content flattened; the input is not touched."""
    return [{**dict(m), "content": _text_content(m.get("content"))} for m in messages]


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    tool_choice: Any = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """Render a conversation to the exact text a server using ``template`` would tokenize."""
    compiled = _compiled(template or CHATML_TOOLS_TEMPLATE)
    return str(compiled.render(
        messages=normalise_messages(messages),
        tools=list(tools) if tools else None,
        tool_choice=tool_choice,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    ))
