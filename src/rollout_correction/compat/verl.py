"""Drop-in names of verl 0.9.1's ``verl.trainer.ppo.rollout_corr_helper``.

A verl user can swap one import::

    # from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    from rollout_correction.compat.verl import compute_rollout_correction_and_rejection_mask

Every function keeps verl's parameter names, order, defaults and return conventions (tensors
and dicts of Python floats; metric names without prefix where verl has none, ``rollout_corr/``
where verl adds it). The numbers come from this library's core (one pass, sufficient
statistics, one device sync), so they are the same as verl's to float tolerance except where
verl is wrong; ``docs/verl-differences.md`` lists each difference. The ones a caller can see:

* k1 rejection bounds ``"lo_hi"`` mean lo ≤ ρ_agg ≤ hi (verl compares them against −log ρ,
  which inverts asymmetric bounds; reciprocal bounds such as ``"0.5_2.0"`` behave identically);
* rows without valid tokens are left out of sequence statistics; an all-padding batch gives
  zero metrics instead of a ``ValueError``;
* ``k3_kl`` and ``ppl_ratio`` clamp the log-ratio to ±20 like every other exponential;
* weights come back as float32 whatever the input dtype (computed in float32);
* NaN / ±inf log-probs at valid positions reject the sequence (counted in
  ``nonfinite_seq_fraction``) instead of propagating;
* ``rollout_is`` also accepts ``"geometric"``; IcePop zeroing every weight reports an effective
  sample size of 0 instead of dividing by zero.

Batch normalisation under ``torch.distributed``: like verl, the mean is taken over the WORLD
group when a process group is initialised and ``rollout_is_batch_normalize`` is set (and in that
case every metric is global too). Pass ``process_group=`` (keyword only, not in verl) to choose
another group, or ``None`` for a purely local computation.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

import torch

from .. import ConfigError, RolloutCorrectionConfig, as_config
from .. import config_value as _get
from rollout_correction import METRIC_PREFIX as PREFIX
from rollout_correction import SAFETY_BOUND, compute_rollout_correction, engine_metrics, metrics_to_floats
from rollout_correction import compute_offpolicy_metrics as _offpolicy_metrics
from rollout_correction.primitives import (RS_OPTIONS, ISWeights, LogRatioBatch, RSOption, add_is_statistics,
                                           batch_norm_factor, importance_weights, is_metrics, option_keep,
                                           rejection_keep, rs_metrics, rs_option_metrics)
from rollout_correction.reductions import SufficientStats
from rollout_correction_core import Parallel, Segments

__all__ = [
    "ConfigBlockError",
    "ThresholdTypeError",
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "RolloutISWeights",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_is_metrics",
    "compute_rs_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_corr_metrics_from_logprobs",
    "apply_bypass_mode",
]

#: verl's divergence-based rejection options, k1/k2/k3 (comma-chain them in ``rollout_rs``; the
#: probability-space options of this library are accepted too).
SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = {name for name, (agg, est) in RS_OPTIONS.items()
                                          if est in ("k1", "k2", "k3") and not agg.startswith("segment_")}
#: The options judged token by token (the others judge whole sequences).
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {name for name in SUPPORTED_ROLLOUT_RS_OPTIONS
                                            if RS_OPTIONS[name][0] == "token"}

_AUTO = object()  # process_group default: WORLD when verl would all-reduce, else local


class RolloutISWeights:
    """Holder returned in place of verl's ``DataProto`` when verl is not installed:
    ``holder.batch["rollout_is_weights"]`` is the (B, T) weight tensor."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.batch: dict[str, torch.Tensor] = {"rollout_is_weights": weights}

    def __len__(self) -> int:
        return self.batch["rollout_is_weights"].shape[0]

    def __repr__(self) -> str:
        w = self.batch["rollout_is_weights"]
        return f"RolloutISWeights(rollout_is_weights: {tuple(w.shape)} {w.dtype})"


class ConfigBlockError(ConfigError, TypeError, AttributeError):
    """The config block is not a config (None, a list, ...). verl fails on such a block with an
    ``AttributeError``; this error is also that type (and a ``ValueError`` and ``TypeError``), so
    an ``except`` written against verl still catches it."""


