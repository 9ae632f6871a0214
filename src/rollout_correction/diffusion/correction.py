"""Rollout correction for FlowGRPO-style diffusion training.

A FlowGRPO step has one log-probability per SDE step and sample, from three sources: the rollout
engine (low precision), the trainer's recompute of the old policy (fp32), and the current policy.
Diffusion log-probs are dense over the SDE window — there is no padding — so the core's response
mask is all ones and a rejection becomes a weight of 0.

Two paths, both built on :func:`rollout_correction.compute_rollout_correction`:

* **decoupled** (:func:`apply_rollout_correction`): once per global batch, with (B, S) tensors
  (S = SDE window). ρ = π_old / π_rollout; the returned weight per element is

      wᵢₛ = ISᵢₛ · keepᵢₛ        (IS = 1 when ``rollout_is`` is None; keep ∈ {0, 1} from RS)

  and multiplies the per-element FlowGRPO loss, whose PPO ratio is π_θ / π_old.
* **bypass** (:func:`apply_bypass_mode` then :func:`step_correction` in the loss): π_old :=
  π_rollout, so the PPO ratio π_θ / π_rollout already is the importance ratio. The correction runs
  per SDE step with (B, 1) tensors on log ρ = log π_θ − log π_rollout; with ``loss_type="ppo_clip"``
  only the RS keep mask reaches the loss (``rollout_is`` is a diagnostic), with
  ``loss_type="reinforce"`` the weight is IS × keep.

Per-timestep metrics (:func:`per_step_metrics`) report the gap of every step of the window:
``rollout_corr/step_<s>/logprob_abs_diff`` = mean_i |log π_old − log π_rollout| and the standard
off-policy set of the core, plus the IS mean and rejected fraction of each step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rollout_correction import (METRIC_PREFIX, OffPolicyAccumulator, RolloutCorrectionConfig, as_config,
                                compute_rollout_correction, metrics_to_floats)

__all__ = [
    "MissingLogProbsError",
    "DiffusionCorrection",
    "apply_bypass_mode",
    "apply_rollout_correction",
    "step_correction",
    "correct_log_probs",
    "per_step_metrics",
    "config_notes",
    "apply_bypass_mode_to_diffusion_batch",
    "apply_rollout_correction_to_diffusion_batch",
    "timestep_metrics",
    "BYPASS_METRIC_PREFIX",
]

ROLLOUT_KEY = "rollout_log_probs"
OLD_KEY = "old_log_probs"
WEIGHTS_KEY = "rollout_is_weights"
TIMESTEPS_KEY = "all_timesteps"
# In bypass mode the correction runs per SDE step inside the loss, whose metrics the actor logs
# under its own prefix (verl-omni's convention); the decoupled correction logs ``rollout_corr/``.
BYPASS_METRIC_PREFIX = "actor/" + METRIC_PREFIX


class MissingLogProbsError(KeyError):
    """A batch lacks the log-probabilities a correction path needs (the message names the key)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


@dataclass
class DiffusionCorrection:
    """Result of :func:`correct_log_probs`.

    weights: (B, S) float32, detached: IS weight × keep (0 where rejected); 1 where no IS applies.
    keep: (B, S) bool, False where rejection sampling (or non-finite input) dropped the element.
    metrics: ``rollout_corr/...`` → 0-d tensors.
    """

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- config / notes
def _as_config(config: Any) -> RolloutCorrectionConfig:
    # A per-step config is a config or a mapping of keys; a bare string here is far more often a
    # rejection option (e.g. "seq_mean_k1") than a preset name, so it is refused, not looked up.
    if isinstance(config, str):
        raise TypeError(f"config must be a RolloutCorrectionConfig or a mapping of its keys, got the string "
                        f"{config!r}; for a preset write RolloutCorrectionConfig.from_preset({config!r})")
    # An SDE step's log-prob is a Gaussian log-density, which can be > 0: no log-probability ceiling.
    return as_config(config).replace(log_prob_ceiling=None)


