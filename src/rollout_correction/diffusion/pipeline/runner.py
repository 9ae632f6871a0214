"""Runs of the pipeline demo: the training variants over seeds, and the mismatch scan.

* :func:`run_variant` trains one variant from the warm-started weights for one seed and logs, per
  iteration, the reward, the measured time of rollout / recompute / update, the per-timestep gap
  |log π_old − log π_rollout|, the clipped fraction at the first mini-step, and the correction's
  rejected fraction and ESS.
* :func:`mismatch_scan` samples one batch per (precision, noise level, CFG) setting with the
  warm-started weights and measures the gap alone (no training): the stress axes.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from .engine import RolloutEngine
from .model import ModelConfig, PromptBank, build_transformer, reward, warm_start
from .trainer import QUICKSTART, VARIANTS, TrainConfig, Trainer

__all__ = ["DemoConfig", "prepare", "run_variant", "mismatch_scan", "gap_statistics"]

LN2 = math.log(2.0)


@dataclass
class DemoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: str = "bf16"
    all_low_precision: bool = False
    iters: int = 12
    warm_start_steps: int = 150
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    runs: tuple[str, ...] = tuple(VARIANTS)
    window_seed: int = 42
    eval_samples: int = 64
    scan_precisions: tuple[str, ...] = ("bf16", "fp8")
    scan_noise_levels: tuple[float, ...] = (0.3, 0.7, 1.2)
    scan_cfg_scales: tuple[float, ...] = (1.0, 4.5)
    scan_batches: int = 2
    model_seed: int = 0
    out: str = "diffusion_pipeline_demo"

    @classmethod
    def quick(cls, **kw: Any) -> "DemoConfig":
        base = dict(iters=2, warm_start_steps=8, seeds=(0,), eval_samples=16,
                    train=TrainConfig(prompts_per_batch=2, group_size=4),
                    scan_precisions=("bf16",), scan_noise_levels=(0.7,), scan_cfg_scales=(1.0,), scan_batches=1)
        base.update(kw)
        return cls(**base)


def prepare(cfg: DemoConfig, cache_dir: Optional[str] = None) -> tuple[torch.nn.Module, PromptBank, list[float]]:
    """The warm-started fp32 transformer every variant starts from, its prompts, the warm-start losses.

    With ``cache_dir`` the warm-started weights are saved there (keyed by the model config, seed and
    number of steps) and loaded by later runs instead of being trained again.
    """
    bank = PromptBank(cfg.model)
    model = build_transformer(cfg.model, cfg.model_seed)
    key = hashlib.sha1(repr((cfg.model, cfg.model_seed, cfg.warm_start_steps)).encode()).hexdigest()[:12]
    path = None if cache_dir is None else os.path.join(cache_dir, f"warm_start_{key}.pt")
    if path is not None and os.path.exists(path):
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["state"])
        return model, bank, saved["losses"]
    losses = warm_start(model, bank, cfg.warm_start_steps, seed=cfg.model_seed)
    if path is not None:
        os.makedirs(cache_dir, exist_ok=True)
        torch.save({"state": model.state_dict(), "losses": losses}, path)
    return model, bank, losses


def _prompts(cfg: DemoConfig, g: torch.Generator) -> torch.Tensor:
    t = cfg.train
    chosen = torch.randperm(cfg.model.num_prompts, generator=g)[: t.prompts_per_batch]
    return chosen.repeat_interleave(t.group_size)


def _sample(engine: RolloutEngine, cfg: DemoConfig, bank: PromptBank, prompt: torch.Tensor,
            g: torch.Generator, wg: torch.Generator, noise_level: Optional[float] = None,
            cfg_scale: Optional[float] = None):
    t = cfg.train
    return engine.sample(prompt, bank, num_steps=t.num_steps, shift=t.shift,
                         noise_level=t.noise_level if noise_level is None else noise_level,
                         sde_type=t.sde_type, window_size=t.window_size, window_range=t.window_range,
                         cfg_scale=t.cfg_scale if cfg_scale is None else cfg_scale,
                         generator=g, window_generator=wg)


@torch.no_grad()
def evaluate(model: torch.nn.Module, cfg: DemoConfig, bank: PromptBank) -> float:
    """Mean reward of deterministic (η = 0) fp32 samples on fixed noise and prompts."""
    engine = RolloutEngine("fp32")
    engine.load_weights(model)
    n = cfg.eval_samples
    prompt = torch.arange(n) % cfg.model.num_prompts
    g, wg = torch.Generator().manual_seed(10_000), torch.Generator().manual_seed(10_001)
    traj = _sample(engine, cfg, bank, prompt, g, wg, noise_level=0.0)
    return float(reward(traj.final, prompt, bank).mean())


def gap_statistics(gap: torch.Tensor, timesteps: torch.Tensor, clip_range: float) -> dict[str, Any]:
    """Per-timestep mean and max |Δ log π|, and the fraction of elements above the clip range."""
    out: dict[str, Any] = {"mean": float(gap.mean()), "max": float(gap.max()),
                           "frac_above_clip": float((gap > clip_range).float().mean()),
                           "frac_outside_rs_band": float((gap > LN2).float().mean()), "by_timestep": {}}
    for t in torch.unique(timesteps):
        sel = timesteps == t
        out["by_timestep"][f"{float(t):.4g}"] = {
            "mean": float(gap[sel].mean()), "max": float(gap[sel].max()),
            "frac_above_clip": float((gap[sel] > clip_range).float().mean()), "n": int(sel.sum())}
    return out


def run_variant(name: str, seed: int, cfg: DemoConfig, base_model: torch.nn.Module, bank: PromptBank,
                progress: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Train one variant for one seed from ``base_model``; returns its log (JSON-ready)."""
    precision, bypass, correction = VARIANTS[name]
    engine = RolloutEngine(precision or cfg.precision, all_low_precision=cfg.all_low_precision)
    trainer = Trainer(copy.deepcopy(base_model), bank, cfg.train, bypass=bypass, correction=correction, seed=seed)
    g = torch.Generator().manual_seed(seed)
    wg = torch.Generator().manual_seed(cfg.window_seed + seed)
    log: dict[str, Any] = {"variant": name, "seed": seed, "reward": [], "times": [], "metrics": [], "gap": []}
    t_start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(cfg.iters):
        t0 = time.perf_counter()
        engine.load_weights(trainer.model)
        prompt = _prompts(cfg, g)
        traj = _sample(engine, cfg, bank, prompt, g, wg)
        r = reward(traj.final, prompt, bank)
        t_roll = time.perf_counter() - t0
        it = trainer.update(traj, r, t_roll)
        log["reward"].append(it.reward)
        log["times"].append(it.times)
        log["metrics"].append(it.metrics)
        log["gap"].append(gap_statistics(it.gap, it.timesteps, cfg.train.clip_range))
        if progress is not None:
            progress()
    log["eval_reward"] = evaluate(trainer.model, cfg, bank)
    log["wall_s"] = time.perf_counter() - t_start
    log["cpu_s"] = time.process_time() - cpu_start  # CPU time of this process (all its threads)
    return log


