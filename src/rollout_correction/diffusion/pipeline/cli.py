"""``rollout-correction diffusion-demo``: FlowGRPO on a tiny diffusers transformer.

``rollout-correction diffusion-demo --toy [toy options]`` runs the 2-D toy instead
(``python -m rollout_correction.diffusion.example``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from rollout_correction.console import ArgumentParser, ProgressLines, is_terminal, report_folder

__all__ = ["add_arguments", "config_from_args", "run", "main"]

_DESCRIPTION = ("FlowGRPO on a tiny diffusers SD3 transformer with a bf16 / fp8 rollout engine and an fp32 trainer: "
                "training variants with and without rollout correction, and the mismatch by timestep.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .runner import DemoConfig
    from .trainer import VARIANTS, TrainConfig

    d, t = DemoConfig(), TrainConfig()
    a = parser.add_argument
    a("--quick", action="store_true", help="CI-sized run (1 seed, 3 iterations, short warm start, one scan setting)")
    a("--precision", choices=["bf16", "fp8"], default=None, help=f"rollout engine precision (default {d.precision})")
    a("--all-low-precision", action="store_true",
      help="run the engine's scheduler step, latents and log-probs in bf16 too (the toy's setting)")
    a("--noise-level", type=float, default=None, help=f"SDE noise level η (default {t.noise_level})")
    a("--cfg-scale", type=float, default=None, help=f"true-CFG scale, 1 = off (default {t.cfg_scale})")
    a("--sde-type", choices=["sde", "cps", "dance_sde"], default=None, help=f"(default {t.sde_type})")
    a("--loss", choices=["flow_grpo", "grpo_guard"], default=None, help=f"(default {t.loss})")
    a("--adv-std", choices=["global", "group"], default=None, help=f"advantage normaliser (default {t.adv_std})")
    a("--kl-coef", type=float, default=None, help="KL to the reference policy (default 0 = off)")
    a("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank (peft) instead of all weights")
    a("--lr", type=float, default=None, help=f"learning rate (default {t.lr})")
    a("--clip-range", type=float, default=None, help=f"PPO clip ε (default {t.clip_range})")
    a("--sde-window-size", type=int, default=None, help=f"(default {t.window_size})")
    a("--sde-window-range", type=int, nargs=2, default=None, help=f"(default {t.window_range[0]} {t.window_range[1]})")
    a("--sde-window-seed", type=int, default=None, help=f"(default {d.window_seed})")
    a("--iters", type=int, default=None, help=f"RL iterations per run (default {d.iters})")
    a("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2 3 4)")
    a("--runs", nargs="+", choices=list(VARIANTS), default=None, help="variants to train (default all)")
    a("--no-scan", action="store_true", help="skip the precision × noise level × CFG mismatch scan")
    a("--scan-only", action="store_true", help="only the mismatch scan (no training)")
    a("--threads", type=int, default=1, help="torch threads (default 1)")
    a("--out", default=None, help=f"output directory (default: a new {d.out}/<date>-<time>/, with {d.out}/latest "
                                  "pointing at the newest; the warm start is cached in that folder); refused when "
                                  "it holds another report, unless --force")
    a("--force", action="store_true", help="write into an --out that holds another report")
    a("--merge", nargs="+", default=None, metavar="DIR",
      help="merge the summary.json of runs made in separate processes into --out (no training)")
    a("--toy", nargs=argparse.REMAINDER, default=None,
      help="run the 2-D toy instead; the rest of the line goes to the toy (see --toy --help)")


def config_from_args(args: argparse.Namespace):
    from .runner import DemoConfig

    kw: dict[str, Any] = {}
    for key in ("precision", "iters", "out"):
        if getattr(args, key, None) is not None:
            kw[key] = getattr(args, key)
    if args.all_low_precision:
        kw["all_low_precision"] = True
    if args.seeds is not None:
        kw["seeds"] = tuple(args.seeds)
    if args.runs is not None:
        kw["runs"] = tuple(args.runs)
    if args.sde_window_seed is not None:
        kw["window_seed"] = args.sde_window_seed
    cfg = DemoConfig.quick(**kw) if args.quick else DemoConfig(**kw)
    tkw: dict[str, Any] = {}
    for key, name in (("noise_level", "noise_level"), ("cfg_scale", "cfg_scale"), ("sde_type", "sde_type"),
                      ("loss", "loss"), ("adv_std", "adv_std"), ("kl_coef", "kl_coef"), ("lora_rank", "lora_rank"),
                      ("lr", "lr"), ("clip_range", "clip_range"), ("sde_window_size", "window_size")):
        if getattr(args, key, None) is not None:
            tkw[name] = getattr(args, key)
    if args.sde_window_range is not None:
        tkw["window_range"] = tuple(args.sde_window_range)
    if tkw:
        cfg = replace(cfg, train=replace(cfg.train, **tkw))
    if args.scan_only:
        cfg = replace(cfg, runs=())
    if args.no_scan:
        cfg = replace(cfg, scan_precisions=())
    return cfg


_REPORT_MARKERS = ("summary.json", "report.md")


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal; without one (a log), nothing: each finished unit prints its line."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return None, lambda: None
    if not is_terminal(sys.stderr):
        return None, lambda: None
    bar = tqdm(total=total, desc=desc, leave=False, file=sys.stderr)
    return bar, lambda: bar.update(1)


def run_demo(cfg, command: str, cache_dir: Optional[str] = None) -> dict[str, Any]:
    """Warm start (cached in ``cache_dir``, default ``cfg.out``), the mismatch scan, every variant ×
    seed, then the report in ``cfg.out``; one line on stderr per finished unit."""
    from .report import provenance, summarise, write_report
    from .runner import config_dict, mismatch_scan, prepare, run_variant

    t0 = time.perf_counter()
    model, bank, losses = prepare(cfg, cache_dir=cache_dir or cfg.out)
    t_warm = time.perf_counter() - t0
    print(f"warm start: {cfg.warm_start_steps} flow-matching steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
          f"({t_warm:.0f} s)", file=sys.stderr)
    scan: list[dict[str, Any]] = []
    n_scan = len(cfg.scan_precisions) * len(cfg.scan_noise_levels) * len(cfg.scan_cfg_scales)
    log = ProgressLines(int(n_scan > 0) + len(cfg.runs) * len(cfg.seeds), stream=sys.stderr)
    if n_scan:
        bar, tick = _progress(n_scan, "mismatch scan")
        scan = mismatch_scan(cfg, model, bank, progress=tick)
        if bar is not None:
            bar.close()
        log.finished(f"mismatch scan: {n_scan} settings")
    logs = []
    for name in cfg.runs:
        for seed in cfg.seeds:
            bar, tick = _progress(cfg.iters, f"{name} seed {seed}")
            logs.append(run_variant(name, seed, cfg, model, bank, progress=tick))
            if bar is not None:
                bar.close()
            log.finished(f"{name} seed {seed}: final reward "
                         f"{sum(logs[-1]['reward'][-5:]) / len(logs[-1]['reward'][-5:]):+.4f}, "
                         f"eval {logs[-1]['eval_reward']:+.4f}, {logs[-1]['wall_s']:.0f} s")
    result = {"provenance": provenance(command), "config": config_dict(cfg), "warm_start_s": t_warm,
              "warm_start_loss": [losses[0], losses[-1]], "scan": scan,
              "summary": summarise(logs, cfg.train.clip_range) if logs else {},
              "runs": [{k: v for k, v in log.items() if k != "gap"} | {"gap_mean": [g["mean"] for g in log["gap"]]}
                       for log in logs]}
    paths = write_report(cfg.out, result)
    with open(paths[1]) as f:
        print(f.read())
    print("wrote " + ", ".join(paths), file=sys.stderr)
    return result


def run(args: argparse.Namespace) -> int:
    if args.toy is not None:
        from rollout_correction.diffusion.example.cli import main as toy_main

        return toy_main(args.toy)
    if args.merge:
        import json

        from .report import merge_results, write_report

        parts = []
        for d in args.merge:
            with open(os.path.join(d, "summary.json")) as f:
                parts.append(json.load(f))
        out = report_folder(args.out, _default_out(), _REPORT_MARKERS, force=args.force)
        paths = write_report(str(out), merge_results(parts))
        print("wrote " + ", ".join(paths), file=sys.stderr)
        return 0
    torch.set_num_threads(max(1, args.threads))
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # this process only: the bf16 cast notice of every engine sync
    cfg = config_from_args(args)
    out = report_folder(args.out, cfg.out, _REPORT_MARKERS, force=args.force)
    cache = cfg.out if args.out is None else str(out)  # the default folder keeps one warm-start cache
    print(f"report folder: {out}", file=sys.stderr)
    command = "rollout-correction diffusion-demo " + " ".join(shlex.quote(a) for a in _argv_tail())
    run_demo(replace(cfg, out=str(out)), command.strip(), cache_dir=cache)
    return 0


def _default_out() -> str:
    from .runner import DemoConfig

    return DemoConfig().out


def _argv_tail() -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index("diffusion-demo") + 1:] if "diffusion-demo" in argv else argv


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog="rollout-correction diffusion-demo", description=_DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
