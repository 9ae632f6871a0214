"""The words settings arrive in, read at the edge: numbers as strings (YAML 1.1 reads ``1e-4`` as
one), verl's ratio bands ``"lo_hi"`` (held as ``Band(lo, hi)``), verl's first-generation keys and
rejection modes. A value outside them raises :class:`ConfigError`, naming the key and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = ["ConfigError", "MissingSettingError", "Band", "invalid", "as_float", "read_threshold", "threshold_parts",
           "as_text", "FIRST_GENERATION_KEYS", "LEGACY_RS", "canonical"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is allowed."""


class MissingSettingError(ConfigError, TypeError):
    """A setting the others require is None. Also a ``TypeError``: verl raises that type for a
    missing threshold, and code written against verl may catch it."""


class Band(NamedTuple):
    """Ratio bounds lo ≤ ρ ≤ hi (verl's ``"lo_hi"``)."""

    lo: float
    hi: float


def invalid(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"RolloutCorrectionConfig.{key}={value!r} is invalid: {allowed}")


def as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise invalid(key, value, "expected a number, not a boolean")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise invalid(key, value, "expected a number") from None
    if math.isnan(out):
        raise invalid(key, value, "expected a number, got NaN")
    return out


def read_threshold(key: str, value: Any) -> float | Band:
    """A number, or a band from ``"lo_hi"`` or ``(lo, hi)`` (bounds positive and ordered)."""
    raw = value
    if isinstance(value, str) and "_" in value:
        value = value.strip().split("_", 1)
    elif not isinstance(value, (tuple, list)):
        return as_float(key, value)
    if len(value) != 2:
        raise invalid(key, raw, "a band is written 'lower_upper' (e.g. '0.5_2.0') or (lower, upper)")
    lo, hi = (as_float(key, v) for v in value)
    if not (lo > 0 and hi > 0):
        raise invalid(key, raw, "ratio bounds must be positive, written 'lower_upper' (e.g. '0.5_2.0')")
    if lo > hi:
        raise invalid(key, raw, f"lower bound {lo} exceeds upper bound {hi}")
    return Band(lo, hi)


def threshold_parts(value: Any) -> list[Any]:
    """The per-option parts of a rejection threshold: ``"a,b"`` or a sequence (a ``Band`` is one part)."""
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    return list(value) if isinstance(value, (tuple, list)) and not isinstance(value, Band) else [value]


def as_text(value: Any) -> Any:
    """A threshold as verl writes it: a band as ``"lo_hi"``, per-option parts joined by commas."""
    if isinstance(value, Band):
        return f"{value.lo!r}_{value.hi!r}"
    return ",".join(str(as_text(v)) for v in value) if isinstance(value, tuple) else value


#: Keys of the first verl generation (and ``_target_``, written by some config systems) -> meaning.
FIRST_GENERATION_KEYS = {
    "bypass_old_logprob_for_rollout": "true → bypass_mode: true",
    "use_pure_rollout_correction": "true → bypass_mode: true, loss_type: reinforce",
    "use_policy_gradient": "true → bypass_mode: true, loss_type: reinforce",
    "_target_": "ignored (class path written by some config systems)",
}
#: First-generation ratio-band rejection modes and the k1 option each one is equivalent to.
LEGACY_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
_NUMBERS = ("rollout_is_threshold_lower", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
            "rollout_opsm_delta", "rollout_m2po_threshold", "rollout_token_veto_threshold_high")


def canonical(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the first-generation keys translated and numeric strings read as numbers."""
    data = dict(data)
    data.pop("_target_", None)
    if data.pop("bypass_old_logprob_for_rollout", None):
        data["bypass_mode"] = True
    pure, pg = data.pop("use_pure_rollout_correction", None), data.pop("use_policy_gradient", None)
    if pure or pg:
        data.update(bypass_mode=True, loss_type="reinforce")
    return {k: as_float(k, v) if k in _NUMBERS and isinstance(v, str) else v for k, v in data.items()}