def config_notes(config: Any, *, window_size: int, path: str) -> list[str]:
    """Settings that have no effect, or little power, for a diffusion window.

    The rules follow the short-window tuning guide in docs/diffusion.md.

    Args:
        config: a :class:`RolloutCorrectionConfig` or a mapping of its keys.
        window_size: S, the number of SDE steps the correction sees at once (1 for a bypass step).
        path: ``"bypass_step"`` (:func:`step_correction`) or ``"decoupled"``
            (:func:`apply_rollout_correction`).
    Returns:
        Human-readable notes (empty when every setting is meaningful). The public entry points
        emit each as a ``UserWarning``.
    """
    if path not in ("bypass_step", "decoupled"):
        raise ValueError(f"path must be 'bypass_step' or 'decoupled', got {path!r}")
    cfg = _as_config(config)
    notes: list[str] = []
    options = list(cfg.rs_options)
    token_opts = [o.name for o in options if o.agg == "token"]
    if path == "bypass_step":
        if not cfg.bypass_mode:
            notes.append(
                "step_correction is the bypass-mode path (log π_θ vs log π_rollout per SDE step) but "
                "config.bypass_mode is False; in decoupled mode call apply_rollout_correction once per "
                "batch instead"
            )
        if cfg.loss_type == "ppo_clip" and cfg.is_spec is not None and cfg.is_spec.batch_normalize:
            notes.append(
                "rollout_is_batch_normalize=True has no effect on the loss in bypass mode with "
                "loss_type='ppo_clip': the IS weights are diagnostics only (the PPO ratio π_θ/π_rollout "
                "already is the importance ratio)"
            )
    else:
        if cfg.bypass_mode:
            notes.append(
                "config.bypass_mode is True: old_log_probs are the rollout log-probs, so the decoupled "
                "correction is a no-op (every ratio is 1); apply step_correction inside the loss instead"
            )
    if window_size == 1:
        if token_opts:
            notes.append(
                f"rollout_rs={cfg.rollout_rs!r}: with one SDE step per row, token-level and sequence-level "
                f"rejection are identical; {', '.join(token_opts)} behaves like its seq_mean_* twin, and "
                "seq_mean_* keeps the same meaning if you switch to decoupled mode"
            )
        by_estimator: dict[str, list[str]] = {}
        for o in options:
            by_estimator.setdefault(o.estimator, []).append(o.name)
        for est, names in by_estimator.items():
            if len(names) > 1:
                notes.append(
                    f"rollout_rs options {', '.join(names)} test the same {est} statistic when each row has "
                    "one SDE step; only the tightest bound matters"
                )
    elif window_size == 2 and token_opts:
        notes.append(
            f"rollout_rs={cfg.rollout_rs!r}: token-level rejection has little power with a 2-step SDE window "
            "(each step's log-prob is already a mean over all latent dimensions); prefer seq_mean_* or "
            "seq_max_* options"
        )
    return notes


def _emit(notes: list[str]) -> None:
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)


# --------------------------------------------------------------------------------------- shapes
def _check_window(name_a: str, a: Any, name_b: str, b: Any) -> None:
    for name, t in ((name_a, a), (name_b, b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be (B, S) with S = SDE window size, got shape {tuple(t.shape)}")
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} must have the same (B, S) shape"
        )
    if a.shape[1] < 1:
        raise ValueError(f"{name_a} has an empty SDE window (shape {tuple(a.shape)})")
    if a.device != b.device:
        raise ValueError(f"{name_a} is on {a.device} but {name_b} is on {b.device}")


