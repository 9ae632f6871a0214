"""Rollout correction for FlowGRPO-style diffusion training (one log-prob per SDE step).

Entry points::

    from rollout_correction.diffusion import (apply_bypass_mode, apply_rollout_correction,
                                              step_correction, flow_grpo_loss)

    # decoupled: once per global batch, (B, S) tensors, S = SDE window
    weights, metrics = apply_rollout_correction(old_log_probs, rollout_log_probs, config)
    loss, loss_metrics = flow_grpo_loss(log_probs, old_log_probs, advantages, weights)

    # bypass: old := rollout, then per SDE step inside the loss, (B, 1) tensors
    apply_bypass_mode(batch)
    keep, metrics = step_correction(log_prob_s, rollout_log_prob_s, config, step_index=s)
    loss_s, _ = flow_grpo_loss(log_prob_s, rollout_log_prob_s, advantages, keep)

verl-omni's names work as well: ``apply_bypass_mode_to_diffusion_batch(batch)``,
``apply_rollout_correction_to_diffusion_batch(batch, config)`` (writes ``rollout_is_weights``),
the ``grpo_guard_loss``, and :class:`FlowMatchSDEScheduler` (a diffusers scheduler whose ``step``
returns ``(prev_sample, log_prob, prev_sample_mean, std_dev_t)``; needs the ``diffusion`` extra).

See ``docs/diffusion.md``. ``rollout-correction diffusion-demo`` trains a tiny diffusers
transformer with a bf16 / fp8 rollout engine; ``python -m rollout_correction.diffusion.example``
is the 2-D toy.
"""

from .correction import (
    BYPASS_METRIC_PREFIX,
    DiffusionCorrection,
    MissingLogProbsError,
    apply_bypass_mode,
    apply_bypass_mode_to_diffusion_batch,
    apply_rollout_correction,
    apply_rollout_correction_to_diffusion_batch,
    config_notes,
    correct_log_probs,
    per_step_metrics,
    step_correction,
    timestep_metrics,
)
from .loss import flow_grpo_advantages, flow_grpo_loss, grpo_guard_loss, sde_kl_loss
from .sde import (
    SDE_TYPES,
    flow_sde_log_prob,
    flow_sde_step,
    gaussian_step_log_prob,
    ode_step,
    sde_sigma,
    sde_step_mean_std,
    time_grid,
)

_NEEDS_DIFFUSERS = {"FlowMatchSDEScheduler": "scheduler", "FlowMatchSDESchedulerOutput": "scheduler"}


def __getattr__(name: str):
    # The scheduler subclasses diffusers' scheduler; import it (and diffusers) only when asked for.
    if name in _NEEDS_DIFFUSERS:
        import importlib

        return getattr(importlib.import_module(f".{_NEEDS_DIFFUSERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "apply_bypass_mode_to_diffusion_batch",
    "apply_rollout_correction_to_diffusion_batch",
    "timestep_metrics",
    "BYPASS_METRIC_PREFIX",
    "grpo_guard_loss",
    "sde_kl_loss",
    "flow_grpo_advantages",
    "apply_bypass_mode",
    "apply_rollout_correction",
    "step_correction",
    "flow_grpo_loss",
    "per_step_metrics",
    "correct_log_probs",
    "config_notes",
    "DiffusionCorrection",
    "MissingLogProbsError",
    "gaussian_step_log_prob",
    "sde_step_mean_std",
    "sde_sigma",
    "ode_step",
    "time_grid",
    "SDE_TYPES",
    "flow_sde_step",
    "flow_sde_log_prob",
    "FlowMatchSDEScheduler",
    "FlowMatchSDESchedulerOutput",
]
