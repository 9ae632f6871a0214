"""Drop-in names of ROLL's train-infer correction (``roll/utils/train_infer_corrections.py``) and of
its segment mean (``roll/pipeline/agentic/utils.py``).

A ROLL user swaps one import in the worker whose ``loss_func`` calls them::

    # from roll.utils.train_infer_corrections import compute_train_infer_correction
    # from roll.pipeline.agentic.utils import compute_segment_masked_mean
    from rollout_correction.compat.roll import compute_segment_masked_mean, compute_train_infer_correction

Both keep ROLL's parameter names, order, defaults, shapes and return conventions, and
``compute_train_infer_correction`` reads ROLL's ``TrainInferCorrectionConfig`` (or any object or
mapping with its fields: ``is_weight`` {enabled, weight_type, upper_bound, detach} and ``filters``,
a list of {enabled, agg_type, ratio_enabled, ratio_low, ratio_high, diff_enabled, diff_low,
diff_high}). ROLL's segments are the maximal runs of consecutive valid tokens of a row; here they
are numbered by :func:`rollout_correction.segment_ids_from_mask` and computed by this library's
segment level. ROLL's granularities map onto this library's options:

============  ===========================  ===============================  =====================
ROLL agg      IS weight (``weight_type``)  ratio filter [low, high]         diff filter [low, high]
============  ===========================  ===============================  =====================
token         ``rollout_is="token"``       ``token_k1``                     ``token_dp``
geometric     ``"geometric"``              ``seq_mean_k1``                  ``seq_mean_dp``
sequence      ``"sequence"``               ``seq_sum_k1``                   ``seq_sum_dp``
segment       ``"segment_geometric"``      ``segment_mean_k1``              ``segment_mean_dp``
============  ===========================  ===============================  =====================

The weight is truncated at ``upper_bound`` (none when it is None); each enabled filter keeps a
token iff its statistic lies in [low, high]; the filters multiply. The metrics keep ROLL's names and
its conventions for data-parallel runs: token shares are divided by ``global_valid_tokens`` and
sequence means by ``global_valid_samples`` (the batch's own counts by default), so ROLL's ``@sum``
reduction over ranks and micro-batches gives the global value. Differences a caller can see:

* a token share (``is_weight_clipfrac``, ``*_mask_mean``) counts valid tokens only; ROLL's
  token-mean sums its indicator over every position of the (B, T) tensor, padding and prompt
  positions included, which contradicts its own comment ("pass rate ... over currently active
  tokens") and can exceed 1. Without padding the two agree;
* ``is_weight`` is 0 at positions outside ``response_mask`` (ROLL's holds the ratio there); the
  ``filter_mask`` is 1 there (a filter rejects no position that carries no token); at valid
  positions both are ROLL's;
* a row with a NaN / ±inf log-prob at a valid position gets weight 0 and, when a filter is
  enabled, is rejected whole (ROLL propagates NaN into the weight and rejects the NaN tokens);
* exponentials take the log-ratio clamped to ±20 per token (and a sequence's log weight to ±20)
  as everywhere in this library; ROLL exponentiates unclamped, so a weight above e²⁰ differs
  unless ``upper_bound`` is below it;
* the weight is float32 whatever the input dtype (computed in float32), and never carries
  gradient: ``detach=False`` with inputs that require grad raises;
* a ratio band with low > high or low < 0, or a diff band with low > high, raises a ValueError
  (ROLL silently rejects every token).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import config_value as _get
from ..primitives import (ISSpec, LogRatioBatch, RSOption, bound_weights, importance_weights, log_ratio_batch,
                          max_runs, rejection_keep, segment_ids_from_mask, segment_sums, token_divergence)

__all__ = ["compute_train_infer_correction", "compute_segment_masked_mean", "ROLL_AGG_TYPES"]

#: ROLL's granularities → (IS level, ratio-filter aggregation, diff-filter aggregation) of this library.
ROLL_AGG_TYPES = {
    "token": ("token", "token", "token"),
    "geometric": ("geometric", "seq_mean", "seq_mean"),
    "sequence": ("sequence", "seq_sum", "seq_sum"),
    "segment": ("segment_geometric", "segment_mean", "segment_mean"),
}
_PREFIX = "actor/train_infer_"


def compute_segment_masked_mean(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per maximal run s of consecutive valid positions of a row, the mean of ``tensor`` over s,
    written at s's positions; 0 elsewhere:  out[b, t] = (1/|s|) Σ_{u∈s} tensor[b, u] for t ∈ s.

    Args:
        tensor: (B, T) float values (differentiable: the result carries their gradient).
        mask: (B, T) bool or integer mask, non-zero at valid positions.
    Returns:
        (B, T) tensor of ``tensor``'s dtype.
    """
    if tensor.dim() != 2 or tensor.shape != mask.shape:
        raise ValueError(f"tensor and mask must both be (batch, seq_len); got {tuple(tensor.shape)} and "
                         f"{tuple(mask.shape)}")
    valid = mask if mask.dtype == torch.bool else mask != 0
    ids, S = segment_ids_from_mask(valid), max_runs(mask.shape[-1])
    x = torch.where(valid, tensor, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    mean = segment_sums(x, ids, S) / segment_sums(valid.to(tensor.dtype), ids, S).clamp_min(1.0)
    return torch.where(valid, mean.gather(1, ids), torch.zeros((), dtype=tensor.dtype, device=tensor.device))


def _agg(value: Any, key: str) -> str:
    if value not in ROLL_AGG_TYPES:
        raise ValueError(f"train_infer_correction {key}={value!r} is invalid: allowed values are "
                         f"{list(ROLL_AGG_TYPES)}")
    return value


def _band(value_low: Any, value_high: Any, key: str, ratio: bool) -> tuple[float, float]:
    lo, hi = float(value_low), float(value_high)
    if math.isnan(lo) or math.isnan(hi) or lo > hi or (ratio and lo < 0):
        need = "0 ≤ ratio_low ≤ ratio_high" if ratio else "diff_low ≤ diff_high"
        raise ValueError(f"train_infer_correction filter {key}=[{value_low!r}, {value_high!r}] is invalid: "
                         f"expected {need}")
    return lo, hi


def _filter_options(f: Any, i: int) -> list[tuple[str, RSOption]]:
    """(metric key, option) of one enabled ROLL filter: its ratio band as a k1 option (lo ≤ ρ ≤ hi ⇔
    −log hi ≤ k1 ≤ −log lo) and its diff band as a Δp option."""
    agg = _agg(_get(f, "agg_type", "token"), f"filters[{i}].agg_type")
    _, ratio_agg, diff_agg = ROLL_AGG_TYPES[agg]
    out = []
    if _get(f, "ratio_enabled", True):
        lo, hi = _band(_get(f, "ratio_low", 0.8), _get(f, "ratio_high", 1.2), f"filters[{i}].ratio", True)
        k1 = RSOption(f"{ratio_agg}_k1", ratio_agg, "k1", -math.log(hi) if hi > 0 else math.inf,
                      -math.log(lo) if lo > 0 else math.inf)
        out.append((f"{_PREFIX}{agg}_ratio_mask_mean@sum", k1))
    if _get(f, "diff_enabled", False):
        lo, hi = _band(_get(f, "diff_low", -0.2), _get(f, "diff_high", 0.2), f"filters[{i}].diff", False)
        out.append((f"{_PREFIX}{agg}_diff_mask_mean@sum", RSOption(f"{diff_agg}_dp", diff_agg, "dp", lo, hi)))
    return out


def _granularities(batch: LogRatioBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per valid token, the ratio and the Δp at ROLL's four granularities (0 elsewhere): ρ_t,
    exp(mean log ρ), exp(Σ log ρ) per row and exp(mean_{t∈s} log ρ_t) per segment; Δp_t and its row
    mean, row sum and segment mean."""
    ratio = {}
    for agg, (level, _, _) in ROLL_AGG_TYPES.items():
        ratio[agg] = importance_weights(batch, ISSpec(level, "truncate", math.inf, None, 0.0, False)).weights
    dp = token_divergence(batch, "dp")
    row_sum, seg_sum = batch.row_total(dp), batch.segment_total(dp)
    diff = {"token": dp, "geometric": batch.expand_rows(row_sum / batch.n_row.clamp_min(1.0)),
            "sequence": batch.expand_rows(row_sum),
            "segment": batch.expand_segments(seg_sum / batch.segment_total(batch.mask).clamp_min(1.0))}
    return ratio, diff


def compute_train_infer_correction(
    cfg: Any,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    infer_log_probs: torch.Tensor,
    global_valid_samples: Optional[int] = None,
    global_valid_tokens: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """ROLL's IS weight, filter mask and metrics from the train-infer divergence.

    With ρ_t = π_train(y_t)/π_infer(y_t) and Δp_t = π_train(y_t) − π_infer(y_t) on the valid tokens
    of a row, the statistic of granularity g is ρ_t / Δp_t (token), exp(mean log ρ) / mean Δp
    (geometric), exp(Σ log ρ) / Σ Δp (sequence), exp(mean_{t∈s} log ρ_t) / mean_{t∈s} Δp_t over the
    run s of consecutive valid tokens holding t (segment). is_weight = min(ρ_g, upper_bound) when
    ``is_weight.enabled`` (else 1); filter_mask = ∏ over enabled filters of 1[low ≤ ρ_g ≤ high] (ratio)
    · 1[low ≤ Δp_g ≤ high] (diff). Metrics (ROLL's names; Python floats): for every g,
    ``actor/train_infer_ratio_<g>_mean@sum`` and ``..._diff_<g>_mean@sum`` = Σ over rows of the row's
    token mean / global_valid_samples; ``actor/is_weight_clipfrac@sum`` = #{valid t: ρ_g > upper_bound}
    / global_valid_tokens; per filter ``actor/train_infer_<g>_ratio_mask_mean@sum`` (and ``_diff_``) =
    #{valid t kept by it} / global_valid_tokens; ``actor/train_infer_final_mask_mean`` = share of valid
    tokens every filter keeps (when ``filters`` is non-empty).

    Args:
        cfg: ROLL's ``TrainInferCorrectionConfig`` or an object / mapping with its fields.
        response_mask: (B, T) 0/1 or bool mask of valid tokens.
        old_log_probs: (B, T) π_train log-probs.
        infer_log_probs: (B, T) π_infer (rollout engine) log-probs.
        global_valid_samples: rows with a valid token over all ranks and micro-batches (default:
            this batch's, at least 1).
        global_valid_tokens: valid tokens over all ranks and micro-batches (default: this batch's,
            at least 1).
    Returns:
        (is_weight (B, T) float32, filter_mask (B, T): the mask's integer dtype when no filter is
        enabled, else float32; metrics dict of floats).
    """
    is_cfg, filters = _get(cfg, "is_weight"), list(_get(cfg, "filters", None) or [])
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be (batch, response_length), got shape {tuple(response_mask.shape)}")
    base = response_mask.long()
    T = base.shape[-1]
    batch = log_ratio_batch(old_log_probs, infer_log_probs, base, segment_ids=segment_ids_from_mask(base),
                            max_segments=max_runs(T), log_prob_ceiling=None)  # ROLL does not check log-probs ≤ 0
    valid = batch.input_mask
    n_valid = valid.sum()
    samples = (batch.row_total(valid) > 0).sum().clamp_min(1) if global_valid_samples is None else global_valid_samples
    tokens = n_valid.clamp_min(1) if global_valid_tokens is None else global_valid_tokens
    ratio, diff = _granularities(batch)
    values: dict[str, torch.Tensor] = {}
    for agg in ROLL_AGG_TYPES:
        for kind, per_token in (("ratio", ratio[agg]), ("diff", diff[agg])):
            row_mean = batch.row_total(per_token) / batch.n_row.clamp_min(1.0)
            values[f"{_PREFIX}{kind}_{agg}_mean@sum"] = row_mean.sum() / samples

    if _get(is_cfg, "enabled", False):
        agg = _agg(_get(is_cfg, "weight_type", "token"), "is_weight.weight_type")
        if not _get(is_cfg, "detach", True) and (old_log_probs.requires_grad or infer_log_probs.requires_grad):
            raise ValueError("train_infer_correction is_weight.detach=False: this library's importance weights "
                             "never carry gradient; set detach: true (ROLL's default)")
        ub = _get(is_cfg, "upper_bound", 1.2)
        raw = ratio[agg]
        if ub is None:
            is_weight = raw
        else:
            ub = float(ub)
            spec = ISSpec(ROLL_AGG_TYPES[agg][0], "truncate", ub, None, 1.0 / ub if ub > 0 else math.inf, False)
            values["actor/is_weight_clipfrac@sum"] = batch.above(raw, ub).mul_(batch.mask).sum() / tokens
            is_weight = bound_weights(raw, spec, batch.mask)
    else:
        is_weight = torch.ones(base.shape, dtype=torch.float32, device=base.device)

    filter_mask: torch.Tensor = torch.ones_like(base)
    for i, f in enumerate(filters):
        if not _get(f, "enabled", False):
            continue
        for key, option in _filter_options(f, i):
            keep = rejection_keep(batch, (option,), None).keep_mask(batch)
            values[key] = keep.sum() / tokens
            filter_mask = filter_mask * (keep + (1.0 - valid))  # positions without a token: kept
    if filters:
        values[_PREFIX + "final_mask_mean"] = (filter_mask * valid).sum() / n_valid.clamp_min(1)

    names = list(values)
    floats = torch.stack([torch.as_tensor(values[k], dtype=torch.float64) for k in names]).tolist()  # one sync
    return is_weight, filter_mask, dict(zip(names, floats))
