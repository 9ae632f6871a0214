"""``rollout-correction diffusion-demo`` (and ``python -m rollout_correction.diffusion.example``)."""

from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

from rollout_correction.console import ArgumentParser
from rollout_correction.diffusion.example.config import RUNS, ExampleConfig
from rollout_correction.diffusion.example.runner import run_example
from rollout_correction.diffusion.toy import PRECISIONS

__all__ = ["add_arguments", "config_from_args", "run", "main"]

_DESCRIPTION = "Toy FlowGRPO with a reduced-precision rollout engine: training with and without rollout correction."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ExampleConfig()
    parser.add_argument(
        "--quick", action="store_true", help="CI-sized run (1 seed, 30 iterations, short pretraining)"
    )
    parser.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default=None,
        help=f"rollout engine precision (default {d.precision})",
    )
    parser.add_argument("--iters", type=int, default=None, help=f"RL iterations (default {d.iters})")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2)")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=None, help="variants to train")
    parser.add_argument("--window", type=int, default=None, help=f"SDE window size (default {d.window})")
    parser.add_argument(
        "--window-max-start",
        type=int,
        default=None,
        help=f"the window starts at a random step in [0, this] (default {d.window_max_start})",
    )
    parser.add_argument(
        "--num-steps", type=int, default=None, help=f"denoising steps (default {d.num_steps})"
    )
    parser.add_argument("--eta", type=float, default=None, help=f"SDE noise level η (default {d.eta})")
    parser.add_argument("--lr", type=float, default=None, help=f"learning rate (default {d.lr})")
    parser.add_argument("--clip-range", type=float, default=None, help=f"PPO clip ε (default {d.clip_range})")
    parser.add_argument(
        "--denominator",
        choices=["all", "kept"],
        default=None,
        help="loss denominator: every element (FlowGRPO) or kept elements only",
    )
    parser.add_argument(
        "--pretrain-seed",
        type=int,
        default=None,
        help=f"seed of the pretrained model every variant starts from (default {d.pretrain_seed})",
    )
    parser.add_argument("--out", default=None, help=f"output directory (default {d.out})")


def config_from_args(args: argparse.Namespace) -> ExampleConfig:
    kw: dict[str, Any] = {}
    for key in (
        "precision",
        "iters",
        "window",
        "window_max_start",
        "num_steps",
        "eta",
        "pretrain_seed",
        "lr",
        "clip_range",
        "denominator",
        "out",
    ):
        v = getattr(args, key, None)
        if v is not None:
            kw[key] = v
    if args.seeds is not None:
        kw["seeds"] = tuple(args.seeds)
    if args.runs is not None:
        kw["runs"] = tuple(args.runs)
    return ExampleConfig.quick(**kw) if args.quick else ExampleConfig(**kw)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    run_example(config_from_args(args))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(
        prog="python -m rollout_correction.diffusion.example", description=_DESCRIPTION
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