class ThresholdTypeError(ConfigError, TypeError):
    """``rollout_is_threshold`` is a boolean. verl raises a ``TypeError`` ("... not a boolean") for
    it; this error is also that type (and a :class:`~rollout_correction.ConfigError`)."""


def _threshold(value: Any) -> Any:
    """``rollout_is_threshold`` as given, refusing a boolean with verl's exception type."""
    if isinstance(value, bool):
        raise ThresholdTypeError(f"rollout_is_threshold={value!r} is invalid: give a float or a string "
                                 "threshold specification ('upper' or 'lower_upper'), not a boolean")
    return value


def _weights_holder(weights: torch.Tensor) -> Any:
    """verl's ``DataProto`` when verl is installed (what verl's callers ``union`` into the batch),
    otherwise the light :class:`RolloutISWeights`: the type depends on the installation, never on
    what the caller imported before. A verl that is installed but fails to import raises."""
    if importlib.util.find_spec("verl") is None:
        return RolloutISWeights(weights)
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"rollout_is_weights": weights})


def _resolve_group(process_group: Any, batch_normalize: bool) -> Optional[object]:
    if process_group is not _AUTO:
        return process_group
    import torch.distributed as dist

    if batch_normalize and dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _is_config(rollout_is: Optional[str], rollout_is_threshold: Any,
               rollout_is_batch_normalize: bool = False) -> RolloutCorrectionConfig:
    return RolloutCorrectionConfig(rollout_is=rollout_is, rollout_is_threshold=_threshold(rollout_is_threshold),
                                   rollout_is_batch_normalize=rollout_is_batch_normalize, log_prob_ceiling=None)


def _unprefix(metrics: dict[str, float]) -> dict[str, float]:
    return {k[len(PREFIX):] if k.startswith(PREFIX) else k: v for k, v in metrics.items()}


