"""One training run of a variant: rollout engine → old log-probs → correction → group advantages
over the trajectories rejection keeps → FlowGRPO loss over the SDE window → Adam step."""

from __future__ import annotations

import time
from typing import Any

import torch

from rollout_correction import RolloutCorrectionConfig, metrics_to_floats
from rollout_correction.diffusion.correction import apply_bypass_mode, apply_rollout_correction, step_correction
from rollout_correction.diffusion.example.config import RUNS, ExampleConfig
from rollout_correction.diffusion.loss import flow_grpo_loss
from rollout_correction.diffusion.toy import (RingTarget, RolloutEngine, VelocityMLP, group_advantages,
                                              window_log_probs)

__all__ = ["evaluate", "run_variant"]


@torch.no_grad()
def evaluate(
    model: VelocityMLP, target: RingTarget, cfg: ExampleConfig, seed: int, precision: str = "fp32"
) -> dict[str, float]:
    """Reward and in-mode rate of the weights sampled at ``precision`` on fixed noise.

    With fp32 this is the model as trained; with the engine's precision it is what the rollout
    engine would serve from the same weights.
    """
    engine = RolloutEngine(precision)
    engine.load_weights(model)
    g = torch.Generator().manual_seed(10_000 + seed)
    traj = engine.sample(cfg.eval_samples, cfg.num_steps, 0, cfg.window, cfg.eta, g)
    return {
        "reward": float(target.reward(traj.final).mean()),
        "in_mode": float(target.in_any_mode(traj.final).mean()),
    }


def run_variant(
    name: str, pretrained: dict[str, torch.Tensor], target: RingTarget, cfg: ExampleConfig, seed: int
) -> dict[str, Any]:
    """Train one variant from the pretrained weights; returns its per-iteration history."""
    variant = RUNS[name]
    torch.manual_seed(seed)
    model = VelocityMLP()
    model.load_state_dict(pretrained)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    engine = RolloutEngine("fp32" if variant.fp32_rollout else cfg.precision)
    corr_cfg = RolloutCorrectionConfig.from_dict(variant.correction) if variant.correction else None
    g = torch.Generator().manual_seed(seed)
    batch_size = cfg.groups * cfg.group_size
    hist: dict[str, list] = {
        k: []
        for k in (
            "reward",
            "in_mode",
            "loss",
            "clipfrac",
            "rejected",
            "gap",
            "gap_per_step",
            "t_iter",
            "t_recompute",
            "eval",
        )
    }
    for it in range(cfg.iters):
        t0 = time.perf_counter()
        # ---- rollout engine: sample with the (low-precision) copy of the current weights
        engine.load_weights(model)
        start = int(torch.randint(0, cfg.window_max_start + 1, (1,), generator=g))
        traj = engine.sample(batch_size, cfg.num_steps, start, cfg.window, cfg.eta, g)
        rewards = target.reward(traj.final)
        batch: dict[str, torch.Tensor] = {"rollout_log_probs": traj.rollout_log_probs}

        # ---- old log-probs: fp32 recompute (decoupled) or the rollout ones (bypass)
        t1 = time.perf_counter()
        if variant.bypass:
            apply_bypass_mode(batch)
        else:
            with torch.no_grad():
                batch["old_log_probs"] = window_log_probs(model, traj, cfg.eta)
        t_recompute = time.perf_counter() - t1
        old = batch["old_log_probs"]

        weights = None
        metrics: dict[str, torch.Tensor] = {}
        if corr_cfg is not None and not variant.bypass:
            weights, metrics = apply_rollout_correction(old, traj.rollout_log_probs, corr_cfg)

        # ---- current log-probs per SDE step; bypass corrects each step against the rollout
        lps = [window_log_probs(model, traj, cfg.eta, [s]) for s in range(cfg.window)]  # (B, 1), with grad
        step_w: list[torch.Tensor | None] = [None] * cfg.window
        if variant.bypass and corr_cfg is not None:
            for s in range(cfg.window):
                step_w[s], step_m = step_correction(lps[s], traj.rollout_log_probs[:, s : s + 1], corr_cfg,
                                                    step_index=s)
                metrics.update(step_m)
        elif weights is not None:
            step_w = [weights[:, s : s + 1] for s in range(cfg.window)]
        # ---- group advantages over the trajectories rejection left something of
        keep = None if step_w[0] is None else (torch.cat(step_w, dim=1) > 0).any(dim=1)
        adv = group_advantages(rewards, cfg.group_size, keep=keep)

        # ---- one optimizer step over the window
        opt.zero_grad(set_to_none=True)
        loss_sum, clip_sum, kept = 0.0, 0.0, []
        gaps = []
        for s in range(cfg.window):
            lp, w = lps[s], step_w[s]
            ro = traj.rollout_log_probs[:, s : s + 1]
            loss, lm = flow_grpo_loss(
                lp,
                old[:, s : s + 1],
                adv,
                w,
                clip_range=cfg.clip_range,
                adv_clip_max=cfg.adv_clip_max,
                denominator=cfg.denominator,
            )
            (loss / cfg.window).backward()
            loss_sum += float(loss.detach()) / cfg.window
            clip_sum += float(lm["actor/pg_clipfrac"]) / cfg.window
            kept.append(float(lm["actor/kept_fraction"]))
            # the engine gap of this step: fp32 log π (θ unchanged so far) vs the engine's log-prob
            gaps.append(float((lp.detach() - ro).abs().mean()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_iter = time.perf_counter() - t0

        hist["reward"].append(float(rewards.mean()))
        hist["in_mode"].append(float(target.in_any_mode(traj.final).mean()))
        hist["loss"].append(loss_sum)
        hist["clipfrac"].append(clip_sum)
        hist["rejected"].append(1.0 - sum(kept) / len(kept))
        hist["gap"].append(sum(gaps) / len(gaps))
        hist["gap_per_step"].append({int(start + s): gaps[s] for s in range(cfg.window)})
        hist["t_iter"].append(t_iter)
        hist["t_recompute"].append(t_recompute)
        if metrics and it == cfg.iters - 1:
            hist["last_metrics"] = metrics_to_floats(metrics)
        if (it + 1) % cfg.eval_every == 0 or it == cfg.iters - 1:
            hist["eval"].append({"iter": it + 1, **evaluate(model, target, cfg, seed)})
    hist["eval_engine"] = evaluate(model, target, cfg, seed, cfg.precision)
    return hist
