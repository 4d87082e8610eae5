"""A pool's window from its replicas' (pure): discovery runs per replica, and the smallest window is the pool's."""

from __future__ import annotations

from typing import Sequence

from agentkv.backends import WindowInfo

__all__ = ["pool_window"]


def pool_window(infos: Sequence[WindowInfo]) -> tuple[WindowInfo, tuple[int, ...]]:
    """The pool's :class:`~agentkv.backends.WindowInfo` and, when its replicas disagree, their distinct windows
    (sorted; empty when they agree). The smallest known window is used (a request that fits it fits every replica);
    the model is known when any replica listed it; no known window leaves the first replica's answer."""
    known = [info for info in infos if info.window is not None]
    if not known:
        return infos[0], ()
    smallest = min(known, key=lambda info: info.window or 0)
    windows = tuple(sorted({info.window for info in known if info.window is not None}))
    listed = [info.model_known for info in infos if info.model_known is not None]
    model_known = any(listed) if listed else None
    return WindowInfo(smallest.window, smallest.source, model_known), windows if len(windows) > 1 else ()