# --------------------------------------------------------------------------------------- metrics
def per_step_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    keep: Optional[torch.Tensor] = None,
    step_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """Per-timestep diagnostics of a (B, S) window, keys ``rollout_corr/step_<s>/<name>``.

    For each step s (numbered from ``step_offset``):

    * ``logprob_abs_diff`` = mean_i |log π_old(i, s) − log π_rollout(i, s)| over finite pairs;
    * the core's off-policy set (``kl``, ``k3_kl``, ``chi2_token``, ``log_ppl_abs_diff``, …)
      on the column as a (B, 1) batch;
    * with ``weights``: ``weight_mean`` = mean_i wᵢₛ; with ``keep``: ``rejected_fraction``.
    """
    _check_window("old_log_prob", old_log_prob, "rollout_log_prob", rollout_log_prob)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        old = old_log_prob.detach().float()
        ro = rollout_log_prob.detach().float()
        diff = old - ro
        finite = torch.isfinite(diff)
        abs_diff = torch.where(finite, diff.abs(), torch.zeros_like(diff))
        n_finite = finite.sum(0).clamp(min=1)
        step_abs = abs_diff.sum(0) / n_finite
        ones = torch.ones_like(old[:, :1])
        for s in range(old.shape[1]):
            prefix = f"{METRIC_PREFIX}step_{s + step_offset}/"
            out[prefix + "logprob_abs_diff"] = step_abs[s]
            step = OffPolicyAccumulator(log_prob_ceiling=None)  # log-densities: no ceiling (see _as_config)
            step.update(old[:, s : s + 1], ro[:, s : s + 1], ones)
            for k, v in step.compute().items():
                out[prefix + k.split("/", 1)[1]] = v
            if weights is not None:
                out[prefix + "weight_mean"] = weights[:, s].float().mean()
            if keep is not None:
                out[prefix + "rejected_fraction"] = (~keep[:, s]).float().mean()
    return out


# ------------------------------------------------------------------------------------- the paths
def correct_log_probs(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    config: Any,
    *,
    apply_is: bool = True,
    per_step: bool = True,
) -> DiffusionCorrection:
    """Weights, keep mask and metrics for a dense (B, S) block of SDE-step log-probs.

    Runs the core once with an all-ones response mask: keep = (returned mask ≠ 0), and

        w = IS · keep   (apply_is=True and rollout_is set)      w = keep   (otherwise)

    Metrics: the core's set over the block, ``rollout_corr/logprob_abs_diff`` (mean |Δ log π|),
    ``rollout_corr/rejected_fraction``, ``rollout_corr/weight_mean``, and (``per_step``)
    :func:`per_step_metrics` for every step.
    """
    _check_window("old_log_prob", old_log_prob, "rollout_log_prob", rollout_log_prob)
    cfg = _as_config(config)
    old = old_log_prob.detach()
    ro = rollout_log_prob.detach()
    mask = torch.ones(old.shape, dtype=torch.float32, device=old.device)
    out = compute_rollout_correction(old, ro, mask, config=cfg)
    keep = out.response_mask != 0
    zeros = torch.zeros(old.shape, dtype=torch.float32, device=old.device)
    if apply_is and out.weights is not None:
        weights = torch.where(keep, out.weights.float(), zeros)
    else:
        weights = keep.float()
    metrics = dict(out.metrics)
    with torch.no_grad():
        diff = old.float() - ro.float()
        finite = torch.isfinite(diff)
        metrics[METRIC_PREFIX + "logprob_abs_diff"] = torch.where(
            finite, diff.abs(), zeros
        ).sum() / finite.sum().clamp(min=1)
        metrics[METRIC_PREFIX + "rejected_fraction"] = (~keep).float().mean()
        metrics[METRIC_PREFIX + "weight_mean"] = weights.mean()
    if per_step:
        metrics.update(per_step_metrics(old, ro, weights=weights, keep=keep))
    return DiffusionCorrection(weights=weights, keep=keep, metrics=metrics)


def apply_bypass_mode(batch: Any) -> Any:
    """Bypass mode: old_log_probs := rollout_log_probs (skips the fp32 recompute pass).

    ``batch`` is dict-like (``dict``, ``TensorDict``) or has a dict-like ``.batch`` attribute
    (verl's ``DataProto``). It is modified in place and returned. Raises
    :class:`MissingLogProbsError` naming ``rollout_log_probs`` when the rollout engine did not record
    them.
    """
    store = batch
    if not hasattr(store, "__setitem__") and hasattr(batch, "batch"):
        store = batch.batch
    if not (hasattr(store, "__contains__") and hasattr(store, "__setitem__")):
        raise TypeError(f"batch must be dict-like (or have a dict-like .batch), got {type(batch).__name__}")
    if ROLLOUT_KEY not in store or store[ROLLOUT_KEY] is None:
        keys = sorted(map(str, store.keys())) if hasattr(store, "keys") else []
        raise MissingLogProbsError(
            f"bypass mode needs '{ROLLOUT_KEY}' in the batch (the per-step log-probs recorded by the rollout "
            f"engine), but it is missing; batch keys: {keys}. Make the rollout engine return log-probs, or "
            "set bypass_mode=False and recompute old_log_probs."
        )
    value = store[ROLLOUT_KEY]
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        raise TypeError(f"'{ROLLOUT_KEY}' must be a floating-point tensor, got dtype {value.dtype}")
    store[OLD_KEY] = value
    return batch


