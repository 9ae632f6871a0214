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
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union, get_args

from .constants import SAFETY_BOUND

__all__ = ["RolloutCorrectionConfig", "ConfigError", "ISSpec", "RSOption", "Preset", "PRESETS", "CONFIG_KEYS",
           "SAFETY_BOUND", "RS_OPTIONS", "as_config", "settings_dict", "config_value", "IsLevel", "IsMode", "LossType",
           "NonFinitePolicy", "RsAggregation", "DivergenceEstimator"]

IsLevel = Literal["token", "sequence", "geometric"]
IsMode = Literal["truncate", "clip", "mask"]
LossType = Literal["ppo_clip", "reinforce", "gspo", "cispo", "dppo_tv", "dppo_kl", "topr"]
NonFinitePolicy = Literal["reject", "raise"]
RsAggregation = Literal["token", "seq_sum", "seq_mean", "seq_max"]
DivergenceEstimator = Literal["k1", "k2", "k3"]

_IS_LEVELS: tuple[str, ...] = get_args(IsLevel)
_IS_MODES: tuple[str, ...] = get_args(IsMode)
_LOSS_TYPES: tuple[str, ...] = get_args(LossType)
_NONFINITE: tuple[str, ...] = get_args(NonFinitePolicy)
#: Losses defined on the ratio π_θ/π_rollout only (no π_old): they need ``bypass_mode=True``.
_BYPASS_ONLY_LOSSES = ("topr",)

