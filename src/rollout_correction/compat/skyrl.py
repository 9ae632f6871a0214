"""Drop-in names of SkyRL 0.4.0's ``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py``,
and a SkyRL policy loss with this library's correction.

A SkyRL user can swap one import::

    # from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import compute_off_policy_correction
    from rollout_correction.compat.skyrl import compute_off_policy_correction

Every function keeps SkyRL's parameter names, order, shapes, return values and metric names, and
reads SkyRL's ``OffPolicyCorrectionConfig`` (``trainer.algorithm.off_policy_correction``) or any
object or mapping with its keys (a missing key takes SkyRL's default). With ρ_t = exp(old_log_probs −
rollout_logprobs) (log clamped to ±20):

* ``compute_tis_ratio``: token ``min(ρ_t, token_tis_ratio_clip_high)`` (B, T), or sequence
  ``min(∏ρ_t, sequence_tis_ratio_clip_high)`` (B, 1) — this library's ``rollout_is`` token /
  sequence, truncated;
* ``compute_outlier_token_mask``: (B, 1), 0 for a sequence with any valid ρ_t outside
  [``outlier_token_is_threshold_low``, ``outlier_token_is_threshold_high``] — the veto, both sides;
* ``compute_token_mask``: (B, T), 0 for a valid token with ρ_t outside
  [``token_mask_is_threshold_low``, ``_high``] — ``token_k1``;
* ``compute_sequence_mask``: (B, 1), 0 for a sequence whose exp(mean log ρ_t) (``geometric``) or
  ∏ρ_t (``product``) lies outside [``geo_mask_low``, ``geo_mask_high``] / [``product_mask_low``,
  ``product_mask_high``] — ``seq_mean_k1`` / ``seq_sum_k1``;
* ``compute_off_policy_correction``: SkyRL's pipeline — the outlier mask on ``loss_mask``, the
  token mask on what survives, then the TIS ratio and the sequence mask on what survives both —
  with SkyRL's ``is_ratio_*`` statistics of ρ_t·loss_mask; ``apply_off_policy_correction`` and
  ``off_policy_correction_enabled`` as SkyRL's.

The values come from this library's core, so its metrics come along: each metrics dict also holds
this library's ``rollout_corr/…`` metrics of the same call. Differences a caller can see:

* weights are 0 outside ``loss_mask`` (SkyRL: the ratio there; SkyRL's losses multiply by the
  mask, so no loss changes), and a sequence ratio is 0 for a row without valid tokens;
* NaN / ±inf log-probs at valid positions drop the sequence (its mask entries become 0, counted
  in ``rollout_corr/nonfinite_seq_fraction``), where SkyRL propagates NaN into the loss;
* a band compares log ρ with the logarithm of its bound (SkyRL: ρ with the bound); the two
  agree except within a rounding error of a bound.

**Policy loss.** :func:`register_policy_loss` registers :func:`policy_loss` in SkyRL's
``PolicyLossRegistry`` under ``"rollout_correction"`` (the name goes in
``trainer.algorithm.policy_loss_type``), as SkyRL registers custom losses: one call in the entry
script, before Ray starts. The loss is SkyRL's PPO clip (``eps_clip_low`` / ``eps_clip_high``, dual
clip at ``clip_ratio_c``) with the correction of ``trainer.algorithm.off_policy_correction`` read by
:meth:`RolloutCorrectionConfig.from_dict` (the criteria judged together on the original mask) and
summed over the accepted tokens, as SkyRL's losses sum: SkyRL has already divided the advantages by
the token counts of the original mask (``loss_reduction``), so rejected tokens stay in the
denominator, as in SkyRL's own losses.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction
from .. import config_value as _get
from rollout_correction_core.vocabulary import ConfigError, as_float
from rollout_correction_core import Aggregation, ClipRange, PolicyLoss

__all__ = ["off_policy_correction_enabled", "compute_tis_ratio", "compute_outlier_token_mask", "compute_token_mask",
           "compute_sequence_mask", "compute_off_policy_correction", "apply_off_policy_correction",
           "policy_loss", "register_policy_loss", "POLICY_LOSS_NAME", "SKYRL_KEYS", "from_skyrl"]

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


#: The name :func:`register_policy_loss` registers by default (``trainer.algorithm.policy_loss_type``).
POLICY_LOSS_NAME = "rollout_correction"


def _key(cfg: Any, key: str) -> Any:
    return _get(cfg, key, SKYRL_KEYS[key])


class _Call:
    """One call of the core on (old, rollout, mask) with ``settings``, and the row counts SkyRL's
    sequence metrics divide by: its batch size B (every row) and the rows the core used."""

    def __init__(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, **settings: Any) -> None:
        self.mask = mask
        self.out = compute_rollout_correction(old, rollout, mask, config=RolloutCorrectionConfig(
            **settings, log_prob_ceiling=None))  # SkyRL does not check that a log-prob is ≤ 0
        self.floats = self.out.metrics_as_floats()
        self.batch = mask.shape[0]
        rows_in = int((mask > 0).any(-1).sum()) if mask.numel() else 0
        self.rows_used = round(rows_in * (1.0 - self.floats["rollout_corr/nonfinite_seq_fraction"]))

    def metric(self, name: str) -> float:
        return self.floats.get("rollout_corr/" + name, 0.0)

    def row_share(self, name: str, extra: int = 0) -> float:
        """A share of the used rows (this library's metric ``name``) as a share of all B rows."""
        return (round(self.metric(name) * self.rows_used) + extra) / max(self.batch, 1)

    def kept_rows(self) -> torch.Tensor:
        """(B,) bool: the row has a token left (rows without valid tokens: False)."""
        return (self.out.response_mask > 0).any(-1)

    def ours(self) -> dict[str, float]:
        return dict(self.floats)


def _band(low: Any, high: Any) -> dict[str, Any]:
    """A ratio band [low, high] (low may be 0: no lower bound) as this library's first-generation
    ``rollout_rs`` bounds (the option is set by the caller)."""
    return {"rollout_rs_threshold": float(high), "rollout_rs_threshold_lower": float(low)}


def _tis(call: _Call, tis_ratio_type: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, float]]:
    w = call.out.weights
    if tis_ratio_type == "token":
        return w.to(dtype), {"tis_token_clip_high_ratio": call.metric("rollout_is_ratio_fraction_high")}
    return (w.amax(-1, keepdim=True) if w.shape[-1] else w.sum(-1, keepdim=True)).to(dtype), \
        {"tis_seq_clip_high_ratio": call.row_share("rollout_is_ratio_fraction_high")}


