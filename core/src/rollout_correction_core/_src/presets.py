"""Presets: named configurations, each a classmethod of ``RolloutCorrectionConfig``'s ``Presets``
mixin; a name for exactly another preset is an alias (``pure_is = bypass_pg_is``). :data:`PRESETS`
is derived from the definitions. The verl names and defaults are verl 0.9.1's.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, NamedTuple, Optional

from .vocab import ConfigError

__all__ = ["Presets", "Preset", "PRESETS", "preset"]


def _arguments(fn: Callable[..., Any]) -> dict[str, Any]:
    return {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[1:]}


def _check_arguments(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    try:
        inspect.signature(fn).bind(None, *args, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"preset {name!r}: {exc}; its arguments are {_arguments(fn) or 'none'}") from None


def preset(fn: Callable[..., Any]) -> classmethod:
    """A classmethod that, called with arguments it does not take, raises ConfigError naming its own."""
    @functools.wraps(fn)
    def make(cls: type, *args: Any, **kwargs: Any) -> Any:
        _check_arguments(fn.__name__, fn, args, kwargs)
        return fn(cls, *args, **kwargs)

    return classmethod(make)


class Presets:
    """Every preset of verl's two documentation generations, and the methods beyond them."""

    # ---- verl 0.9.1
    @preset
    def decoupled_token_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled PPO × token-level TIS: w_t = min(ρ_t, C)."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @preset
    def decoupled_seq_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled PPO × sequence-level TIS: w = min(∏ρ_t, C)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @preset
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
        """Decoupled PPO × token IcePop: w_t = ρ_t·1[lo ≤ ρ_t ≤ hi]."""
        return cls(rollout_is="token", rollout_is_threshold=(threshold_lower, threshold))

    @preset
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: str = "0.5_2.0") -> RolloutCorrectionConfig:
        """Sequence TIS + reject sequences whose ∏ρ_t lies outside the band (seq_sum_k1)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_geo_rs(cls, rs_threshold: str = "0.999_1.001") -> RolloutCorrectionConfig:
        """Reject sequences whose geometric-mean ratio lies outside the band (seq_mean_k1)."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: str = "0.999_1.001"
                                 ) -> RolloutCorrectionConfig:
        """Geometric-mean rejection + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: str = "0.999_1.001"
                                   ) -> RolloutCorrectionConfig:
        """Geometric-mean rejection + token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Reject sequences whose mean k3 = mean(ρ − 1 − log ρ) exceeds the bound."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Mean-k3 rejection + sequence TIS."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
                                  ) -> RolloutCorrectionConfig:
        """Mean-k3 rejection + token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def bypass_ppo_clip(cls) -> RolloutCorrectionConfig:
        """PPO clipped against π_rollout (bypass); no IS weights."""
        return cls(bypass_mode=True, loss_type="ppo_clip")

    @preset
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: str = "0.999_1.001") -> RolloutCorrectionConfig:
        """Bypass PPO-clip + geometric-mean rejection."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @preset
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
        """Bypass PPO-clip + mean-k3 rejection."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="ppo_clip")

    @preset
    def bypass_pg_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """REINFORCE with sequence TIS: L = −sg(min(∏ρ_t, C))·A·log π_θ."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, loss_type="reinforce")

    @preset
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
        """REINFORCE with token IcePop weights."""
        return cls(rollout_is="token", rollout_is_threshold=(threshold_lower, threshold), bypass_mode=True,
                   loss_type="reinforce")

    @preset
    def bypass_pg_geo_rs(cls, rs_threshold: str = "0.999_1.001") -> RolloutCorrectionConfig:
        """REINFORCE + geometric-mean rejection; no IS weights."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @preset
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: str = "0.999_1.001"
                                 ) -> RolloutCorrectionConfig:
        """REINFORCE with sequence TIS + geometric-mean rejection."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @preset
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: str = "0.999_1.001"
                                   ) -> RolloutCorrectionConfig:
        """REINFORCE with token TIS + geometric-mean rejection."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    # ---- beyond verl's presets: length-normalised weights, the losses of policy_losses.py, OPSM, M2PO
    @preset
    def decoupled_geo_is(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Decoupled PPO × geometric TIS: w = min(exp(mean_t log ρ_t), C), a length-normalised sequence
        weight (for long responses, where ∏ρ_t collapses)."""
        return cls(rollout_is="geometric", rollout_is_threshold=threshold)

    @preset
    def decoupled_token_is_opsm(cls, is_threshold: float = 2.0, delta: float = 0.05) -> RolloutCorrectionConfig:
        """Decoupled PPO × token TIS + off-policy sequence masking (drop A < 0 sequences with mean
        log(π_rollout/π_θ) > δ)."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_opsm_delta=delta)

    @preset
    def decoupled_token_is_m2po(cls, is_threshold: float = 2.0, threshold: float = 0.04) -> RolloutCorrectionConfig:
        """Decoupled PPO × token TIS + M2PO: mask the largest (log ρ_t)² until their batch mean ≤ τ."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_m2po_threshold=threshold)

    @preset
    def bypass_topr(cls) -> RolloutCorrectionConfig:
        """TOPR: REINFORCE with weight 1 for A ≥ 0 and min(∏π_θ/π_rollout, 1) for A < 0."""
        return cls(bypass_mode=True, loss_type="topr")

    @preset
    def decoupled_gspo_geo_is(cls, is_threshold: float = 2.0) -> RolloutCorrectionConfig:
        """GSPO (PPO clip on exp(mean log π_θ/π_old)) × geometric TIS min(exp(mean log ρ_t), C)."""
        return cls(rollout_is="geometric", rollout_is_threshold=is_threshold, loss_type="gspo")

    @preset
    def decoupled_cispo_token_is(cls, is_threshold: float = 2.0) -> RolloutCorrectionConfig:
        """CISPO (−sg(clip r)·A·log π_θ) × token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, loss_type="cispo")

    @preset
    def decoupled_dppo_tv_token_is(cls, is_threshold: float = 2.0) -> RolloutCorrectionConfig:
        """DPPO-TV (probability-difference trust region) × token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, loss_type="dppo_tv")

    @preset
    def decoupled_dppo_kl_token_is(cls, is_threshold: float = 2.0) -> RolloutCorrectionConfig:
        """DPPO-KL (binary-KL trust region) × token TIS."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, loss_type="dppo_kl")

    @preset
    def decoupled_tv_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.1
                                  ) -> RolloutCorrectionConfig:
        """Token TIS + rejection of tokens whose probability difference TV = abs(π_train − π_rollout)
        exceeds δ (prime-rl's probability mask)."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="token_tv",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_binary_kl_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = 0.02
                                         ) -> RolloutCorrectionConfig:
        """Token TIS + rejection of sequences whose mean binary KL exceeds δ (OpenRLHF's seq gate)."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_binary_kl",
                   rollout_rs_threshold=rs_threshold)

    @preset
    def decoupled_token_is_veto(cls, is_threshold: float = 2.0, low: float = 1e-4, high: float = 10.0
                                ) -> RolloutCorrectionConfig:
        """Token TIS + the two-sided veto: drop a sequence with any ρ_t < low or > high (SkyRL's outlier mask)."""
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_token_veto_threshold=low,
                   rollout_token_veto_threshold_high=high)

    # SkyRL's losses and band: rollout-anchored REINFORCE / CISPO, and its geometric sequence mask.
    @preset
    def bypass_rollout_is(cls) -> RolloutCorrectionConfig:
        """rollout-IS (SkyRL, GLM-5): REINFORCE with r = π_θ/π_rollout zeroed outside (1 − ε_lo, 1 + ε_hi)."""
        return cls(bypass_mode=True, loss_type="rollout_is")

    @preset
    def bypass_cispo(cls) -> RolloutCorrectionConfig:
        """CISPO anchored on the rollout policy (SkyRL's cispo_anchor='rollout'): −sg(clip(π_θ/π_rollout))·A·log π_θ."""
        return cls(bypass_mode=True, loss_type="cispo")

    @preset
    def decoupled_geo_rs_wide(cls, rs_threshold: str = "0.99_1.01") -> RolloutCorrectionConfig:
        """Geometric RS with SkyRL's band: reject sequences whose exp(mean log ρ_t) leaves [0.99, 1.01]."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    # prime-rl's losses: IPO, its only default (#3418; δ = 0.3, no KL term, #3586), and IcePop (#3526).
    # Both are −A·r with r = π_θ/π_rollout on the tokens a gate keeps; prime-rl divides by every valid token.
    @preset
    def prime_rl_ipo(cls, threshold: float = 0.3) -> RolloutCorrectionConfig:
        """prime-rl's IPO: −A·r on the tokens with |π_θ(y_t) − π_rollout(y_t)| ≤ δ (token_dp, unclamped)."""
        return cls(rollout_rs="token_dp", rollout_rs_threshold=threshold, bypass_mode=True, loss_type="ratio_pg",
                   loss_denominator="valid")

    @preset
    def prime_rl_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.2) -> RolloutCorrectionConfig:
        """prime-rl's IcePop: −A·r on the tokens with lo ≤ r ≤ hi, tested on log r (token_k1)."""
        return cls(rollout_rs="token_k1", rollout_rs_threshold=f"{threshold_lower}_{threshold}", bypass_mode=True,
                   loss_type="ratio_pg", loss_denominator="valid")

    @preset
    def disabled(cls) -> RolloutCorrectionConfig:
        """Metrics only: no weights, no rejection."""
        return cls()

    # ---- first generation (the names of the earlier documentation)
    token_is = decoupled_token_is
    seq_is = decoupled_seq_is

    @preset
    def seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: float = 2.0,
                  rs_threshold_lower: Optional[float] = None) -> RolloutCorrectionConfig:
        """Sequence TIS + sequence ratio-band rejection (lower bound defaults to 1/upper)."""
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="sequence",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower)

    @preset
    def seq_mis(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """Sequence masked IS: truncate at C and reject sequences with ∏ρ_t > C (no lower bound)."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs="sequence",
                   rollout_rs_threshold=threshold, rollout_rs_threshold_lower=0.0)

    @preset
    def geo_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
               veto_threshold: Optional[float] = 1e-4) -> RolloutCorrectionConfig:
        """Geometric-mean ratio rejection (lower bound defaults to 1/upper) + veto; no IS weights."""
        return cls(rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold)

    @preset
    def geo_mis(cls, is_threshold: float = 2.0, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
                veto_threshold: Optional[float] = 1e-4) -> RolloutCorrectionConfig:
        """Geometric-level IS weights + geometric rejection + veto."""
        return cls(rollout_is="geometric", rollout_is_threshold=is_threshold, rollout_rs="geometric",
                   rollout_rs_threshold=rs_threshold, rollout_rs_threshold_lower=rs_threshold_lower,
                   rollout_token_veto_threshold=veto_threshold)

    @preset
    def ppo_is_bypass(cls, threshold: float = 2.0) -> RolloutCorrectionConfig:
        """PPO clipped against π_rollout; token IS weights reported as diagnostics only."""
        return cls(rollout_is="token", rollout_is_threshold=threshold, bypass_mode=True, loss_type="ppo_clip")
    pure_is = bypass_pg_is
    pg_is = bypass_pg_is

    @preset
    def pg_rs(cls, rs_threshold: float = 1.001, rs_threshold_lower: Optional[float] = None,
              veto_threshold: Optional[float] = 1e-4) -> RolloutCorrectionConfig:
        """REINFORCE (bypass) with geometric rejection + veto; no IS weights."""
        return cls(rollout_rs="geometric", rollout_rs_threshold=rs_threshold,
                   rollout_rs_threshold_lower=rs_threshold_lower, rollout_token_veto_threshold=veto_threshold,
                   bypass_mode=True, loss_type="reinforce")

    # ---- by name
    @classmethod
    def preset_names(cls) -> list[str]:
        """Every preset, by the name it has in verl's documentation generations."""
        return list(PRESETS)

    @classmethod
    def from_preset(cls, name: str, *args: Any, **kwargs: Any) -> RolloutCorrectionConfig:
        """The preset ``name`` (see :data:`PRESETS`), its arguments overriding their defaults."""
        if name not in PRESETS:
            hint = difflib.get_close_matches(str(name), list(PRESETS), n=1)
            raise ConfigError(f"unknown preset {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + f"; available: {list(PRESETS)}")
        _check_arguments(name, vars(Presets)[name].__func__.__wrapped__, args, kwargs)
        return getattr(cls, name)(*args, **kwargs)


class Preset(NamedTuple):
    """A preset as the docs list it: arguments and defaults in order, the keys it sets, its alias target."""

    name: str
    doc: str
    args: dict[str, Any]
    keys: tuple[str, ...]
    alias_of: Optional[str]


def _listing() -> dict[str, Preset]:
    out = {}
    for name, method in vars(Presets).items():
        fn = getattr(getattr(method, "__func__", None), "__wrapped__", None)
        if fn is not None:  # made by @preset; the keys it sets: its body run with dict as the class
            alias_of = fn.__name__ if fn.__name__ != name else None
            out[name] = Preset(name, fn.__doc__, _arguments(fn), tuple(fn(dict)), alias_of)
    return out


#: Every preset, in the order of the definitions: name -> :class:`Preset`.
PRESETS: dict[str, Preset] = _listing()
