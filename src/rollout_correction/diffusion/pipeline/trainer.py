"""The fp32 trainer of the pipeline demo: recompute, correction, FlowGRPO / GRPO-Guard update.

One iteration, as verl-omni's diffusion trainer runs it:

1. the engine samples the batch (prompts × group size) and records ``rollout_log_probs``;
2. advantages from the rewards (group baseline; global or per-group std);
3. **decoupled** variants recompute ``old_log_probs`` in fp32 over each sample's window and, for
   ``decoupled_is_rs``, call :func:`apply_rollout_correction_to_diffusion_batch` once (sequence IS ×
   ``seq_mean_k1`` RS, folded into ``rollout_is_weights``); **bypass** variants call
   :func:`apply_bypass_mode_to_diffusion_batch` (old := rollout) and, for ``bypass_rs``, run
   :func:`step_correction` on every SDE step inside the loss;
4. the batch is split into mini-batches; each takes one optimiser step on the mean over the
   window's steps of the per-step loss (``flow_grpo`` or ``grpo_guard``), plus an optional KL to
   the reference policy (the warm-started weights; the base model under LoRA).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from rollout_correction.diffusion.correction import (
    BYPASS_METRIC_PREFIX,
    apply_bypass_mode_to_diffusion_batch,
    apply_rollout_correction_to_diffusion_batch,
    step_correction,
)
from rollout_correction.diffusion.loss import flow_grpo_advantages, flow_grpo_loss, grpo_guard_loss, sde_kl_loss

from .engine import Trajectory, make_scheduler
from .model import PromptBank, velocity

__all__ = ["VARIANTS", "TrainConfig", "Trainer", "QUICKSTART"]

# The diffusion guide's quickstart (sequence IS, seq_mean_k1 RS in the band [0.5, 2.0]).
QUICKSTART = {"rollout_is": "sequence", "rollout_is_threshold": 2.0,
              "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.5_2.0"}

# variant -> (engine precision override, bypass, correction config or None)
VARIANTS: dict[str, tuple[Optional[str], bool, Optional[dict]]] = {
    "fp32_reference": ("fp32", False, None),
    "naive": (None, False, None),
    "decoupled_is_rs": (None, False, QUICKSTART),
    "bypass": (None, True, None),
    "bypass_rs": (None, True, {**QUICKSTART, "bypass_mode": True}),
}


@dataclass
class TrainConfig:
    num_steps: int = 10
    shift: float = 3.0
    noise_level: float = 0.7
    sde_type: str = "sde"
    window_size: int = 2
    window_range: tuple[int, int] = (0, 5)
    cfg_scale: float = 1.0
    prompts_per_batch: int = 4
    group_size: int = 4
    mini_batches: int = 2
    lr: float = 1e-3
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    adv_std: str = "global"
    loss: str = "flow_grpo"
    kl_coef: float = 0.0
    lora_rank: int = 0


@dataclass
class IterationLog:
    reward: float
    times: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)
    gap: Optional[torch.Tensor] = None  # (B, S) |log π_old − log π_rollout| (first mini-step for bypass)
    timesteps: Optional[torch.Tensor] = None  # (B, S)


def add_lora(model: nn.Module, rank: int) -> nn.Module:
    """Wrap the transformer's attention projections with LoRA adapters (peft)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                     target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    return get_peft_model(model, cfg)