# ----------------------------------------------------------------------------- the pipeline


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Optional[str | float] = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Optional[str | float] = None,
    *,
    process_group: Any = _AUTO,
) -> tuple[Optional[Any], torch.Tensor, dict[str, float]]:
    """IS weights, rejection-adjusted mask and every ``rollout_corr/*`` metric (verl's entry point).

    log ρ_t = old_log_prob − rollout_log_prob. Weights are requested by ``rollout_is`` ("token",
    "sequence", "geometric") with ``rollout_is_threshold`` C (truncate above C) or "lo_hi"
    (IcePop); ``rollout_rs`` chains k1/k2/k3 rejection options (all must accept).

    Returns:
        (weights, modified_response_mask, metrics): ``weights.batch["rollout_is_weights"]`` is
        the (B, T) float32 weight tensor (None when ``rollout_is`` or its threshold is None);
        the mask has the input's dtype; metrics are ``rollout_corr/<name>`` → float.
    """
    if rollout_rs is not None and rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled "
                         f"(rollout_rs={rollout_rs!r}); e.g. '0.5_2.0' for k1 options, 0.01 for k2/k3")
    if _threshold(rollout_is_threshold) is None:
        rollout_is = None  # verl computes no weights without a threshold
    cfg = RolloutCorrectionConfig(
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold if rollout_is is not None else 2.0,
        rollout_is_batch_normalize=bool(rollout_is_batch_normalize),
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
        log_prob_ceiling=None,  # verl does not check that a log-prob is ≤ 0
    )
    cfg.refuse_segments("verl's compute_rollout_correction_and_rejection_mask signature")
    group = _resolve_group(process_group, cfg.is_spec is not None and cfg.is_spec.batch_normalize)
    out = compute_rollout_correction(
        old_log_prob, rollout_log_prob, response_mask, config=cfg, parallel=Parallel(dp_group=group))
    holder = None if out.weights is None else _weights_holder(out.weights)
    return holder, out.response_mask, out.metrics_as_floats()


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
    *,
    process_group: Any = _AUTO,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bounded IS weights from a log-ratio, and the ``rollout_is_*`` metrics (no prefix).

    token: w_t = ρ_t; sequence: w = exp Σ_t log ρ_t; geometric: w = exp mean_t log ρ_t (each
    exponent clamped to ±20), then truncated at C or IcePop-masked to [lo, hi], then optionally
    divided by the batch mean (``rollout_is_batch_norm_factor``).

    Args:
        log_ratio: (B, T) log π_train − log π_rollout.
        response_mask: (B, T) bool or 0/1 mask of valid tokens.
    Returns:
        ((B, T) float32 weights, 0 at padding, detached; dict of float metrics).
    """
    cfg = _is_config(rollout_is, rollout_is_threshold, bool(rollout_is_batch_normalize))
    cfg.refuse_segments("verl's compute_rollout_correction_weights signature")
    spec = cfg.is_spec
    if spec is None:
        raise ValueError(f"rollout_is={rollout_is!r} is invalid: expected 'token', 'sequence' or 'geometric'")
    with torch.no_grad():
        batch = LogRatioBatch.from_log_ratio(log_ratio, response_mask)
        stats = SufficientStats()
        batch.add_counts(stats)
        isw = importance_weights(batch, spec)
        add_is_statistics(stats, batch, spec, isw)
        stats.all_reduce(_resolve_group(process_group, spec.batch_normalize))
        weights = isw.weights
        if spec.batch_normalize:
            weights = weights / batch_norm_factor(stats, spec).to(weights.dtype)
        metrics = metrics_to_floats(is_metrics(stats, spec))
    return weights, metrics


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Optional[str | float] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Response mask with every token / sequence some chained option rejects set to 0.

    Options ``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2/k3`` on
    k1 = −log ρ, k2 = ½(log ρ)², k3 = ρ − 1 − log ρ; k1 thresholds are ratio bounds "lo_hi"
    (keep lo ≤ ρ_agg ≤ hi), k2/k3 thresholds one upper bound.

    Returns:
        (modified mask with the input's dtype, ``rollout_rs_*`` metrics as floats).
    """
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    cfg = RolloutCorrectionConfig(rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
    cfg.refuse_segments("verl's compute_rollout_rejection_mask signature")
    options = cfg.rs_options
    with torch.no_grad():
        batch = LogRatioBatch.from_log_ratio(log_ratio, response_mask)
        stats = SufficientStats()
        batch.add_counts(stats)
        keep = rejection_keep(batch, options, None, stats).keep_mask(batch)
        metrics = metrics_to_floats(rs_metrics(stats, options))
        new_mask = torch.where(keep > 0, response_mask, torch.zeros_like(response_mask))
    return new_mask, metrics


# ----------------------------------------------------------------------------- metric helpers


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: Optional[float] = None,
) -> dict[str, float]:
    """``rollout_is_*`` metrics of weights the caller already computed (verl's layout).

    Args:
        rollout_is_weights: (B, T) bounded weights.
        raw_rollout_is_weights: (B, T) weights before truncation / IcePop (safety-bounded).
        log_ratio_for_metrics: (B, T) per-token log-ratio (token level) or (B, 1) per-row sum
            of log-ratios (sequence level), unclamped.
        response_mask: (B, T) valid tokens.
        rollout_is: "token" or "sequence".
        rollout_is_threshold: upper bound U.
        rollout_is_threshold_lower: IcePop lower bound (None: TIS, lower metric bound 1/U).
    """
    threshold: Any = rollout_is_threshold
    if rollout_is_threshold_lower is not None:
        threshold = (rollout_is_threshold_lower, rollout_is_threshold)
    spec = _is_config(rollout_is, threshold).is_spec
    if spec is None or spec.level not in ("token", "sequence"):
        raise ValueError(f"rollout_is={rollout_is!r} is invalid: expected 'token' or 'sequence'")
    with torch.no_grad():
        if spec.level == "token":
            batch = LogRatioBatch.from_log_ratio(log_ratio_for_metrics, response_mask)
            valid = batch.valid
            isw = ISWeights(weights=torch.where(valid, rollout_is_weights.float(), 0.0),
                            raw=torch.where(valid, raw_rollout_is_weights.float(), 0.0))
        else:
            batch = LogRatioBatch.from_mask(response_mask)
            valid = batch.valid
            # Sequence weights are constant over a row's valid tokens: read them off with a max.
            row_w = torch.where(valid, rollout_is_weights.float(), 0.0).amax(-1)
            row_raw = torch.where(valid, raw_rollout_is_weights.float(), 0.0).amax(-1)
            isw = ISWeights(weights=torch.where(valid, rollout_is_weights.float(), 0.0),
                            row_log=log_ratio_for_metrics.reshape(-1).float(), row_raw=row_raw, row_weight=row_w)
        stats = SufficientStats()
        batch.add_counts(stats)
        add_is_statistics(stats, batch, spec, isw)
        return metrics_to_floats(is_metrics(stats, spec))


