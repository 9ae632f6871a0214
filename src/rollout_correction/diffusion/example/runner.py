"""The example end to end: pretrain once, train every variant for every seed, write the report."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from rollout_correction.diffusion.example.config import RUNS, ExampleConfig
from rollout_correction.diffusion.example.report import (mean_curves, print_table, summarize, tail_mean, verdict,
                                                         write_plots, write_report)
from rollout_correction.diffusion.example.trainer import evaluate, run_variant
from rollout_correction.diffusion.toy import PRECISIONS, RingTarget, VelocityMLP, pretrain_flow_matching

__all__ = ["run_example"]


def run_example(cfg: ExampleConfig, *, verbose: bool = True) -> dict[str, Any]:
    """Pretrain once, train every variant for every seed, write the report; returns the summary."""
    unknown = [r for r in cfg.runs if r not in RUNS]
    if unknown:
        raise ValueError(f"unknown run(s) {unknown}; choose from {list(RUNS)}")
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.iters < 1 or cfg.window < 1 or cfg.window_max_start + cfg.window > cfg.num_steps:
        raise ValueError(
            "need iters >= 1 and an SDE window that fits: window_max_start + window <= num_steps"
        )
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    target = RingTarget()
    torch.manual_seed(cfg.pretrain_seed)
    base = VelocityMLP()
    pre_losses = pretrain_flow_matching(base, target, cfg.pretrain_steps, seed=cfg.pretrain_seed)
    pretrained = {k: v.detach().clone() for k, v in base.state_dict().items()}
    histories: dict[str, list[dict]] = {}
    for name in cfg.runs:
        histories[name] = []
        for seed in cfg.seeds:
            h = run_variant(name, pretrained, target, cfg, seed)
            histories[name].append(h)
            if verbose:
                print(
                    f"[{name} seed {seed}] eval reward {h['eval'][-1]['reward']:.3f}  "
                    f"gap {statistics.fmean(h['gap']):.4f}  "
                    f"rejected {100 * statistics.fmean(h['rejected']):.2f}%",
                    flush=True,
                )
    summary = summarize(histories, cfg)
    plots = write_plots(histories, summary, out)
    wall = time.perf_counter() - t_start
    write_report(summary, cfg, plots, out, wall)
    cfg_dict = asdict(cfg)
    cfg_dict["seeds"] = list(cfg.seeds)
    cfg_dict["runs"] = list(cfg.runs)
    payload = {
        "config": cfg_dict,
        "pretrain_final_loss": tail_mean(pre_losses),
        "pretrained_eval": evaluate(base, target, cfg, 0),
        "pretrained_eval_engine_precision": evaluate(base, target, cfg, 0, cfg.precision),
        "variants": summary,
        "verdict": verdict(summary),
        "curves": mean_curves(histories),
        "wall_seconds": wall,
    }
    (out / "summary.json").write_text(json.dumps(payload, indent=2, allow_nan=False))
    if verbose:
        print_table(summary)
        print(f"report: {out / 'report.md'}")
    return payload