@torch.no_grad()
def mismatch_scan(cfg: DemoConfig, base_model: torch.nn.Module, bank: PromptBank,
                  progress: Optional[Callable[[], None]] = None) -> list[dict[str, Any]]:
    """The gap at the warm-started weights for every (precision, noise level, CFG) setting.

    For each setting: rollout log-probs from the engine, old log-probs from the fp32 recompute,
    |Δ log π| by timestep, the fraction of steps beyond the clip range (= the clipped fraction at
    the first mini-step in bypass mode; 0 with a recompute), and the quickstart correction's
    rejected fraction and ESS in decoupled mode.
    """
    from rollout_correction.diffusion.correction import apply_rollout_correction

    rows = []
    for precision in cfg.scan_precisions:
        for eta in cfg.scan_noise_levels:
            for g_cfg in cfg.scan_cfg_scales:
                train = replace(cfg.train, noise_level=eta, cfg_scale=g_cfg)
                trainer = Trainer(base_model, bank, train, bypass=False, correction=None)
                engine = RolloutEngine(precision, all_low_precision=cfg.all_low_precision)
                engine.load_weights(base_model)
                gaps, tss, olds, ros = [], [], [], []
                for k in range(cfg.scan_batches):
                    g = torch.Generator().manual_seed(100 + k)
                    wg = torch.Generator().manual_seed(cfg.window_seed + 100 + k)
                    prompt = _prompts(cfg, g)
                    traj = _sample(engine, replace(cfg, train=train), bank, prompt, g, wg)
                    old = trainer.recompute(traj)
                    olds.append(old)
                    ros.append(traj.rollout_log_probs)
                    gaps.append((old - traj.rollout_log_probs).abs())
                    tss.append(traj.timesteps)
                old, ro = torch.cat(olds), torch.cat(ros)
                _, m = apply_rollout_correction(old, ro, QUICKSTART)
                row = {"precision": precision, "noise_level": eta, "cfg_scale": g_cfg,
                       "gap": gap_statistics(torch.cat(gaps), torch.cat(tss), cfg.train.clip_range),
                       "rejected_fraction": float(m["rollout_corr/rejected_fraction"]),
                       "ess": float(m["rollout_corr/rollout_is_eff_sample_size"]),
                       "is_max": float(m["rollout_corr/rollout_is_max"]),
                       "is_min": float(m["rollout_corr/rollout_is_min"])}
                rows.append(row)
                if progress is not None:
                    progress()
    return rows


def config_dict(cfg: DemoConfig) -> dict[str, Any]:
    return asdict(cfg)
