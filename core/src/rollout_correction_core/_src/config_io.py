"""Reading a config from dicts, YAML, OmegaConf or any object holding settings (``Loading``, a mixin
of ``RolloutCorrectionConfig``; :func:`settings_dict`), and writing it back."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from .vocab import FIRST_GENERATION_KEYS, ConfigError, as_text, canonical

__all__ = ["Loading", "settings_dict"]


class Loading:
    """Loading, writing and dict-style access of a dataclass config."""

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style access, as trainers that treat configs as mappings expect."""
        return getattr(self, key, default) if key in self.keys() else default

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        """Every key, bands written ``"lo_hi"`` as verl writes them; ``from_dict`` reads it back."""
        return {k: as_text(getattr(self, k)) for k in self.keys()}

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` applied (validated again)."""
        return self.from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Build from a mapping (or anything :func:`settings_dict` reads) with any key of either verl
        generation; an unknown key raises an error naming it and the closest known key. (SkyRL's
        ``off_policy_correction`` block: ``from_dict(rollout_correction.compat.skyrl.from_skyrl(block))``.)"""
        if data is None:
            return cls()
        data = settings_dict(data)
        known = set(cls.keys()) | set(FIRST_GENERATION_KEYS)
        unknown = [k for k in data if k not in known]
        if unknown:
            parts = []
            for k in unknown:
                hint = difflib.get_close_matches(str(k), sorted(known), n=1)
                parts.append(f"{k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            raise ConfigError(f"unknown RolloutCorrectionConfig key(s): {', '.join(parts)}; "
                              f"known keys: {sorted(known - {'_target_'})}")
        return cls(**canonical(data))

    @classmethod
    def from_yaml(cls, source: str, key: str | None = None) -> Any:
        """Load from a YAML file path or YAML text; ``key`` selects a nested block,
        e.g. ``"algorithm.rollout_correction"``."""
        import os

        import yaml  # optional dependency: pip install pyyaml (or 'rollout-correction[yaml]')

        text = source
        if os.path.exists(source):
            with open(source, encoding="utf-8") as f:
                text = f.read()
        data = yaml.safe_load(text)
        data = {} if data is None else data
        if not isinstance(data, Mapping):
            looks_like_path = "\n" not in text and ":" not in text
            raise ConfigError(
                f"no such YAML file: {source!r}; pass an existing path or YAML text with the config keys"
                if looks_like_path else
                f"the YAML must be a mapping of config keys, got a {type(data).__name__}: {text[:60]!r}")
        path = key.split(".") if key else []
        for i, part in enumerate(path):
            if not isinstance(data, Mapping) or part not in data:
                where = ".".join(path[:i]) or "the top level"
                have = sorted(data) if isinstance(data, Mapping) else type(data).__name__
                raise ConfigError(f"key={key!r}: no {part!r} under {where} of the YAML (found: {have})")
            data = data[part]
        return cls.from_dict(data)

    @classmethod
    def from_omegaconf(cls, cfg: Any) -> Any:
        """Load from an OmegaConf ``DictConfig`` (interpolations are resolved)."""
        return cls.from_dict(cfg)


def _is_omegaconf(obj: Any) -> bool:
    try:
        from omegaconf import OmegaConf  # optional dependency
    except ImportError:  # pragma: no cover
        return False
    return OmegaConf.is_config(obj)


def settings_dict(obj: Any) -> dict[str, Any]:
    """A plain dict of settings from a mapping, an OmegaConf node (interpolations resolved), a
    dataclass instance (fields starting with ``_`` skipped), an object with ``to_dict()`` or one
    with attributes; the keys are not checked (that is ``from_dict``'s job)."""
    if _is_omegaconf(obj):
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(obj, resolve=True)
        if not isinstance(data, dict):
            raise TypeError(f"expected an OmegaConf mapping of config keys, got a {type(obj).__name__}")
        return data  # type: ignore[return-value]
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    raise TypeError(f"cannot read a RolloutCorrectionConfig from {type(obj).__name__}: pass a preset name, "
                    "a dict of config keys, an OmegaConf node, a dataclass, a RolloutCorrectionConfig or None")