def _tis_settings(tis_ratio_type: str, cfg: Any) -> dict[str, Any]:
    if tis_ratio_type not in ("token", "sequence"):
        raise ValueError(f"Unknown tis_ratio_type: {tis_ratio_type}")
    return {"rollout_is": tis_ratio_type, "rollout_is_threshold": _key(cfg, f"{tis_ratio_type}_tis_ratio_clip_high")}


def off_policy_correction_enabled(off_policy_correction: Any) -> bool:
    """Whether any correction (TIS, sequence / outlier / token masking) is configured (SkyRL's rule:
    the outlier mask needs one bound, the token mask both)."""
    cfg = off_policy_correction
    return (_key(cfg, "tis_ratio_type") is not None or _key(cfg, "sequence_mask_metric") is not None
            or _key(cfg, "outlier_token_is_threshold_low") is not None
            or _key(cfg, "outlier_token_is_threshold_high") is not None
            or (_key(cfg, "token_mask_is_threshold_low") is not None
                and _key(cfg, "token_mask_is_threshold_high") is not None))


def compute_tis_ratio(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                      tis_ratio_type: str, off_policy_correction: Any) -> tuple[torch.Tensor, dict]:
    """Truncated IS ratio: token level (B, T) ``min(ρ_t, token_tis_ratio_clip_high)``, metric
    ``tis_token_clip_high_ratio`` (share of valid tokens above the cap); sequence level (B, 1)
    ``min(∏ρ_t, sequence_tis_ratio_clip_high)``, metric ``tis_seq_clip_high_ratio`` (share of the B
    sequences above the cap). Detached, in ``old_log_probs``' dtype."""
    call = _Call(old_log_probs, rollout_logprobs, loss_mask, **_tis_settings(tis_ratio_type, off_policy_correction))
    ratio, metrics = _tis(call, tis_ratio_type, old_log_probs.dtype)
    return ratio, {**metrics, **call.ours()}


