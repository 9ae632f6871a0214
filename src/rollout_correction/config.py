"""``RolloutCorrectionConfig``: every documented key, validated at construction, with presets.

The config accepts both generations of the public vocabulary:

* the first (``bypass_old_logprob_for_rollout``, ``use_pure_rollout_correction``,
  ``rollout_rs`` = ``token`` | ``sequence`` | ``geometric`` with ``rollout_rs_threshold`` /
  ``rollout_rs_threshold_lower``, ``rollout_token_veto_threshold``), and
* the current one (``bypass_mode`` + ``loss_type``, comma-chained divergence options
  ``token_k1`` … ``seq_max_k3`` with ``"lo_hi"`` ratio bounds for k1, IcePop ``"lo_hi"`` IS
  thresholds),

plus slime's IS modes (``truncate`` / ``clip`` / ``mask``) and the ``geometric`` IS level.
Everything is normalised once, here, into two small resolved specs (:class:`ISSpec` and a tuple
of :class:`RSOption`) that the computation reads; nothing is re-parsed per call.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

__all__ = ["RolloutCorrectionConfig", "ISSpec", "RSOption", "SAFETY_BOUND", "RS_OPTIONS"]

#: Log-space clamp applied before every ``exp``: weights live in [e^-20, e^20] ≈ [2e-9, 4.9e8].
SAFETY_BOUND = 20.0

IsLevel = Literal["token", "sequence", "geometric"]
IsMode = Literal["truncate", "clip", "mask"]
LossType = Literal["ppo_clip", "reinforce"]
NonFinitePolicy = Literal["reject", "raise"]

_IS_LEVELS = ("token", "sequence", "geometric")
_IS_MODES = ("truncate", "clip", "mask")
_LOSS_TYPES = ("ppo_clip", "reinforce")
_NONFINITE = ("reject", "raise")

#: Divergence-based rejection options: name -> (aggregation, estimator).
RS_OPTIONS: dict[str, tuple[str, str]] = {
    "token_k1": ("token", "k1"),
    "token_k2": ("token", "k2"),
    "token_k3": ("token", "k3"),
    "seq_sum_k1": ("seq_sum", "k1"),
    "seq_sum_k2": ("seq_sum", "k2"),
    "seq_sum_k3": ("seq_sum", "k3"),
    "seq_mean_k1": ("seq_mean", "k1"),
    "seq_mean_k2": ("seq_mean", "k2"),
    "seq_mean_k3": ("seq_mean", "k3"),
    "seq_max_k2": ("seq_max", "k2"),
    "seq_max_k3": ("seq_max", "k3"),
}
#: First-generation ratio-bound modes and the k1 option each one is equivalent to.
_LEGACY_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}

# Keys of earlier vocabularies (and of neighbouring configs) that are accepted and translated.
_ALIASES = {
    "bypass_old_logprob_for_rollout",
    "use_pure_rollout_correction",
    "use_policy_gradient",
    "_target_",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class ISSpec:
    """Resolved importance-sampling settings.

    ``mode``: ``truncate`` (w ← min(w, upper)), ``clip`` (w ← clamp(w, lower, upper)) or
    ``mask`` (IcePop: w ← w·1[lower ≤ w ≤ upper]; the response mask is left unchanged).
    ``metric_lower`` is the lower bound used by the ``*_fraction_low`` metrics: the configured
    lower bound, or 1/upper when none is configured.
    """

    level: str
    mode: str
    upper: float
    lower: Optional[float]
    metric_lower: float
    batch_normalize: bool


@dataclass(frozen=True)
class RSOption:
    """One rejection criterion.

    A token or sequence is kept iff its statistic lies in ``[stat_lower, stat_upper]``.
    For k1 options the statistic is k1 = −log ρ and the configured bounds are on the ratio:
    lo ≤ ρ ≤ hi  ⇔  −log hi ≤ k1 ≤ −log lo, so ``stat_lower = −log hi`` and
    ``stat_upper = −log lo``. For k2/k3 ``stat_lower`` is None (one upper bound).
    ``legacy`` names the first-generation mode this option was configured as, if any.
    """

    name: str
    agg: str  # token | seq_sum | seq_mean | seq_max
    estimator: str  # k1 | k2 | k3
    stat_lower: Optional[float]
    stat_upper: float
    legacy: Optional[str] = None


def _err(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"RolloutCorrectionConfig.{key}={value!r} is invalid: {allowed}")


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise _err(key, value, "expected a number, not a boolean")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise _err(key, value, "expected a number") from None
    if math.isnan(out):
        raise _err(key, value, "expected a number, got NaN")
    return out


def _parse_ratio_band(key: str, spec: Any, *, allow_zero_lower: bool = False) -> tuple[float, float]:
    """Parse ``"lo_hi"`` (or a single ``x`` meaning [1/x, x]) into ratio bounds."""
    text = str(spec).strip() if not isinstance(spec, (int, float)) or isinstance(spec, bool) else None
    if text is not None and "_" in text:
        lo_s, hi_s = text.split("_", 1)
        lo, hi = _as_float(key, lo_s), _as_float(key, hi_s)
    else:
        hi = _as_float(key, spec if text is None else text)
        if hi <= 0:
            raise _err(key, spec, "a single bound x means [1/x, x] and must be > 0")
        lo = 1.0 / hi
    if hi <= 0 or lo < 0 or (lo == 0 and not allow_zero_lower):
        raise _err(key, spec, "ratio bounds must be positive, written 'lower_upper' (e.g. '0.5_2.0')")
    if lo > hi:
        raise _err(key, spec, f"lower bound {lo} exceeds upper bound {hi}")
    return lo, hi


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Settings of rollout correction; validated at construction.

    Keys (see ``docs/config.md`` for the full reference):

    rollout_is: IS weight level, ``None`` (no weights), ``"token"`` (ρ_t), ``"sequence"``
        (∏ρ_t = exp Σ log ρ_t) or ``"geometric"`` (exp mean log ρ_t).
    rollout_is_threshold: a number C → truncate weights above C (TIS); a string ``"lo_hi"`` →
        IcePop (weights outside [lo, hi] become 0, the response mask is unchanged).
    rollout_is_threshold_lower: lower bound for ``rollout_is_mode="clip"`` / ``"mask"`` with a
        numeric threshold (default 1/upper).
    rollout_is_mode: ``"truncate"`` | ``"clip"`` | ``"mask"``; inferred from the threshold when
        None (number → truncate, ``"lo_hi"`` → mask).
    rollout_is_batch_normalize: rescale weights to mean 1 after truncation (over valid tokens
        for token level, over sequences with ≥ 1 valid token for sequence/geometric level).
    rollout_rs: comma-chained rejection options (all must accept), from ``token_k1/k2/k3``,
        ``seq_sum_k1/k2/k3``, ``seq_mean_k1/k2/k3``, ``seq_max_k2/k3``; or one first-generation
        mode ``"token"`` | ``"sequence"`` | ``"geometric"`` (ratio bounds).
    rollout_rs_threshold: one spec per option (comma-separated) or one shared: k1 options take
        ratio bounds ``"lo_hi"`` (a single x means [1/x, x]); k2/k3 one upper bound. For the
        first-generation modes: the upper ratio bound (defaults to ``rollout_is_threshold``).
    rollout_rs_threshold_lower: first-generation lower ratio bound (default 1/upper).
    rollout_token_veto_threshold: reject a sequence if any valid token has unclamped ρ_t < C.
    bypass_mode: π_old := π_rollout (two policies); the loss clips against the rollout policy.
    loss_type: bypass-mode loss, ``"ppo_clip"`` or ``"reinforce"`` (−sg(w)·A·log π_θ).
    on_nonfinite: what to do with NaN/±inf log-probs at valid positions: ``"reject"`` the
        sequence and count it (metric ``nonfinite_seq_fraction``) or ``"raise"``.
    check_alignment: also test whether the rollout log-probs look shifted by one token against
        the trainer's (``alignment_*`` metrics; a :class:`MisalignmentWarning` when they do).
        Costs a few passes and one device sync, so it is off by default.
    """

    rollout_is: Optional[str] = None
    rollout_is_threshold: Optional[Union[float, str]] = 2.0
    rollout_is_threshold_lower: Optional[float] = None
    rollout_is_mode: Optional[str] = None
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[float, str]] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"
    on_nonfinite: str = "reject"
    check_alignment: bool = False

    # Resolved settings, derived in __post_init__.
    is_spec: Optional[ISSpec] = field(init=False, repr=False, compare=False, default=None)
    rs_options: tuple[RSOption, ...] = field(init=False, repr=False, compare=False, default=())

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        for key in ("rollout_is_batch_normalize", "bypass_mode", "check_alignment"):
            if not isinstance(getattr(self, key), bool):
                raise _err(key, getattr(self, key), "expected true or false")
        if self.loss_type not in _LOSS_TYPES:
            raise _err("loss_type", self.loss_type, f"allowed values are {list(_LOSS_TYPES)}")
        if self.on_nonfinite not in _NONFINITE:
            raise _err("on_nonfinite", self.on_nonfinite, f"allowed values are {list(_NONFINITE)}")
        object.__setattr__(self, "is_spec", self._resolve_is())
        object.__setattr__(self, "rs_options", self._resolve_rs())
        veto = self.rollout_token_veto_threshold
        if veto is not None:
            v = _as_float("rollout_token_veto_threshold", veto)
            if not v > 0:
                raise _err("rollout_token_veto_threshold", veto, "must be a positive ratio, e.g. 1e-4")

    def _resolve_is(self) -> Optional[ISSpec]:
        level = self.rollout_is
        if level is None:
            if self.rollout_is_mode is not None and self.rollout_is_mode not in _IS_MODES:
                raise _err("rollout_is_mode", self.rollout_is_mode, f"allowed values are {list(_IS_MODES)}")
            return None
        if level not in _IS_LEVELS:
            raise _err("rollout_is", level, f"allowed values are None or {list(_IS_LEVELS)}")
        spec = self.rollout_is_threshold
        if spec is None:
            raise _err("rollout_is_threshold", spec, f"required when rollout_is={level!r}")
        lower: Optional[float] = None
        if isinstance(spec, str) and "_" in spec.strip():
            lower, upper = _parse_ratio_band("rollout_is_threshold", spec)
            inferred = "mask"
        else:
            upper = _as_float("rollout_is_threshold", spec)
            inferred = "truncate"
        if not upper > 0:
            raise _err("rollout_is_threshold", spec, "the upper bound must be > 0")
        mode = self.rollout_is_mode or inferred
        if mode not in _IS_MODES:
            raise _err("rollout_is_mode", mode, f"allowed values are {list(_IS_MODES)}")
        if self.rollout_is_threshold_lower is not None:
            if lower is not None:
                raise _err("rollout_is_threshold_lower", self.rollout_is_threshold_lower,
                           "give the lower bound either here or in rollout_is_threshold='lo_hi', not both")
            lower = _as_float("rollout_is_threshold_lower", self.rollout_is_threshold_lower)
            if not 0 <= lower <= upper:
                raise _err("rollout_is_threshold_lower", lower, f"must lie in [0, upper={upper}]")
        if mode in ("clip", "mask") and lower is None:
            lower = 1.0 / upper
        if mode == "truncate" and lower is not None and self.rollout_is_threshold_lower is None:
            raise _err("rollout_is_mode", mode,
                       "a 'lo_hi' threshold needs mode 'mask' (IcePop) or 'clip', not 'truncate'")
        metric_lower = lower if lower is not None else 1.0 / upper
        return ISSpec(level, mode, upper, lower, metric_lower, self.rollout_is_batch_normalize)

    def _resolve_rs(self) -> tuple[RSOption, ...]:
        rs = self.rollout_rs
        if rs is None:
            if self.rollout_rs_threshold_lower is not None:
                raise _err("rollout_rs_threshold_lower", self.rollout_rs_threshold_lower,
                           "only meaningful with rollout_rs='token'|'sequence'|'geometric'")
            return ()
        if not isinstance(rs, str):
            raise _err("rollout_rs", rs, "expected a comma-separated string of options")
        names: list[str] = []
        for part in rs.split(","):
            part = part.strip()
            if part and part not in names:
                names.append(part)
        if not names:
            raise _err("rollout_rs", rs, "expected at least one option")
        allowed = sorted(RS_OPTIONS) + sorted(_LEGACY_RS)
        for n in names:
            if n not in RS_OPTIONS and n not in _LEGACY_RS:
                hint = difflib.get_close_matches(n, allowed, n=1)
                raise _err("rollout_rs", rs, f"unknown option {n!r}"
                           + (f" (did you mean {hint[0]!r}?)" if hint else "") + f"; allowed: {allowed}")
        legacy = [n for n in names if n in _LEGACY_RS]
        if legacy:
            if len(names) > 1:
                raise _err("rollout_rs", rs, "the modes 'token'/'sequence'/'geometric' cannot be chained; "
                           "chain the k1 options instead (e.g. 'token_k1,seq_mean_k3')")
            return (self._legacy_option(legacy[0]),)
        if self.rollout_rs_threshold_lower is not None:
            raise _err("rollout_rs_threshold_lower", self.rollout_rs_threshold_lower,
                       "the k1/k2/k3 options take their bounds from rollout_rs_threshold ('lo_hi' for k1)")
        spec = self.rollout_rs_threshold
        if spec is None:
            raise _err("rollout_rs_threshold", spec, f"required when rollout_rs={rs!r}")
        specs = [p.strip() for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [spec]
        if len(specs) == 1:
            specs = specs * len(names)
        if len(specs) != len(names):
            raise _err("rollout_rs_threshold", spec,
                       f"give one threshold shared by all options or exactly {len(names)} (one per option)")
        out = []
        for name, s in zip(names, specs):
            agg, est = RS_OPTIONS[name]
            key = f"rollout_rs_threshold[{name}]"
            if est == "k1":
                lo, hi = _parse_ratio_band(key, s)
                out.append(RSOption(name, agg, est, -math.log(hi), -math.log(lo)))
            else:
                if isinstance(s, str) and "_" in s:
                    raise _err(key, s, f"{name} takes a single upper bound, not 'lo_hi'")
                up = _as_float(key, s)
                if not up > 0:
                    raise _err(key, s, "must be > 0")
                out.append(RSOption(name, agg, est, None, up))
        return tuple(out)

    def _legacy_option(self, mode: str) -> RSOption:
        spec = self.rollout_rs_threshold
        if spec is None:
            spec = self.rollout_is_threshold
        if spec is None or (isinstance(spec, str) and "_" in spec):
            raise _err("rollout_rs_threshold", self.rollout_rs_threshold,
                       f"rollout_rs={mode!r} needs a numeric upper ratio bound")
        upper = _as_float("rollout_rs_threshold", spec)
        if not upper > 0:
            raise _err("rollout_rs_threshold", spec, "must be > 0")
        lower = self.rollout_rs_threshold_lower
        lower = 1.0 / upper if lower is None else _as_float("rollout_rs_threshold_lower", lower)
        if not 0 <= lower <= upper:
            raise _err("rollout_rs_threshold_lower", lower, f"must lie in [0, upper={upper}]")
        stat_upper = math.inf if lower == 0 else -math.log(lower)
        name = _LEGACY_RS[mode]
        agg, est = RS_OPTIONS[name]
        return RSOption(name, agg, est, -math.log(upper), stat_upper, legacy=mode)

    # ------------------------------------------------------------------ derived flags
    @property
    def uses_pure_is(self) -> bool:
        """Bypass mode with the REINFORCE loss (first-generation ``use_pure_rollout_correction``)."""
        return self.bypass_mode and self.loss_type == "reinforce"

    @property
    def is_enabled(self) -> bool:
        return self.is_spec is not None

    @property
    def rs_enabled(self) -> bool:
        return bool(self.rs_options) or self.rollout_token_veto_threshold is not None

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style access, as trainers that treat configs as mappings expect."""
        return getattr(self, key, default) if key in self.keys() else default

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def replace(self, **changes: Any) -> "RolloutCorrectionConfig":
        """A copy with ``changes`` applied (validated again)."""
        return self.from_dict({**self.to_dict(), **changes})

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.keys()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "RolloutCorrectionConfig":
        """Build from a mapping with any documented key of either generation.

        ``bypass_old_logprob_for_rollout`` → ``bypass_mode``; ``use_pure_rollout_correction`` /
        ``use_policy_gradient`` → ``bypass_mode=True, loss_type="reinforce"``. Unknown keys
        raise an error naming them (with the closest known key).
        """
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            data = _to_container(data)
        data = dict(data)
        keys = set(cls.keys())
        unknown = [k for k in data if k not in keys and k not in _ALIASES]
        if unknown:
            parts = []
            for k in unknown:
                hint = difflib.get_close_matches(str(k), sorted(keys | _ALIASES), n=1)
                parts.append(f"{k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
            raise ConfigError(f"unknown RolloutCorrectionConfig key(s): {', '.join(parts)}; "
                              f"known keys: {sorted(keys | _ALIASES - {'_target_'})}")
        data.pop("_target_", None)
        legacy_bypass = data.pop("bypass_old_logprob_for_rollout", None)
        pure = data.pop("use_pure_rollout_correction", None)
        pg = data.pop("use_policy_gradient", None)
        if legacy_bypass:
            data["bypass_mode"] = True
        if pure or pg:
            data["bypass_mode"] = True
            data["loss_type"] = "reinforce"
        for k in ("rollout_is_threshold_lower", "rollout_rs_threshold_lower", "rollout_token_veto_threshold"):
            if isinstance(data.get(k), str):
                data[k] = _as_float(k, data[k])
        return cls(**data)

    @classmethod
    def from_yaml(cls, source: str, key: str | None = None) -> "RolloutCorrectionConfig":
        """Load from a YAML file path or YAML text; ``key`` selects a nested block,
        e.g. ``"algorithm.rollout_correction"``."""
        import os

        import yaml  # optional dependency: pip install 'rollout-correction[yaml]'

        text = open(source).read() if os.path.exists(source) else source
        data = yaml.safe_load(text) or {}
        for part in (key.split(".") if key else []):
            data = data[part]
        return cls.from_dict(data)

    @classmethod
    def from_omegaconf(cls, cfg: Any) -> "RolloutCorrectionConfig":
        """Load from an OmegaConf ``DictConfig`` (interpolations are resolved)."""
        return cls.from_dict(_to_container(cfg))

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset_names(cls) -> list[str]:
        """Every preset, by the name it has in verl's documentation generations."""
        return list(_PRESETS)

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> "RolloutCorrectionConfig":
        if name not in _PRESETS:
            hint = difflib.get_close_matches(name, list(_PRESETS), n=1)
            raise ConfigError(f"unknown preset {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + f"; available: {list(_PRESETS)}")
        return getattr(cls, name)(**kwargs)

    # Current generation (verl 0.9.1).
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Decoupled PPO × token-level TIS: w_t = min(ρ_t, C)."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Decoupled PPO × sequence-level TIS: w = min(∏ρ_t, C)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        """Decoupled PPO × token IcePop: w_t = ρ_t·1[lo ≤ ρ_t ≤ hi]."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.5_2.0"):
        """Sequence TIS + reject sequences whose ∏ρ_t lies outside the band (seq_sum_k1)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_sum_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        """Reject sequences whose geometric-mean ratio lies outside the band (seq_mean_k1)."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01):
        """Reject sequences whose mean k3 = mean(ρ − 1 − log ρ) exceeds the bound."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold,
                   rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def bypass_ppo_clip(cls):
        """PPO clipped against π_rollout (bypass); no IS weights."""
        return cls(bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01):
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0):
        """REINFORCE with sequence TIS: L = −sg(min(∏ρ_t, C))·A·log π_θ."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5):
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}",
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Union[str, float] = "0.999_1.001"):
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def disabled(cls):
        """Metrics only: no weights, no rejection."""
        return cls()

    # First generation (the names of the earlier documentation).
    @classmethod
    def token_is(cls, threshold: float = 2.0):
        return cls.decoupled_token_is(threshold)

    @classmethod
    def seq_is(cls, threshold: float = 2.0):
        return cls.decoupled_seq_is(threshold)

    @classmethod
    def seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                  rs_threshold_lower: Optional[float] = None):
        """Sequence TIS + sequence ratio-band rejection (lower bound defaults to 1/upper)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="sequence",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower)

    @classmethod
    def seq_mis(cls, threshold: float = 2.0):
        """Sequence masked IS: truncate at C and reject sequences with ∏ρ_t > C (no lower bound)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs="sequence",
                   rollout_rs_threshold=threshold, rollout_rs_threshold_lower=0.0)

    @classmethod
    def geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
               veto_threshold: Optional[float] = 1e-4):
        """Geometric-mean ratio rejection (lower bound defaults to 1/upper) + veto; no IS weights."""
        return cls(rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def geo_mis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001,
                rs_threshold_lower: Optional[float] = None, veto_threshold: Optional[float] = 1e-4):
        """Geometric-level IS weights + geometric rejection + veto."""
        return cls(rollout_is="geometric", rollout_is_threshold=is_threshold, rollout_rs="geometric",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower,
                   rollout_token_veto_threshold=veto_threshold)

    @classmethod
    def ppo_is_bypass(cls, threshold: float = 2.0):
        """PPO clipped against π_rollout; token IS weights reported as diagnostics only."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def pure_is(cls, threshold: float = 2.0):
        """Off-policy REINFORCE with sequence TIS (bypass)."""
        return cls.bypass_pg_is(threshold)

    @classmethod
    def pg_is(cls, threshold: float = 2.0):
        return cls.bypass_pg_is(threshold)

    @classmethod
    def pg_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
              veto_threshold: Optional[float] = 1e-4):
        """REINFORCE (bypass) with geometric rejection + veto; no IS weights."""
        base = cls.geo_rs(rs_threshold, rs_threshold_lower, veto_threshold)
        return base.replace(bypass_mode=True, loss_type="reinforce")


def _to_container(cfg: Any) -> dict[str, Any]:
    try:
        from omegaconf import OmegaConf  # optional dependency

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    if hasattr(cfg, "to_dict"):
        return dict(cfg.to_dict())
    if dataclasses.is_dataclass(cfg):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if hasattr(cfg, "__dict__"):
        return dict(vars(cfg))
    raise TypeError(f"cannot read a RolloutCorrectionConfig from {type(cfg).__name__}")


_PRESETS = [
    name
    for name in (
        "decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
        "decoupled_geo_rs", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs",
        "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs",
        "bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs",
        "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis", "disabled",
        "token_is", "seq_is", "seq_is_rs", "seq_mis", "geo_rs", "geo_mis", "ppo_is_bypass",
        "pure_is", "pg_is", "pg_rs",
    )
]
