"""``@agentkv.session``: run a tool loop inside a Session without threading it through every call.

    import agentkv
    from agentkv.decorator import completion

    @agentkv.session(fast=fast, slow=slow, tenant="acme")
    def solve(task: str) -> str:
        resp = completion(messages=[{"role": "user", "content": task}], max_tokens=256)  # routed
        return resp.choices[0].message.content

The body runs with its Session in a :class:`contextvars.ContextVar`: :func:`current_session` returns
it and the module-level :func:`completion`/:func:`acompletion` route through it. Context variables
make it safe across ``asyncio.gather`` tasks (each sees its own Session) and carry it into
``asyncio.to_thread``; a plain ``threading.Thread`` does not copy context, so run its target with
``contextvars.copy_context().run``.

Rules:

- **Defaults.** The bare ``@agentkv.session`` takes its Session arguments from :func:`configure`
  (call it once at start-up); arguments given to the decorator win over them. A Session needs
  ``fast``: without one the call raises :class:`~agentkv.errors.ConfigurationError`.
- **One Session per call**, with a fresh session id, unless the call passes ``session_id=``. A call
  may also pass ``tenant=``, which wins over the decorator's. These two keywords are removed from
  the call before the function runs, unless the function's signature names them as parameters, in
  which case the function receives them as well.
- **Nesting.** A decorated function called inside another reuses the outer Session, unless it was
  decorated with ``new=True`` or asks for a different tenant or session id.
- **Lifetime.** Sessions a call opened are closed when it returns or raises; a generator's Session
  opens at its first step and closes when it is exhausted, closed, or raises. Between a generator's
  steps, its caller does not see the generator's Session. Closing never cancels a warm-ahead the
  call fired (async ones included; each is bounded by its own timeout): a function that handles one
  turn of a longer conversation (``session_id=`` per call) still pre-pays the next escalation.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from agentkv.errors import AgentKVError, ConfigurationError
from agentkv._session import Session

F = TypeVar("F", bound=Callable[..., Any])

CALL_KEYS = ("session_id", "tenant")
_CURRENT: contextvars.ContextVar[Session | None] = contextvars.ContextVar("agentkv_session", default=None)
_DEFAULTS: dict[str, Any] = {}
_DEFAULTS_LOCK = threading.Lock()
_SESSION_SIGNATURE = inspect.signature(Session)


class NoSessionError(AgentKVError, RuntimeError):
    """A module-level :func:`completion` was called outside any ``@agentkv.session`` function."""


def configure(**session_kwargs: Any) -> dict[str, Any]:
    """Set the Session arguments the bare ``@agentkv.session`` uses; returns the previous ones.

        agentkv.decorator.configure(fast=Backend(...), slow=Backend(...), cache_salt_secret="...")
        previous = configure(fast=other); ...; configure(**previous)   # restore
        configure()                                                        # clear

    Read at each call, so configuring after decorating works.
    """
    _check_session_kwargs(session_kwargs, "configure()")
    with _DEFAULTS_LOCK:
        previous = dict(_DEFAULTS)
        _DEFAULTS.clear()
        _DEFAULTS.update(session_kwargs)
    return previous


def current_session() -> Session | None:
    """The Session of the innermost ``@agentkv.session`` call running in this context, or None."""
    return _CURRENT.get()


def completion(**kwargs: Any) -> Any:
    """:meth:`Session.completion` on the current Session (raises :class:`NoSessionError` outside one)."""
    return _require().completion(**kwargs)


async def acompletion(**kwargs: Any) -> Any:
    """:meth:`Session.acompletion` on the current Session (raises :class:`NoSessionError` outside one)."""
    return await _require().acompletion(**kwargs)


def session(func: Callable[..., Any] | None = None, /, *, new: bool = False, **session_kwargs: Any) -> Any:
    """Decorate a sync function, coroutine function, generator or async generator to run in a Session.

    Usable bare (``@agentkv.session``, defaults from :func:`configure`) or with any
    :class:`~agentkv.Session` keyword (``@agentkv.session(fast=..., slow=..., tenant=...)``).
    ``new=True`` gives the call its own Session even inside another decorated call.
    """
    _check_session_kwargs(session_kwargs, "@agentkv.session")
    spec = _Spec(new, dict(session_kwargs))

    def decorate(target: F) -> F:
        if not callable(target):
            raise TypeError(f"@agentkv.session decorates a function, got {type(target).__name__}")
        return _wrap(target, spec)

    return decorate if func is None else decorate(func)


# ----------------------------------------------------------------------------- opening a Session
@dataclass(frozen=True)
class _Spec:
    """What a decorator was given: whether to force a new Session, and Session keywords."""

    new: bool
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def wanted(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The tenant and session id this call asks for (the call's win over the decorator's)."""
        wanted = {k: self.kwargs[k] for k in CALL_KEYS if self.kwargs.get(k) is not None}
        wanted.update({k: v for k, v in options.items() if v is not None})
        return wanted

    def enter(self, options: Mapping[str, Any]) -> tuple[Session, bool]:
        """The Session for one call and whether the call owns it (and must close it)."""
        wanted = self.wanted(options)
        outer = _CURRENT.get()
        if outer is not None and not self.new and all(getattr(outer, k) == v for k, v in wanted.items()):
            return outer, False
        with _DEFAULTS_LOCK:
            kwargs = {**_DEFAULTS, **self.kwargs, **wanted}
        if kwargs.get("fast") is None:
            raise ConfigurationError(
                "@agentkv.session has no fast backend: decorate with @agentkv.session(fast=Backend(...), "
                "slow=Backend(...)) or call agentkv.decorator.configure(fast=..., slow=...) at start-up")
        return Session(**kwargs), True