def _outlier_settings(cfg: Any) -> dict[str, Any]:
    return {"rollout_token_veto_threshold": _key(cfg, "outlier_token_is_threshold_low"),
            "rollout_token_veto_threshold_high": _key(cfg, "outlier_token_is_threshold_high")}


def _outlier(call: _Call) -> tuple[torch.Tensor, dict[str, float]]:
    had = (call.mask > 0).any(-1)
    keep = call.kept_rows() | ~had
    return keep.float().unsqueeze(-1), {
        "outlier_seq_masked_ratio": float((~keep).sum()) / max(call.batch, 1),
        "outlier_seq_over_high_ratio": call.row_share("rollout_is_veto_high_fraction"),
        "outlier_seq_under_low_ratio": call.row_share("rollout_is_veto_fraction")}


def compute_outlier_token_mask(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                               off_policy_correction: Any) -> tuple[torch.Tensor, dict]:
    """(B, 1) float: 0 for a sequence with a valid token whose ρ_t lies below
    ``outlier_token_is_threshold_low`` or above ``outlier_token_is_threshold_high`` (either may be
    None); metrics ``outlier_seq_masked_ratio``, ``_over_high_ratio``, ``_under_low_ratio`` (shares
    of the B sequences)."""
    call = _Call(old_log_probs, rollout_logprobs, loss_mask, **_outlier_settings(off_policy_correction))
    mask, metrics = _outlier(call)
    return mask, {**metrics, **call.ours()}


def compute_token_mask(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       off_policy_correction: Any) -> tuple[torch.Tensor, dict]:
    """(B, T) float: 0 for a valid token whose ρ_t lies outside [``token_mask_is_threshold_low``,
    ``token_mask_is_threshold_high``], 1 elsewhere (positions outside ``loss_mask`` too); metric
    ``token_mask_ratio``, the share of valid tokens masked."""
    cfg = off_policy_correction
    call = _Call(old_log_probs, rollout_logprobs, loss_mask, rollout_rs="token",
                 **_band(_key(cfg, "token_mask_is_threshold_low"), _key(cfg, "token_mask_is_threshold_high")))
    token_mask = ((call.out.response_mask > 0) | (loss_mask == 0)).float()
    return token_mask, {"token_mask_ratio": call.metric("rollout_rs_token_k1_masked_fraction"), **call.ours()}


_SEQUENCE_MASKS = {"geometric": ("geo", "geometric", "seq_mean_k1"), "product": ("product", "sequence", "seq_sum_k1")}


def _sequence_settings(metric: str, cfg: Any) -> dict[str, Any]:
    if metric not in _SEQUENCE_MASKS:
        raise ValueError(f"Unknown sequence_mask_metric: {metric}")
    prefix, mode, _ = _SEQUENCE_MASKS[metric]
    return {"rollout_rs": mode, **_band(_key(cfg, f"{prefix}_mask_low"), _key(cfg, f"{prefix}_mask_high"))}


def _sequence(call: _Call, metric: str, cfg: Any) -> tuple[torch.Tensor, dict[str, float]]:
    prefix, _, option = _SEQUENCE_MASKS[metric]
    low, high = float(_key(cfg, f"{prefix}_mask_low")), float(_key(cfg, f"{prefix}_mask_high"))
    had = (call.mask > 0).any(-1)
    empty = int((~had).sum())  # SkyRL's statistic of a row without valid tokens is exp(0) = 1
    empty_high, empty_low = empty * (1.0 > high), empty * (1.0 < low)
    keep = call.kept_rows() | (~had & (low <= 1.0 <= high))
    name = "geo" if metric == "geometric" else "product"
    return keep.float().unsqueeze(-1), {
        f"{name}_sequence_mask_masked_ratio": float((~keep).sum()) / max(call.batch, 1),
        # ρ_agg above the band is a k1 statistic below its lower bound, and the reverse
        f"{name}_sequence_mask_over_high_ratio": call.row_share(f"rollout_rs_{option}_fraction_low", empty_high),
        f"{name}_sequence_mask_under_low_ratio": call.row_share(f"rollout_rs_{option}_fraction_high", empty_low)}