def compute_rs_metrics(
    option_name: str,
    rs_statistic: torch.Tensor,
    response_mask: torch.Tensor,
    seq_valid_mask: torch.Tensor,
    *,
    level: str,
    per_sequence_values: Optional[torch.Tensor],
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float,
    apply_lower_threshold: bool,
) -> dict[str, float]:
    """``rollout_rs_<option>_*`` metrics of a statistic the caller already computed.

    Thresholds are on the statistic (for k1: log-space bounds on −log ρ). ``seq_valid_mask`` is
    accepted for signature compatibility; rows with ≥ 1 valid token are read from
    ``response_mask``. The masked fractions are reported by :func:`compute_rollout_rejection_mask`.
    """
    if option_name not in RS_OPTIONS:
        raise ValueError(f"Invalid rollout_rs option: {option_name}. Must be one of {sorted(RS_OPTIONS)}.")
    agg, estimator = RS_OPTIONS[option_name]
    if agg.startswith("segment_"):
        raise ValueError(f"{option_name!r} is a segment option: its statistic is per turn and needs segment "
                         "ids, which verl's signature has no place for; use "
                         "compute_rollout_correction(..., segment_ids=...)")
    if level not in ("token", "sequence"):
        raise ValueError(f"level={level!r} is invalid: expected 'token' or 'sequence'")
    if (level == "token") != (agg == "token"):
        raise ValueError(f"level={level!r} does not match option {option_name!r} (a {agg} option)")
    opt = RSOption(option_name, agg, estimator,
                   float(rollout_rs_threshold_lower) if apply_lower_threshold else None, float(rollout_rs_threshold))
    with torch.no_grad():
        batch = LogRatioBatch.from_mask(response_mask)
        valid = batch.valid
        if agg == "token":
            statistic = torch.where(valid, rs_statistic.float(), 0.0)
        elif per_sequence_values is not None:
            statistic = per_sequence_values.reshape(-1).float()
        else:  # the per-sequence value, broadcast over the row's valid tokens
            statistic = torch.where(valid, rs_statistic.float(), -torch.inf).amax(-1)
            statistic = torch.where(batch.row_valid, statistic, 0.0)
        stats = SufficientStats()
        batch.add_counts(stats)
        option_keep(batch, opt, statistic, stats)
        out = metrics_to_floats(rs_option_metrics(stats, opt))
    prefix = f"rollout_rs_{option_name}_"
    return {k: v for k, v in out.items()
            if k.startswith(prefix) and not k.endswith(("_masked_fraction", "_seq_masked_fraction"))}


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
) -> dict[str, Any]:
    """Off-policy diagnostics without prefix: ``training_ppl``, ``training_log_ppl`` and, with
    rollout log-probs, ``kl``, ``k3_kl``, ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``,
    ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``,
    ``chi2_token``, ``chi2_seq`` (the metric reference in docs/guide.md has the formulas)."""
    if rollout_log_prob is None:
        metrics = _unprefix(metrics_to_floats(_offpolicy_metrics(old_log_prob, old_log_prob, response_mask)))
        return {k: metrics[k] for k in ("training_ppl", "training_log_ppl")}
    return _unprefix(metrics_to_floats(_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)))


