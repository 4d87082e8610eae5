"""Request bodies as pydantic models with vLLM's validation rules and messages, and what they ask the engine for.

The models follow vLLM's ``ChatCompletionRequest``/``CompletionRequest`` (``vllm/entrypoints/openai``): unknown
fields are accepted and ignored, ``seed`` must fit int64, ``tool_choice`` must agree with ``tools``, one
structured-output constraint at most, ``stream_options`` only with ``stream``. :func:`parse` turns any failure
into a :class:`RequestError` (400 with vLLM's error JSON, a schema failure shaped as vLLM's validation handler
shapes it), never an exception a server would answer with 500.
The checks that need the served model (vocabulary, ``max_logprobs``) are in :mod:`agentkv.embedded.server.validation`.

Usage::

    request = parse(ChatCompletionRequest, body)
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentkv.embedded.server.request_errors import ParamError, RequestError, validation_error

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(_Model):
    """One chat message: a role is required; content is text, a list of parts, or null."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _text_parts(self) -> Message:
        for part in self.content if isinstance(self.content, list) else ():
            kind = part.get("type")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ParamError("A text content part needs a string `text`.", parameter="content")
            if kind not in ("text", "input_text", "refusal"):
                raise ParamError(f"Content part type {kind!r} is not supported by this text-only model.",
                                 parameter="content")
        return self


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    function: NamedFunction
    type: Literal["function"] = "function"


class JsonSchema(_Model):
    name: str = "schema"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Model):
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Model):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


_SALT_FORBIDDEN = frozenset("@/\\\x00")
MAX_CACHE_SALT_CHARS = 128


def check_cache_salt(salt: Any) -> None:
    """vLLM 0.32's ``validate_cache_salt``: a non-empty string of at most 128 characters, none of ``@ / \\ NUL``."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise ParamError("Parameter 'cache_salt' must be a non-empty string if provided.", parameter="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS or any(char in _SALT_FORBIDDEN for char in salt):
        raise ParamError("Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                         "'\\\\', or NUL.", parameter="cache_salt")


class SamplingFields(_Model):
    """Fields the chat and completion requests share (vLLM's sampling parameters)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    n: int | None = 1
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    echo: bool = False
    add_special_tokens: bool = False
    cache_salt: str | None = None
    request_id: str | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)

    @model_validator(mode="before")
    @classmethod
    def _shared_rules(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        check_cache_salt(data.get("cache_salt"))
        if data.get("stream_options") and not data.get("stream"):
            raise ParamError("Stream options can only be defined when `stream=True`.", parameter="stream_options")
        prompt_logprobs = data.get("prompt_logprobs")
        if prompt_logprobs is not None:
            if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int):
                raise ParamError("`prompt_logprobs` must be an integer.", parameter="prompt_logprobs",
                                 value=prompt_logprobs)
            if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
                raise ParamError("`prompt_logprobs` are not available when `stream=True`.",
                                 parameter="prompt_logprobs")
            if prompt_logprobs < -1:
                raise ParamError("`prompt_logprobs` must be a positive value or -1.", parameter="prompt_logprobs",
                                 value=prompt_logprobs)
        structured = data.get("structured_outputs")
        if isinstance(structured, dict):
            count = sum(structured.get(k) is not None for k in ("json", "regex", "choice", "grammar"))
            if count > 1:
                raise ParamError("You can only use one kind of constraints for structured outputs "
                                 "('json', 'regex' or 'choice').")
        response_format = data.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
            schema = response_format.get("json_schema")
            if schema is None:
                raise ParamError("When response_format type is 'json_schema', the 'json_schema' field must be "
                                 "provided.", parameter="response_format")
            if isinstance(schema, dict) and schema.get("schema") is None:
                raise ParamError("When response_format type is 'json_schema', 'json_schema.schema' must be "
                                 "provided.", parameter="response_format")
        return data

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Unset or null: ``"auto"`` when ``tools`` are given, else ``"none"`` (vLLM's ``check_tool_usage``)."""
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_rules(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ParamError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        top = data.get("top_logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, (int, float)):
                raise ParamError("`top_logprobs` must be an integer.", parameter="top_logprobs", value=top)
            if top < 0 and top != -1:
                raise ParamError("`top_logprobs` must be a positive value or -1.", parameter="top_logprobs",
                                 value=top)
            if (top == -1 or top > 0) and not data.get("logprobs"):
                raise ParamError("when using `top_logprobs`, `logprobs` must be set to true.",
                                 parameter="top_logprobs")
        _check_tool_usage(data)
        return data

    @model_validator(mode="after")
    def _tool_choice_default(self) -> ChatCompletionRequest:
        if self.tool_choice is None:  # set after validation: a schema error's input is the body as sent
            self.tool_choice = "auto" if self.tools else "none"
        return self

    def output_budget(self) -> tuple[int | None, str]:
        """The requested output tokens and the field that asked for them."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def _check_tool_usage(data: dict[str, Any]) -> None:
    """vLLM's ``check_tool_usage``: consistency of ``tool_choice`` (or its default) with ``tools``."""
    if data.get("tools") == []:
        raise ParamError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.", parameter="tools")
    choice = data.get("tool_choice")
    if choice is None:
        choice = "auto" if data.get("tools") else "none"
    if choice == "none":
        return
    if not data.get("tools"):
        raise ParamError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise ParamError(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                         '"required" are supported.', parameter="tool_choice")
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise ParamError(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                             parameter="tool_choice.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ParamError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                             parameter="tool_choice.function.name")
        names = [t.get("function", {}).get("name") for t in data["tools"] if isinstance(t, dict)]
        if name not in names:
            raise ParamError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                             parameter="tool_choice")


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _completion_rules(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        logprobs = data.get("logprobs")
        if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs < -1:
            raise ParamError("`logprobs` must be a positive value or -1.", parameter="logprobs", value=logprobs)
        if data.get("prompt") is None or data.get("prompt") == "":
            raise ParamError("Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt")
        if data.get("suffix") is not None:
            raise ParamError("suffix is only supported for models with FIM completion rendering", parameter="suffix")
        return data

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as text or token ids; an empty list is refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestError("You must pass at least one prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


class TokenizeRequest(_Model):
    """``POST /tokenize``: the chat form when ``messages`` is present, the prompt form otherwise."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("messages") is None and data.get("prompt") is None:  # neither branch of vLLM's union fits
            raise validation_error([{"type": "missing", "loc": ("body", field), "msg": "Field required",
                                     "input": data} for field in ("prompt", "messages")])
        if data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise ParamError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class DetokenizeRequest(_Model):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: Any) -> M:
    """``body`` validated as ``model``; any failure is a 400 :class:`RequestError` with vLLM's message."""
    if body is None:
        raise validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    if not isinstance(body, dict):
        raise validation_error([{"type": "model_attributes_type", "loc": ("body",),
                                 "msg": "Input should be a valid dictionary or object to extract fields from",
                                 "input": body}])
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    except ParamError as exc:
        raise RequestError(str(exc), param=exc.parameter) from None


def _from_validation(exc: ValidationError) -> RequestError:
    """A check of a request validator (``ParamError``) as itself; a schema failure as vLLM's handler answers it."""
    errors = exc.errors(include_url=False)
    for error in errors:
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, ParamError):
            return RequestError(str(cause), param=cause.parameter)
    return validation_error([{**e, "loc": ("body", *e["loc"])} for e in errors])