def _check_session_kwargs(kwargs: Mapping[str, Any], where: str) -> None:
    try:
        _SESSION_SIGNATURE.bind_partial(**kwargs)
    except TypeError as exc:
        raise ConfigurationError(f"{where}: {exc} (accepted: Session's keyword arguments)") from None


def _require() -> Session:
    current = _CURRENT.get()
    if current is None:
        raise NoSessionError("agentkv.decorator.completion() was called outside an @agentkv.session function")
    return current


def _split_call(signature: inspect.Signature, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The call's agentkv options and the kwargs to call the function with (see the module's rules)."""
    kwargs = dict(kwargs)
    options: dict[str, Any] = {}
    bound: Mapping[str, Any] | None = None
    for name in CALL_KEYS:
        param = signature.parameters.get(name)
        if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            options[name] = kwargs.pop(name, None)
            continue
        if bound is None:
            bound = _bound(signature, args, kwargs)
        options[name] = bound.get(name)
    return options, kwargs


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        return signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # the call itself is wrong: let the function raise its own TypeError
        return {}


# ----------------------------------------------------------------------------- the four wrappers
def _wrap(func: F, spec: _Spec) -> F:
    signature = inspect.signature(func)
    if inspect.isasyncgenfunction(func):
        wrapper = _async_generator(func, spec, signature)
    elif inspect.iscoroutinefunction(func):
        wrapper = _coroutine(func, spec, signature)
    elif inspect.isgeneratorfunction(func):
        wrapper = _generator(func, spec, signature)
    else:
        wrapper = _function(func, spec, signature)
    return functools.wraps(func)(wrapper)  # type: ignore[return-value]


def _function(func: Callable[..., Any], spec: _Spec, signature: inspect.Signature) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        options, kwargs = _split_call(signature, args, kwargs)
        current, owned = spec.enter(options)
        token = _CURRENT.set(current)
        try:
            return func(*args, **kwargs)
        finally:
            _CURRENT.reset(token)
            if owned:
                current.close()

    return wrapper


def _coroutine(func: Callable[..., Any], spec: _Spec, signature: inspect.Signature) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        options, kwargs = _split_call(signature, args, kwargs)
        current, owned = spec.enter(options)
        token = _CURRENT.set(current)
        try:
            return await func(*args, **kwargs)
        finally:
            _CURRENT.reset(token)
            if owned:
                current.close()  # not aclose(): the call's warms keep running (see the module's rules)

    return wrapper


def _generator(func: Callable[..., Any], spec: _Spec, signature: inspect.Signature) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        options, kwargs = _split_call(signature, args, kwargs)
        current, owned = spec.enter(options)
        try:
            return (yield from _steps(func(*args, **kwargs), current))
        finally:
            if owned:
                current.close()

    return wrapper


def _steps(inner: Any, current: Session) -> Any:
    """Drive ``inner`` with ``current`` set only while one of its steps runs (send, throw and close pass through)."""
    step, value = inner.send, None
    while True:
        token = _CURRENT.set(current)
        try:
            item = step(value)
        except StopIteration as stop:
            return stop.value
        finally:
            _CURRENT.reset(token)
        try:
            value, step = (yield item), inner.send
        except GeneratorExit:
            token = _CURRENT.set(current)
            try:
                inner.close()
            finally:
                _CURRENT.reset(token)
            raise
        except BaseException as exc:  # thrown in by the caller: hand it to the inner generator
            value, step = exc, inner.throw


def _async_generator(func: Callable[..., Any], spec: _Spec, signature: inspect.Signature) -> Callable[..., Any]:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        options, kwargs = _split_call(signature, args, kwargs)
        current, owned = spec.enter(options)
        inner = func(*args, **kwargs)
        step, value = inner.asend, None
        try:
            while True:
                token = _CURRENT.set(current)
                try:
                    item = await step(value)
                except StopAsyncIteration:
                    return
                finally:
                    _CURRENT.reset(token)
                try:
                    value, step = (yield item), inner.asend
                except GeneratorExit:
                    token = _CURRENT.set(current)
                    try:
                        await inner.aclose()
                    finally:
                        _CURRENT.reset(token)
                    raise
                except BaseException as exc:  # thrown in by the caller: hand it to the inner generator
                    value, step = exc, inner.athrow
        finally:
            if owned:
                current.close()  # not aclose(): the call's warms keep running (see the module's rules)

    return wrapper