def compute_sequence_mask(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                          sequence_mask_metric: str, off_policy_correction: Any) -> tuple[torch.Tensor, dict]:
    """(B, 1) float: 0 for a sequence whose exp(mean log ρ_t) (``"geometric"``) or ∏ρ_t
    (``"product"``) over its valid tokens lies outside the configured band; metrics
    ``{geo|product}_sequence_mask_masked_ratio``, ``_over_high_ratio``, ``_under_low_ratio`` (shares
    of the B sequences; a row without valid tokens has the statistic 1, as in SkyRL)."""
    settings = _sequence_settings(sequence_mask_metric, off_policy_correction)
    call = _Call(old_log_probs, rollout_logprobs, loss_mask, **settings)
    mask, metrics = _sequence(call, sequence_mask_metric, off_policy_correction)
    return mask, {**metrics, **call.ours()}


def _is_ratio_metrics(ratio: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, float]:
    """SkyRL's ``is_ratio_*`` statistics of ρ_t·loss_mask over all B·T entries (mean over valid ones)."""
    if ratio.numel() == 0:
        return {"is_ratio_mean": 0.0, "is_ratio_std": math.nan, "is_ratio_max": math.nan, "is_ratio_min": math.nan}
    values = torch.stack([ratio.sum() / loss_mask.sum().clamp(min=1.0), ratio.std(), ratio.max(), ratio.min()])
    return dict(zip(("is_ratio_mean", "is_ratio_std", "is_ratio_max", "is_ratio_min"), values.tolist()))


def compute_off_policy_correction(old_log_probs: torch.Tensor, rollout_logprobs: torch.Tensor,
                                  loss_mask: torch.Tensor, off_policy_correction: Any
                                  ) -> tuple[Optional[torch.Tensor], dict, torch.Tensor]:
    """SkyRL's pipeline: (TIS ratio or None, metrics, loss mask after the outlier, token and sequence
    masks). The outlier mask applies to ``loss_mask``, the token mask to what it keeps, the TIS ratio
    and the sequence mask to what both keep. Without any correction configured: ``(None, {}, loss_mask)``.
    Three calls of the core: ρ_t and the outlier mask; the token mask; the TIS ratio and the sequence
    mask."""
    cfg = off_policy_correction
    if not off_policy_correction_enabled(cfg):
        return None, {}, loss_mask
    metrics: dict[str, float] = {}
    first = _Call(old_log_probs, rollout_logprobs, loss_mask, rollout_is="token", rollout_is_threshold=math.inf,
                  **_outlier_settings(cfg))
    metrics.update(_is_ratio_metrics(first.out.weights * loss_mask, loss_mask))
    ours = first.ours()
    if _key(cfg, "outlier_token_is_threshold_low") is not None or _key(cfg, "outlier_token_is_threshold_high") is not None:
        outlier, outlier_metrics = _outlier(first)
        loss_mask = loss_mask * outlier
        metrics.update(outlier_metrics)
    if _key(cfg, "token_mask_is_threshold_low") is not None and _key(cfg, "token_mask_is_threshold_high") is not None:
        token_mask, token_metrics = compute_token_mask(old_log_probs, rollout_logprobs, loss_mask, cfg)
        loss_mask = loss_mask * token_mask
        metrics["token_mask_ratio"] = token_metrics.pop("token_mask_ratio")
        ours.update({k: v for k, v in token_metrics.items() if k not in ours})
    tis_type, seq_metric = _key(cfg, "tis_ratio_type"), _key(cfg, "sequence_mask_metric")
    tis_ratio = None
    if tis_type is not None or seq_metric is not None:
        settings = {**(_tis_settings(tis_type, cfg) if tis_type is not None else {}),
                    **(_sequence_settings(seq_metric, cfg) if seq_metric is not None else {})}
        last = _Call(old_log_probs, rollout_logprobs, loss_mask, **settings)
        if tis_type is not None:
            tis_ratio, tis_metrics = _tis(last, tis_type, old_log_probs.dtype)
            metrics.update(tis_metrics)
        if seq_metric is not None:
            sequence_mask, sequence_metrics = _sequence(last, seq_metric, cfg)
            loss_mask = loss_mask * sequence_mask
            metrics.update(sequence_metrics)
        ours.update({k: v for k, v in last.ours().items() if k not in ours})
    return tis_ratio, {**metrics, **ours}, loss_mask