#: Divergence-based rejection options: name -> (aggregation, estimator).
RS_OPTIONS: dict[str, tuple[RsAggregation, DivergenceEstimator]] = {
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


class MissingSettingError(ConfigError, TypeError):
    """A setting the others require is None. Also a ``TypeError``: verl raises that type for a
    missing threshold, and code written against verl may catch it."""


@dataclass(frozen=True)
class ISSpec:
    """Resolved importance-sampling settings.

    ``mode``: ``truncate`` (w ← min(w, upper)), ``clip`` (w ← clamp(w, lower, upper)) or
    ``mask`` (IcePop: w ← w·1[lower ≤ w ≤ upper]; the response mask is left unchanged).
    ``metric_lower`` is the lower bound used by the ``*_fraction_low`` metrics: the configured
    lower bound, or 1/upper when none is configured.
    """

    level: IsLevel
    mode: IsMode
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
    agg: RsAggregation
    estimator: DivergenceEstimator
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


#: Every key of :class:`RolloutCorrectionConfig`: key -> (allowed values, default, meaning). The one
#: place keys are documented: the class docstring, the README reference and docs/config.md are
#: generated from it.
CONFIG_KEYS: dict[str, tuple[str, str, str]] = {
    "rollout_is": ("null, token, sequence, geometric", "null",
                   "IS weight level: ρ_t per token; ∏ρ_t per sequence; exp(mean log ρ_t) per sequence. "
                   "null computes no weights (metrics only)."),
    "rollout_is_threshold": ("number C, or string \"lo_hi\"", "2.0",
                             "C truncates weights above C (TIS); \"lo_hi\" is IcePop: weights outside "
                             "[lo, hi] become 0, the response mask is unchanged."),
    "rollout_is_threshold_lower": ("number ≥ 0 or null", "null (1/upper)",
                                   "lower bound for rollout_is_mode clip / mask with a numeric threshold."),
    "rollout_is_mode": ("null, truncate, clip, mask", "null (inferred)",
                        "how the bound applies: truncate min(w, U); clip clamp(w, L, U); mask w·1[L≤w≤U]. "
                        "Inferred from the threshold when null."),
    "rollout_is_batch_normalize": ("true, false", "false",
                                   "divide weights by their batch mean after bounding (tokens for token "
                                   "level, sequences for sequence / geometric level)."),
    "rollout_rs": ("null or comma-chained options", "null",
                   "rejection criteria, all must accept: token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, "
                   "seq_max_k2/k3; or one of the first-generation modes token, sequence, geometric."),
    "rollout_rs_threshold": ("number or string, one per option or shared", "null",
                             "k1: ratio bounds \"lo_hi\" (a single x means [1/x, x]) on ρ_agg = exp(−k1_agg); "
                             "k2/k3: one upper bound. First-generation modes: the upper ratio bound "
                             "(defaults to rollout_is_threshold)."),
    "rollout_rs_threshold_lower": ("number ≥ 0 or null", "null (1/upper)",
                                   "first-generation modes: lower ratio bound."),
    "rollout_token_veto_threshold": ("positive number or null", "null",
                                     "reject a sequence if any valid token has unclamped ρ_t < C."),
    "bypass_mode": ("true, false", "false",
                    "π_old := π_rollout (two policies); the loss clips against the rollout policy."),
    "loss_type": ("ppo_clip, reinforce, gspo, cispo, dppo_tv, dppo_kl, topr", "ppo_clip",
                  "policy loss: PPO clip; REINFORCE −sg(w)·A·log π_θ (bypass only: pure IS); GSPO (PPO clip on "
                  "exp(mean log r)); CISPO −sg(clip r)·A·log π_θ; DPPO-TV / DPPO-KL (truncated-ratio REINFORCE "
                  "masked outside a probability-difference / binary-KL trust region); TOPR (bypass only: "
                  "weight 1 for A ≥ 0, min(∏r, 1) for A < 0). In decoupled mode the IS weights multiply the "
                  "loss; in bypass mode r = π_θ/π_rollout. See policy_losses.py."),
    "rollout_opsm_delta": ("number or null", "null",
                           "off-policy sequence masking (DeepSeek-V3.2): drop a sequence with advantage < 0 "
                           "whose mean log(π_rollout/π_θ) over its finite valid tokens exceeds δ. Applied in "
                           "compute_policy_loss (it needs advantages)."),
    "rollout_m2po_threshold": ("number ≥ 0 or null", "null",
                               "M2PO (AReaL m2_threshold): mask the tokens with the largest (log ρ_t)² until "
                               "the batch mean of (log ρ_t)² over the kept tokens is ≤ τ; batch-global over "
                               "the process group."),
    "on_nonfinite": ("reject, raise", "reject",
                     "NaN/±inf log-probs at valid positions: drop the sequence and count it, or raise."),
    "check_alignment": ("true, false", "false",
                        "also test whether the rollout log-probs look shifted by one token against the "
                        "trainer's (alignment_* metrics, a MisalignmentWarning when they do; one extra sync)."),
}


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Settings of rollout correction; validated at construction (keys below, generated from
    :data:`CONFIG_KEYS`; the reference with presets is docs/config.md).
    """

    rollout_is: Optional[IsLevel] = None
    rollout_is_threshold: Optional[Union[float, str]] = 2.0
    rollout_is_threshold_lower: Optional[float] = None
    rollout_is_mode: Optional[IsMode] = None
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Optional[Union[float, str]] = None
    rollout_rs_threshold_lower: Optional[float] = None
    rollout_token_veto_threshold: Optional[float] = None
    bypass_mode: bool = False
    loss_type: LossType = "ppo_clip"
    rollout_opsm_delta: Optional[float] = None
    rollout_m2po_threshold: Optional[float] = None
    on_nonfinite: NonFinitePolicy = "reject"
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
        if self.loss_type in _BYPASS_ONLY_LOSSES and not self.bypass_mode:
            raise _err("loss_type", self.loss_type, "it is a bypass-mode loss (ratio π_θ/π_rollout); set "
                       "bypass_mode=True, or use gspo / cispo / dppo_tv / dppo_kl / ppo_clip in decoupled mode")
        if self.rollout_opsm_delta is not None:
            delta = _as_float("rollout_opsm_delta", self.rollout_opsm_delta)
            if not math.isfinite(delta):
                raise _err("rollout_opsm_delta", self.rollout_opsm_delta, "expected a finite number, e.g. 0.05")
        if self.rollout_m2po_threshold is not None:
            tau = _as_float("rollout_m2po_threshold", self.rollout_m2po_threshold)
            if not (math.isfinite(tau) and tau >= 0):
                raise _err("rollout_m2po_threshold", self.rollout_m2po_threshold,
                           "expected a finite number ≥ 0, e.g. 0.04")
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
            raise MissingSettingError(_err("rollout_is_threshold", spec, f"required when rollout_is={level!r}"))
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
            raise MissingSettingError(_err("rollout_rs_threshold", spec, f"required when rollout_rs={rs!r}"))
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
        raise an error naming them (with the closest known key). Anything else :func:`as_config`
        reads (an OmegaConf node, a dataclass, a namespace) is accepted too.
        """
        if data is None:
            return cls()
        data = dict(data) if isinstance(data, Mapping) and not _is_omegaconf(data) else settings_dict(data)
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
        for k in ("rollout_is_threshold_lower", "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                  "rollout_opsm_delta", "rollout_m2po_threshold"):
            if isinstance(data.get(k), str):
                data[k] = _as_float(k, data[k])
        return cls(**data)

    @classmethod
    def from_yaml(cls, source: str, key: str | None = None) -> "RolloutCorrectionConfig":
        """Load from a YAML file path or YAML text; ``key`` selects a nested block,
        e.g. ``"algorithm.rollout_correction"``."""
        import os

        import yaml  # optional dependency: pip install 'rollout-correction[yaml]'

        if os.path.exists(source):
            with open(source, encoding="utf-8") as f:
                text = f.read()
        else:
            text = source
        data = yaml.safe_load(text)
        if data is None:
            data = {}
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
    def from_omegaconf(cls, cfg: Any) -> "RolloutCorrectionConfig":
        """Load from an OmegaConf ``DictConfig`` (interpolations are resolved)."""
        return cls.from_dict(settings_dict(cfg))

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset_names(cls) -> list[str]:
        """Every preset, by the name it has in verl's documentation generations."""
        return list(PRESETS)

    @classmethod
    def from_preset(cls, name: str, *args: Any, **kwargs: Any) -> "RolloutCorrectionConfig":
        """The preset ``name`` (see :data:`PRESETS`), its arguments overriding their defaults."""
        if name not in PRESETS:
            hint = difflib.get_close_matches(str(name), list(PRESETS), n=1)
            raise ConfigError(f"unknown preset {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + f"; available: {list(PRESETS)}")
        return PRESETS[name].build(cls, *args, **kwargs)


def _is_omegaconf(obj: Any) -> bool:
    try:
        from omegaconf import OmegaConf  # optional dependency
    except ImportError:  # pragma: no cover
        return False
    return OmegaConf.is_config(obj)


def settings_dict(obj: Any) -> dict[str, Any]:
    """A plain dict of settings from a mapping, an OmegaConf node (interpolations resolved), a
    dataclass instance (fields starting with ``_`` skipped), an object with ``to_dict()`` or one
    with attributes; the keys are not checked (that is :func:`as_config`'s job)."""
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


def as_config(value: Any) -> RolloutCorrectionConfig:
    """The one way every entry point reads a config.

    ``None`` → the default config (metrics only); a :class:`RolloutCorrectionConfig` → itself;
    a string → the preset of that name; a mapping, an OmegaConf node, a dataclass (such as
    verl's config class) or an object with attributes → :meth:`RolloutCorrectionConfig.from_dict`
    of its keys. Unknown keys and invalid values raise :class:`ConfigError`; an unreadable type
    raises TypeError.
    """
    if value is None:
        return RolloutCorrectionConfig()
    if isinstance(value, RolloutCorrectionConfig):
        return value
    if isinstance(value, str):
        return RolloutCorrectionConfig.from_preset(value)
    return RolloutCorrectionConfig.from_dict(settings_dict(value))


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


_MISSING = object()


# ---------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    """A named configuration: ``keys`` with placeholders filled from the preset's arguments.

    ``args`` lists the arguments (in positional order) with their defaults. In ``keys`` a value
    ``"{arg}"`` is replaced by the argument itself and any other string containing ``{arg}`` is
    formatted with the arguments (e.g. IcePop's band ``"{threshold_lower}_{threshold}"``).
    """

    name: str
    doc: str
    keys: Mapping[str, Any]
    args: Mapping[str, Any] = field(default_factory=dict)

    def config_keys(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The keys of this preset for the given arguments."""
        try:
            bound = self.signature().bind(*args, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"preset {self.name!r}: {exc}; its arguments are "
                              f"{dict(self.args) or 'none'}") from None
        bound.apply_defaults()
        values = bound.arguments
        out = {}
        for key, v in self.keys.items():
            if isinstance(v, str) and v.startswith("{") and v.endswith("}") and v[1:-1] in values:
                v = values[v[1:-1]]
            elif isinstance(v, str) and "{" in v:
                v = v.format(**values)
            out[key] = v
        return out

    def build(self, cls: type = None, *args: Any, **kwargs: Any) -> "RolloutCorrectionConfig":
        return (cls or RolloutCorrectionConfig)(**self.config_keys(*args, **kwargs))

    def signature(self) -> inspect.Signature:
        return inspect.Signature([inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
                                  for a, d in self.args.items()])

    @property
    def has_is(self) -> bool:
        return self.keys.get("rollout_is") is not None


_GEO_BAND = "0.999_1.001"
_TOKEN = {"rollout_is": "token", "rollout_is_threshold": "{is_threshold}"}
_SEQ = {"rollout_is": "sequence", "rollout_is_threshold": "{is_threshold}"}
_GEO_RS = {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "{rs_threshold}"}
_K3_RS = {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "{rs_threshold}"}
_BYPASS_PPO = {"bypass_mode": True, "loss_type": "ppo_clip"}
_BYPASS_PG = {"bypass_mode": True, "loss_type": "reinforce"}
_ICEPOP = {"rollout_is": "token", "rollout_is_threshold": "{threshold_lower}_{threshold}"}
_LEGACY_GEO_RS = {"rollout_rs": "geometric", "rollout_rs_threshold": "{rs_threshold}",
                  "rollout_rs_threshold_lower": "{rs_threshold_lower}",
                  "rollout_token_veto_threshold": "{veto_threshold}"}
_LEGACY_GEO_ARGS = {"rs_threshold": 1.001, "rs_threshold_lower": None, "veto_threshold": 1e-4}


def _preset(name: str, doc: str, keys: Mapping[str, Any], **args: Any) -> tuple[str, Preset]:
    return name, Preset(name, doc, keys, args)


#: Every preset: name -> :class:`Preset`. Each is also a classmethod of
#: :class:`RolloutCorrectionConfig` with the same arguments (``RolloutCorrectionConfig.seq_is(3.0)``).
PRESETS: dict[str, Preset] = dict([
    # Current generation (verl 0.9.1).
    _preset("decoupled_token_is", "Decoupled PPO × token-level TIS: w_t = min(ρ_t, C).",
            {"rollout_is": "token", "rollout_is_threshold": "{threshold}"}, threshold=2.0),
    _preset("decoupled_seq_is", "Decoupled PPO × sequence-level TIS: w = min(∏ρ_t, C).",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}"}, threshold=2.0),
    _preset("decoupled_token_icepop", "Decoupled PPO × token IcePop: w_t = ρ_t·1[lo ≤ ρ_t ≤ hi].",
            _ICEPOP, threshold=5.0, threshold_lower=0.5),
    _preset("decoupled_seq_is_rs", "Sequence TIS + reject sequences whose ∏ρ_t lies outside the band (seq_sum_k1).",
            {**_SEQ, "rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "{rs_threshold}"},
            is_threshold=2.0, rs_threshold="0.5_2.0"),
    _preset("decoupled_geo_rs", "Reject sequences whose geometric-mean ratio lies outside the band (seq_mean_k1).",
            _GEO_RS, rs_threshold=_GEO_BAND),
    _preset("decoupled_geo_rs_seq_tis", "Geometric-mean rejection + sequence TIS.",
            {**_SEQ, **_GEO_RS}, is_threshold=2.0, rs_threshold=_GEO_BAND),
    _preset("decoupled_geo_rs_token_tis", "Geometric-mean rejection + token TIS.",
            {**_TOKEN, **_GEO_RS}, is_threshold=2.0, rs_threshold=_GEO_BAND),
    _preset("decoupled_k3_rs", "Reject sequences whose mean k3 = mean(ρ − 1 − log ρ) exceeds the bound.",
            _K3_RS, rs_threshold=0.01),
    _preset("decoupled_k3_rs_seq_tis", "Mean-k3 rejection + sequence TIS.",
            {**_SEQ, **_K3_RS}, is_threshold=2.0, rs_threshold=0.01),
    _preset("decoupled_k3_rs_token_tis", "Mean-k3 rejection + token TIS.",
            {**_TOKEN, **_K3_RS}, is_threshold=2.0, rs_threshold=0.01),
    _preset("bypass_ppo_clip", "PPO clipped against π_rollout (bypass); no IS weights.", _BYPASS_PPO),
    _preset("bypass_ppo_clip_geo_rs", "Bypass PPO-clip + geometric-mean rejection.",
            {**_GEO_RS, **_BYPASS_PPO}, rs_threshold=_GEO_BAND),
    _preset("bypass_ppo_clip_k3_rs", "Bypass PPO-clip + mean-k3 rejection.",
            {**_K3_RS, **_BYPASS_PPO}, rs_threshold=0.01),
    _preset("bypass_pg_is", "REINFORCE with sequence TIS: L = −sg(min(∏ρ_t, C))·A·log π_θ.",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}", **_BYPASS_PG}, threshold=2.0),
    _preset("bypass_pg_token_icepop", "REINFORCE with token IcePop weights.",
            {**_ICEPOP, **_BYPASS_PG}, threshold=5.0, threshold_lower=0.5),
    _preset("bypass_pg_geo_rs", "REINFORCE + geometric-mean rejection; no IS weights.",
            {**_GEO_RS, **_BYPASS_PG}, rs_threshold=_GEO_BAND),
    _preset("bypass_pg_geo_rs_seq_tis", "REINFORCE with sequence TIS + geometric-mean rejection.",
            {**_SEQ, **_GEO_RS, **_BYPASS_PG}, is_threshold=2.0, rs_threshold=_GEO_BAND),
    _preset("bypass_pg_geo_rs_token_tis", "REINFORCE with token TIS + geometric-mean rejection.",
            {**_TOKEN, **_GEO_RS, **_BYPASS_PG}, is_threshold=2.0, rs_threshold=_GEO_BAND),
    # Methods beyond verl's presets (length-normalised weights, policy losses of policy_losses.py, OPSM, M2PO).
    _preset("decoupled_geo_is", "Decoupled PPO × geometric TIS: w = min(exp(mean_t log ρ_t), C), a "
            "length-normalised sequence weight (for long responses, where ∏ρ_t collapses).",
            {"rollout_is": "geometric", "rollout_is_threshold": "{threshold}"}, threshold=2.0),
    _preset("decoupled_token_is_opsm", "Decoupled PPO × token TIS + off-policy sequence masking (drop A < 0 "
            "sequences with mean log(π_rollout/π_θ) > δ).",
            {**_TOKEN, "rollout_opsm_delta": "{delta}"}, is_threshold=2.0, delta=0.05),
    _preset("decoupled_token_is_m2po", "Decoupled PPO × token TIS + M2PO: mask the largest (log ρ_t)² until "
            "their batch mean ≤ τ.", {**_TOKEN, "rollout_m2po_threshold": "{threshold}"},
            is_threshold=2.0, threshold=0.04),
    _preset("bypass_topr", "TOPR: REINFORCE with weight 1 for A ≥ 0 and min(∏π_θ/π_rollout, 1) for A < 0.",
            {"bypass_mode": True, "loss_type": "topr"}),
    _preset("decoupled_gspo_geo_is", "GSPO (PPO clip on exp(mean log π_θ/π_old)) × geometric TIS "
            "min(exp(mean log ρ_t), C).", {"rollout_is": "geometric", "rollout_is_threshold": "{is_threshold}",
                                           "loss_type": "gspo"}, is_threshold=2.0),
    _preset("decoupled_cispo_token_is", "CISPO (−sg(clip r)·A·log π_θ) × token TIS.",
            {**_TOKEN, "loss_type": "cispo"}, is_threshold=2.0),
    _preset("decoupled_dppo_tv_token_is", "DPPO-TV (probability-difference trust region) × token TIS.",
            {**_TOKEN, "loss_type": "dppo_tv"}, is_threshold=2.0),
    _preset("decoupled_dppo_kl_token_is", "DPPO-KL (binary-KL trust region) × token TIS.",
            {**_TOKEN, "loss_type": "dppo_kl"}, is_threshold=2.0),
    _preset("disabled", "Metrics only: no weights, no rejection.", {}),
    # First generation (the names of the earlier documentation).
    _preset("token_is", "Token-level TIS (first-generation name of decoupled_token_is).",
            {"rollout_is": "token", "rollout_is_threshold": "{threshold}"}, threshold=2.0),
    _preset("seq_is", "Sequence-level TIS (first-generation name of decoupled_seq_is).",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}"}, threshold=2.0),
    _preset("seq_is_rs", "Sequence TIS + sequence ratio-band rejection (lower bound defaults to 1/upper).",
            {**_SEQ, "rollout_rs": "sequence", "rollout_rs_threshold": "{rs_threshold}",
             "rollout_rs_threshold_lower": "{rs_threshold_lower}"},
            is_threshold=2.0, rs_threshold=2.0, rs_threshold_lower=None),
    _preset("seq_mis", "Sequence masked IS: truncate at C and reject sequences with ∏ρ_t > C (no lower bound).",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}", "rollout_rs": "sequence",
             "rollout_rs_threshold": "{threshold}", "rollout_rs_threshold_lower": 0.0}, threshold=2.0),
    _preset("geo_rs", "Geometric-mean ratio rejection (lower bound defaults to 1/upper) + veto; no IS weights.",
            _LEGACY_GEO_RS, **_LEGACY_GEO_ARGS),
    _preset("geo_mis", "Geometric-level IS weights + geometric rejection + veto.",
            {"rollout_is": "geometric", "rollout_is_threshold": "{is_threshold}", **_LEGACY_GEO_RS},
            is_threshold=2.0, **_LEGACY_GEO_ARGS),
    _preset("ppo_is_bypass", "PPO clipped against π_rollout; token IS weights reported as diagnostics only.",
            {"rollout_is": "token", "rollout_is_threshold": "{threshold}", **_BYPASS_PPO}, threshold=2.0),
    _preset("pure_is", "Off-policy REINFORCE with sequence TIS (bypass); same as bypass_pg_is.",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}", **_BYPASS_PG}, threshold=2.0),
    _preset("pg_is", "REINFORCE with sequence TIS (bypass); same as bypass_pg_is.",
            {"rollout_is": "sequence", "rollout_is_threshold": "{threshold}", **_BYPASS_PG}, threshold=2.0),
    _preset("pg_rs", "REINFORCE (bypass) with geometric rejection + veto; no IS weights.",
            {**_LEGACY_GEO_RS, **_BYPASS_PG}, **_LEGACY_GEO_ARGS),
])


def _preset_method(preset: Preset) -> classmethod:
    def make(cls, *args: Any, **kwargs: Any) -> "RolloutCorrectionConfig":
        return preset.build(cls, *args, **kwargs)

    make.__name__ = make.__qualname__ = preset.name
    make.__doc__ = preset.doc
    params = list(preset.signature().parameters.values())
    cls_param = inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    make.__signature__ = inspect.Signature([cls_param, *params])  # type: ignore[attr-defined]
    return classmethod(make)


def _keys_docstring() -> str:
    lines = [RolloutCorrectionConfig.__doc__.rstrip(), "", "    Keys:", ""]
    for key, (values, default, meaning) in CONFIG_KEYS.items():
        lines.append(f"    {key} ({values}; default {default}): {meaning}")
    return "\n".join(lines) + "\n    "


for _name, _p in PRESETS.items():
    setattr(RolloutCorrectionConfig, _name, _preset_method(_p))
RolloutCorrectionConfig.__doc__ = _keys_docstring()
del _name, _p