def compute_rollout_corr_metrics_from_logprobs(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """Off-policy diagnostics of the current policy vs the rollout policy, ``rollout_corr/`` prefixed."""
    return metrics_to_floats(_offpolicy_metrics(log_prob, rollout_log_prob, response_mask))


# ----------------------------------------------------------------------------- batch-level helpers


def compute_rollout_correction_and_add_to_batch(batch: Any, rollout_corr_config: Any) -> tuple[Any, dict]:
    """Apply the correction to a verl-style batch (anything with a ``.batch`` mapping holding
    ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``).

    ``response_mask`` is always replaced by the rejection-adjusted mask; ``rollout_is_weights``
    is added when weights are requested. ``rollout_corr_config`` may be verl's
    ``RolloutCorrectionConfig``, a dict / DictConfig, a preset name or a
    :class:`RolloutCorrectionConfig`. Every setting of the block is honoured (including
    ``rollout_token_veto_threshold`` and the ``*_lower`` bounds); a key this library does not know
    raises :class:`~rollout_correction.ConfigError` (a ``ValueError``) naming it, with the closest
    known key. A missing tensor raises ``KeyError`` naming it, as verl's ``DataProto`` does.
    Multi-turn rows: an optional (B, T) integer ``segment_ids`` tensor in ``batch.batch`` (the turn of
    each response token; verl's DataProto has no such key, the user's rollout code adds it) is
    passed on as the segments of ``rollout_is="segment"`` and the ``segment_*`` options; a block that
    uses them on a batch without it is refused.

    Returns:
        (batch, metrics) with ``rollout_corr/``-prefixed float metrics.
    """
    if rollout_corr_config is None:
        raise ConfigBlockError("rollout_corr_config is None: pass verl's algorithm.rollout_correction block")
    if not isinstance(rollout_corr_config, (str, RolloutCorrectionConfig)):  # a block, not a preset or config
        _threshold(_get(rollout_corr_config, "rollout_is_threshold", None))
    try:
        cfg = as_config(rollout_corr_config)
    except TypeError as exc:
        if isinstance(exc, ConfigError):  # a value of the block: already says which key
            raise
        raise ConfigBlockError(str(exc)) from None
    tensors = batch.batch
    for key in ("old_log_probs", "rollout_log_probs", "response_mask"):
        if key not in tensors.keys():
            raise KeyError(f"batch.batch has no {key!r}; the decoupled correction needs old_log_probs, "
                           "rollout_log_probs (verl: rollout.calculate_log_probs=true) and response_mask")
    segment_ids = tensors["segment_ids"] if "segment_ids" in tensors.keys() else None
    if segment_ids is None:
        cfg.refuse_segments("this batch (no batch.batch['segment_ids'])")
    group = _resolve_group(_AUTO, cfg.is_spec is not None and cfg.is_spec.batch_normalize)
    out = compute_rollout_correction(
        tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"], config=cfg,
        parallel=Parallel(dp_group=group), segments=None if segment_ids is None else Segments(segment_ids))
    tensors["response_mask"] = out.response_mask
    if out.weights is not None:
        tensors["rollout_is_weights"] = out.weights
    metrics = out.metrics_as_floats()
    return batch, {**metrics, **engine_metrics(metrics, "verl")}  # also verl's debug-metric names


def apply_bypass_mode(batch: Any, rollout_corr_config: Any = None, policy_loss_config: Any = None) -> None:
    """Bypass mode set-up: π_old := π_rollout (``old_log_probs`` ← ``rollout_log_probs``) and, when
    a policy-loss config is given, route the loss to verl's ``bypass_mode`` loss with this
    rollout-correction config (``policy_loss_config["rollout_correction"]``, ``["loss_mode"]``).

    ``policy_loss_config`` may be an OmegaConf DictConfig (struct mode is lifted for the two keys),
    a dict, or an object with attributes.
    """
    if "rollout_log_probs" not in batch.batch:
        raise ValueError("bypass_mode=True requires rollout_log_probs in batch; configure the rollout "
                         "engine to return sampling log-probs (verl: rollout.calculate_log_probs=true)")
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    if policy_loss_config is None:
        return
    updates = {"rollout_correction": rollout_corr_config, "loss_mode": "bypass_mode"}
    try:
        from omegaconf import DictConfig, open_dict
    except ImportError:  # pragma: no cover - omegaconf is optional
        DictConfig = None
    if DictConfig is not None and isinstance(policy_loss_config, DictConfig):
        with open_dict(policy_loss_config):
            for k, v in updates.items():
                policy_loss_config[k] = v
    elif isinstance(policy_loss_config, dict):
        policy_loss_config.update(updates)
    else:
        for k, v in updates.items():
            setattr(policy_loss_config, k, v)