class Trainer:
    """fp32 policy, optimiser and one FlowGRPO iteration per :meth:`update` call."""

    def __init__(self, model: nn.Module, bank: PromptBank, cfg: TrainConfig, *, bypass: bool,
                 correction: Optional[dict], seed: int = 0):
        self.cfg = cfg
        self.generator = torch.Generator().manual_seed(seed)
        self.bank = bank
        self.bypass = bypass
        self.correction = correction
        self.reference = None
        if cfg.lora_rank > 0:
            model = add_lora(model, cfg.lora_rank)
        elif cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval()
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
        self.sched = make_scheduler(cfg.num_steps, cfg.shift)

    def _step(self, model: nn.Module, traj: Trajectory, rows: torch.Tensor, s: int):
        """(log_prob (b,), mean, std_dev_t, sqrt_dt) of window step s for ``rows``, fp32."""
        x = traj.latents[rows, s]
        t = traj.timesteps[rows, s]
        v = velocity(model, x, t, traj.prompt[rows], self.bank, self.cfg.cfg_scale, torch.float32)
        _, lp, mean, std, sqrt_dt = self.sched.sample_previous_step(
            sample=x, model_output=v, timestep=t, noise_level=self.cfg.noise_level,
            prev_sample=traj.latents[rows, s + 1], sde_type=self.cfg.sde_type, return_sqrt_dt=True)
        return lp, mean, std, sqrt_dt

    @torch.no_grad()
    def recompute(self, traj: Trajectory) -> torch.Tensor:
        """fp32 ``old_log_probs`` (B, S) over each sample's window."""
        rows = torch.arange(traj.prompt.shape[0])
        return torch.stack([self._step(self.model, traj, rows, s)[0] for s in range(traj.timesteps.shape[1])], 1)

    def update(self, traj: Trajectory, rewards: torch.Tensor, t_rollout: float) -> IterationLog:
        cfg = self.cfg
        times = {"rollout": t_rollout}
        adv = flow_grpo_advantages(rewards, cfg.group_size, std=cfg.adv_std)
        batch: dict[str, Any] = {"rollout_log_probs": traj.rollout_log_probs, "all_timesteps": traj.timesteps}
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        if self.bypass:
            apply_bypass_mode_to_diffusion_batch(batch)
        else:
            batch["old_log_probs"] = self.recompute(traj)
            if self.correction is not None:
                _, m = apply_rollout_correction_to_diffusion_batch(batch, self.correction)
                metrics.update(m)
        times["recompute"] = time.perf_counter() - t0
        gap = None if self.bypass else (batch["old_log_probs"] - traj.rollout_log_probs).abs()

        t0 = time.perf_counter()
        b, steps = traj.timesteps.shape
        perm = torch.randperm(b, generator=self.generator)
        old_means = None
        if cfg.loss == "grpo_guard":  # GRPO-Guard needs the old policy's proposal means μ_old
            with torch.no_grad():
                every = torch.arange(b)
                old_means = torch.stack([self._step(self.model, traj, every, s)[1] for s in range(steps)], 1)
        first_gap = torch.zeros(b, steps)
        step_metrics: list[dict[str, torch.Tensor]] = []
        for k, rows in enumerate(perm.chunk(cfg.mini_batches)):
            self.opt.zero_grad(set_to_none=True)
            for s in range(steps):
                lp, mean, std, sqrt_dt = self._step(self.model, traj, rows, s)
                old = batch["old_log_probs"][rows, s]
                if k == 0 and self.bypass:
                    first_gap[rows, s] = (lp.detach() - old).abs()
                w = batch.get("rollout_is_weights")
                w = None if w is None else w[rows, s]
                if self.bypass and self.correction is not None:
                    w, m = step_correction(lp.detach().view(-1, 1), old.view(-1, 1), self.correction,
                                           prefix=BYPASS_METRIC_PREFIX)
                    step_metrics.append(m)
                a = adv[rows]
                if cfg.loss == "grpo_guard":
                    loss, lm = grpo_guard_loss(lp, old, a, mean, old_means[rows, s], std, sqrt_dt,
                                               None if w is None else w.view(-1),
                                               clip_range=cfg.clip_range, adv_clip_max=cfg.adv_clip_max)
                else:
                    loss, lm = flow_grpo_loss(lp.view(-1, 1), old.view(-1, 1), a,
                                              None if w is None else w.view(-1, 1),
                                              clip_range=cfg.clip_range, adv_clip_max=cfg.adv_clip_max)
                if cfg.kl_coef > 0:
                    loss = loss + cfg.kl_coef * sde_kl_loss(mean, self._reference_mean(traj, rows, s), std)
                (loss / steps).backward()
                if k == 0:
                    for key, val in lm.items():
                        metrics[f"{key}@first_mini_step"] = metrics.get(f"{key}@first_mini_step", 0.0) + float(val) / steps
            self.opt.step()
        times["update"] = time.perf_counter() - t0
        ts = traj.timesteps
        if self.bypass:  # measured on the first mini-batch, whose weights were still the rollout's
            first = perm.chunk(cfg.mini_batches)[0]
            gap, ts = first_gap[first], ts[first]
        if step_metrics:
            for key in step_metrics[0]:
                metrics[key] = sum(float(m[key]) for m in step_metrics) / len(step_metrics)
        return IterationLog(float(rewards.mean()), times, metrics, gap, ts)

    @torch.no_grad()
    def _reference_mean(self, traj: Trajectory, rows: torch.Tensor, s: int) -> torch.Tensor:
        if self.cfg.lora_rank > 0:
            with self.model.disable_adapter():
                return self._step(self.model, traj, rows, s)[1]
        return self._step(self.reference, traj, rows, s)[1]