def apply_off_policy_correction(loss: torch.Tensor, old_log_probs: torch.Tensor, rollout_logprobs: Optional[torch.Tensor],
                                loss_mask: torch.Tensor, off_policy_correction: Any
                                ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(loss × TIS ratio, the corrected loss mask, metrics); unchanged without ``rollout_logprobs``."""
    if rollout_logprobs is None:
        return loss, loss_mask, {}
    tis_ratio, metrics, loss_mask = compute_off_policy_correction(old_log_probs, rollout_logprobs, loss_mask,
                                                                  off_policy_correction)
    return (loss if tis_ratio is None else loss * tis_ratio), loss_mask, metrics


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, config: Any,
                loss_mask: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """A SkyRL policy loss (SkyRL's signature): Σ over the accepted tokens of w_t · ℓ_t, ℓ_t SkyRL's
    dual-clip PPO loss (``config.eps_clip_low`` / ``eps_clip_high`` / ``clip_ratio_c``) and w_t, the
    accepted tokens from ``config.off_policy_correction`` (:meth:`RolloutCorrectionConfig.from_dict`).
    The advantages arrive divided by SkyRL's ``loss_reduction`` counts of the original mask, so the
    sum is SkyRL's reduction and rejected tokens stay in its denominator. Metrics: ``clip_ratio`` and
    this library's ``rollout_corr/…``."""
    if rollout_logprobs is None:
        raise ValueError(f"policy_loss_type={POLICY_LOSS_NAME!r} needs the rollout log-probs: SkyRL passes them "
                         "when the generator returns them (generator.sampling_params.logprobs)")
    mask = torch.ones_like(log_probs) if loss_mask is None else loss_mask
    block = _get(config, "off_policy_correction", None)
    correction = RolloutCorrectionConfig.from_dict(from_skyrl({k: _key(block, k) for k in SKYRL_KEYS}))
    loss, metrics = compute_policy_loss(
        log_probs, old_log_probs, advantages, mask, config=correction, rollout_log_prob=rollout_logprobs,
        loss=PolicyLoss(
            clip=ClipRange(
                low=float(_get(config, "eps_clip_low", 0.2)), high=float(_get(config, "eps_clip_high", 0.2)),
                dual=float(_get(config, "clip_ratio_c", 3.0))),
            aggregation=Aggregation("token-sum")))
    floats = {k: float(v) for k, v in zip(metrics, torch.stack([v.detach().reshape(()).double()
                                                                   for v in metrics.values()]).tolist())}
    return loss, {"clip_ratio": floats.get("actor/pg_clipfrac", 0.0), **floats}


def register_policy_loss(name: str = POLICY_LOSS_NAME) -> str:
    """Register :func:`policy_loss` in SkyRL's ``PolicyLossRegistry`` under ``name`` (SkyRL's own way
    to add a loss: call it in the entry script, before Ray starts, as SkyRL's custom-loss example
    does); returns the name. Registering the same function twice is a no-op; another function under
    the name raises SkyRL's ValueError."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    if name in PolicyLossRegistry.list_available() and PolicyLossRegistry.get(name) is policy_loss:
        return name
    PolicyLossRegistry.register(name, policy_loss)
    return name