def apply_rollout_correction(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, config: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled correction, once per global batch: (weights, metrics).

    ρᵢₛ = π_old / π_rollout on the (B, S) window (S = SDE window size, no padding);
    wᵢₛ = ISᵢₛ · keepᵢₛ — the IS weight of ``rollout_is`` (1 when unset) times the RS keep mask, 0 where
    rejected. Multiply the per-element FlowGRPO loss by w (see :func:`flow_grpo_loss`).

    Args:
        old_log_probs: (B, S) fp32 recompute of the old policy.
        rollout_log_probs: (B, S) log-probs recorded by the rollout engine.
        config: :class:`RolloutCorrectionConfig` or a mapping of its keys (e.g. the quickstart's
            ``rollout_is="sequence"``, ``rollout_rs="seq_mean_k1"``, ``rollout_rs_threshold="0.5_2.0"``).
    Returns:
        weights (B, S) float32 detached; metrics ``rollout_corr/...`` (0-d tensors), including
        per-step ``rollout_corr/step_<s>/...``.
    """
    _check_window("old_log_probs", old_log_probs, "rollout_log_probs", rollout_log_probs)
    cfg = _as_config(config)
    _emit(config_notes(cfg, window_size=old_log_probs.shape[1], path="decoupled"))
    res = correct_log_probs(old_log_probs, rollout_log_probs, cfg, apply_is=True)
    return res.weights, res.metrics


def step_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    config: Any,
    *,
    step_index: Optional[int] = None,
    prefix: str = METRIC_PREFIX,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bypass-mode correction of one SDE step: (keep_weights, metrics).

    log ρᵢ = log π_θ(i) − log π_rollout(i) (π_θ detached). ``loss_type="ppo_clip"``: keep_weights = RS keep
    mask (1 keep / 0 reject); the IS weights of ``rollout_is`` only appear in the metrics, because the PPO
    ratio π_θ/π_rollout already corrects. ``loss_type="reinforce"``: keep_weights = IS · keep.

    Args:
        log_prob: current-policy log-probs of one step, (B, 1) (or (B,)); may carry grad.
        rollout_log_prob: rollout log-probs of the same step, same shape.
        config: :class:`RolloutCorrectionConfig` or a mapping of its keys.
        step_index: if given, every metric key is ``rollout_corr/step_<k>/<name>`` (so the metrics
            of the steps of a window can be merged); otherwise ``rollout_corr/<name>``.
        prefix: the metric prefix in place of ``rollout_corr/``; :data:`BYPASS_METRIC_PREFIX`
            (``actor/rollout_corr/``) is where verl-omni's actor logs the per-step correction.
    Returns:
        keep_weights with the shape of ``log_prob`` (float32, detached) and the metrics.
    """
    if not isinstance(log_prob, torch.Tensor) or not isinstance(rollout_log_prob, torch.Tensor):
        raise TypeError("log_prob and rollout_log_prob must be torch.Tensors")
    if log_prob.shape != rollout_log_prob.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and rollout_log_prob {tuple(rollout_log_prob.shape)} "
            "must have the same shape"
        )
    squeeze = log_prob.dim() == 1
    lp, ro = (
        (log_prob.unsqueeze(1), rollout_log_prob.unsqueeze(1)) if squeeze else (log_prob, rollout_log_prob)
    )
    if lp.dim() != 2 or lp.shape[1] != 1:
        raise ValueError(
            f"step_correction works on one SDE step: expected (B, 1) or (B,), got "
            f"{tuple(log_prob.shape)}; for a (B, S) window use apply_rollout_correction (decoupled) "
            "or call step_correction once per step"
        )
    cfg = _as_config(config)
    _emit(config_notes(cfg, window_size=1, path="bypass_step"))
    res = correct_log_probs(lp, ro, cfg, apply_is=cfg.loss_type == "reinforce", per_step=False)
    metrics = res.metrics
    if step_index is not None:
        metrics = {f"{METRIC_PREFIX}step_{step_index}/{k.split('/', 1)[1]}": v for k, v in metrics.items()}
    if prefix != METRIC_PREFIX:
        metrics = {prefix + k[len(METRIC_PREFIX):]: v for k, v in metrics.items()}
    weights = res.weights.squeeze(1) if squeeze else res.weights
    return weights, metrics


