"""The words settings arrive in, read at the edge: numbers as strings (YAML 1.1 reads ``1e-4`` as
one), verl's ratio bands ``"lo_hi"`` (held as ``Band(lo, hi)``), verl's first-generation keys and
rejection modes. A value outside them raises :class:`ConfigError`, naming the key and what is allowed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

__all__ = ["ConfigError", "MissingSettingError", "Band", "invalid", "as_float", "read_threshold", "threshold_parts",
           "as_text", "FIRST_GENERATION_KEYS", "LEGACY_RS", "canonical", "SKYRL_KEYS", "from_skyrl"]


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


#: SkyRL's ``trainer.algorithm.off_policy_correction`` keys and their defaults (``OffPolicyCorrectionConfig``).
SKYRL_KEYS = {"tis_ratio_type": None, "token_tis_ratio_clip_high": 2.0, "sequence_tis_ratio_clip_high": 5.0,
              "sequence_mask_metric": None, "geo_mask_high": 1.01, "geo_mask_low": 0.99, "product_mask_high": 2.0,
              "product_mask_low": 0.5, "outlier_token_is_threshold_low": None,
              "outlier_token_is_threshold_high": None, "token_mask_is_threshold_low": None,
              "token_mask_is_threshold_high": None}


def from_skyrl(data: dict[str, Any]) -> dict[str, Any]:
    """Our keys for a SkyRL ``off_policy_correction`` block (every key in :data:`SKYRL_KEYS`):

    * ``tis_ratio_type`` token | sequence → ``rollout_is`` token | sequence, truncated at
      ``token_tis_ratio_clip_high`` / ``sequence_tis_ratio_clip_high``;
    * ``token_mask_is_threshold_low/high`` (both set) → ``token_k1`` on the band [low, high];
    * ``sequence_mask_metric`` geometric | product → ``seq_mean_k1`` on [geo_mask_low, geo_mask_high] |
      ``seq_sum_k1`` on [product_mask_low, product_mask_high];
    * ``outlier_token_is_threshold_low`` / ``_high`` → ``rollout_token_veto_threshold`` / ``_high``.
    """
    d = {**SKYRL_KEYS, **data}
    out: dict[str, Any] = {"rollout_is": None}
    level = d["tis_ratio_type"]
    if level is not None:
        if level not in ("token", "sequence"):
            raise ConfigError(f"SkyRL off_policy_correction.tis_ratio_type={level!r} is invalid: allowed values "
                              "are null, token, sequence")
        out["rollout_is"] = level
        out["rollout_is_threshold"] = as_float(f"{level}_tis_ratio_clip_high", d[f"{level}_tis_ratio_clip_high"])
    options, bands = [], []
    if d["token_mask_is_threshold_low"] is not None and d["token_mask_is_threshold_high"] is not None:
        options.append("token_k1")
        bands.append((d["token_mask_is_threshold_low"], d["token_mask_is_threshold_high"]))
    metric = d["sequence_mask_metric"]
    if metric is not None:
        if metric not in ("geometric", "product"):
            raise ConfigError(f"SkyRL off_policy_correction.sequence_mask_metric={metric!r} is invalid: allowed "
                              "values are null, geometric, product")
        prefix = "geo" if metric == "geometric" else "product"
        options.append("seq_mean_k1" if metric == "geometric" else "seq_sum_k1")
        bands.append((d[f"{prefix}_mask_low"], d[f"{prefix}_mask_high"]))
    if options:
        out["rollout_rs"] = ",".join(options)
        out["rollout_rs_threshold"] = tuple((float(lo), float(hi)) for lo, hi in bands)
    out["rollout_token_veto_threshold"] = d["outlier_token_is_threshold_low"]
    out["rollout_token_veto_threshold_high"] = d["outlier_token_is_threshold_high"]
    return out
