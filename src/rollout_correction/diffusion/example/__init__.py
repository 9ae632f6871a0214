"""Toy FlowGRPO with a reduced-precision rollout engine: training with and without rollout correction.

    rollout-correction diffusion-demo --quick                          # CI-sized, a few seconds
    python -m rollout_correction.diffusion.example --precision fp8    # full comparison

A small rectified-flow model on a 2-D ring of 8 modes is pretrained, then RL-trained (GRPO group
advantages, FlowGRPO clipped loss over a short SDE window) to put its samples on 3 rewarded modes.
Samples come from a rollout engine that holds the weights in reduced precision (``--precision``);
the trainer works in fp32. Each variant below trains from the same pretrained weights with the
same seeds:

  fp32_reference   rollout engine in fp32 (no gap), fp32 recompute, no correction
  naive            low-precision rollout, fp32 recompute of π_old, no correction
  decoupled_is_rs  low-precision rollout, fp32 recompute, IS × RS weights (apply_rollout_correction)
  bypass           low-precision rollout, old := rollout (no recompute), no rejection
  bypass_rs        the quickstart: bypass + rollout_is=sequence + seq_mean_k1 "0.5_2.0"
                   (per-step step_correction inside the loss)

Outputs in ``--out``: ``summary.json``, ``report.md``, ``reward.png``, ``gap_per_step.png``,
``mismatch.png``, and a table on the console.

Laid out like ``rollout_correction.demo``: ``config`` (variants and settings), ``trainer`` (one run),
``report`` (summary, verdict, plots, report), ``runner`` (everything end to end), ``cli``.
"""

from rollout_correction.diffusion.example.cli import add_arguments, config_from_args, main, run
from rollout_correction.diffusion.example.config import RUNS, ExampleConfig
from rollout_correction.diffusion.example.runner import run_example
from rollout_correction.diffusion.example.trainer import run_variant

__all__ = ["ExampleConfig", "RUNS", "run_variant", "run_example", "add_arguments", "config_from_args", "run",
           "main"]