# ------------------------------------------------------------------------ verl-omni's entry points
def _store(batch: Any) -> Any:
    store = batch.batch if not hasattr(batch, "__setitem__") and hasattr(batch, "batch") else batch
    if not (hasattr(store, "__contains__") and hasattr(store, "__setitem__")):
        raise TypeError(f"batch must be dict-like (or have a dict-like .batch), got {type(batch).__name__}")
    return store


def timestep_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, timesteps: torch.Tensor, prefix: str = METRIC_PREFIX
) -> dict[str, torch.Tensor]:
    """|Δ log π| grouped by timestep value: ``<prefix>logprob_abs_diff/ts_<t>`` (``t`` as ``%.4g``).

    With per-sample SDE windows the column index of a (B, S) block is not a timestep; the value in
    ``timesteps`` (B, S) is. Each key is the mean of |log π_old − log π_rollout| over the finite
    elements taken at that timestep.
    """
    _check_window("old_log_prob", old_log_prob, "rollout_log_prob", rollout_log_prob)
    if not isinstance(timesteps, torch.Tensor) or timesteps.shape != old_log_prob.shape:
        raise ValueError(
            f"timesteps must be a tensor of the log-probs' shape {tuple(old_log_prob.shape)}, got "
            f"{tuple(timesteps.shape) if isinstance(timesteps, torch.Tensor) else type(timesteps).__name__}"
        )
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        diff = (old_log_prob.detach().float() - rollout_log_prob.detach().float()).abs()
        finite = torch.isfinite(diff)
        ts = timesteps.detach().to(diff.device)
        for t in torch.unique(ts):
            sel = (ts == t) & finite
            out[f"{prefix}logprob_abs_diff/ts_{float(t):.4g}"] = diff[sel].sum() / sel.sum().clamp(min=1)
    return out


def apply_bypass_mode_to_diffusion_batch(batch: Any) -> Any:
    """verl-omni's name for :func:`apply_bypass_mode`: ``old_log_probs := rollout_log_probs``."""
    return apply_bypass_mode(batch)


def apply_rollout_correction_to_diffusion_batch(batch: Any, rollout_corr_config: Any) -> tuple[Any, dict[str, float]]:
    """Decoupled correction on a batch, under verl-omni's name and conventions.

    Reads ``old_log_probs`` and ``rollout_log_probs`` (B, S) from ``batch`` (a dict, a TensorDict or
    an object with a dict-like ``.batch`` such as verl's ``DataProto``), runs
    :func:`apply_rollout_correction` and, when ``rollout_is`` or ``rollout_rs`` is set, writes the
    folded weight w = IS · keep to ``batch["rollout_is_weights"]`` (the dtype of ``old_log_probs``).
    With ``all_timesteps`` (B, S) in the batch the metrics include :func:`timestep_metrics`.

    Returns:
        (batch, metrics as Python floats under ``rollout_corr/``).
    """
    store = _store(batch)
    missing = [k for k in (OLD_KEY, ROLLOUT_KEY) if k not in store or store[k] is None]
    if missing:
        raise MissingLogProbsError(
            f"the decoupled correction needs {missing} in the batch: record log-probs in the rollout engine "
            "and run the old-log-prob recompute (or use bypass mode)"
        )
    old, ro = store[OLD_KEY], store[ROLLOUT_KEY]
    cfg = _as_config(rollout_corr_config)
    weights, metrics = apply_rollout_correction(old, ro, cfg)
    ts = store[TIMESTEPS_KEY] if TIMESTEPS_KEY in store else None
    if ts is not None and isinstance(ts, torch.Tensor) and ts.shape == old.shape:
        metrics.update(timestep_metrics(old, ro, ts))
    if cfg.rollout_is or cfg.rollout_rs:
        store[WEIGHTS_KEY] = weights.to(old.dtype)
    return batch, metrics_to_floats(metrics)
