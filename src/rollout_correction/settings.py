"""One setting from whatever an engine keeps its settings in (:func:`config_value`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["config_value"]


_MISSING = object()


def config_value(source: Any, key: str, default: Any = None, *, aliases: tuple[str, ...] = ()) -> Any:
    """``source[key]`` from whatever holds settings — a mapping, an OmegaConf node, a config
    object with ``get``, a dataclass or a namespace — or ``default`` when ``source`` is None or
    has neither ``key`` nor one of ``aliases`` (older names, tried in order)."""
    if source is None:
        return default
    for k in (key, *aliases):
        if isinstance(source, Mapping):
            if k in source:
                return source[k]
            continue
        if hasattr(source, k):
            return getattr(source, k)
        getter = getattr(source, "get", None)
        if callable(getter):
            try:
                value = getter(k, _MISSING)
            except (KeyError, AttributeError, TypeError):
                continue
            if value is not _MISSING:
                return value
    return default
