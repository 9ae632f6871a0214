"""Relative gradient error of naive PPO and decoupled IS on the enumerable toy policy.

At θ = π_old, with μ = π_old + N(0, mismatch²) logit noise, prints over ``--seeds`` seeds the
median and max of ‖g − E_π_old[A∇log π_old]‖ / ‖E_π_old[A∇log π_old]‖ (docs/validation.md):

    python benchmarks/bench_toy_bias.py
    python benchmarks/bench_toy_bias.py --seeds 10 --mismatch 0.5
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import math

import torch

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the enumerable toy lives with its tests
from toy import (enumerate_sequences, exact_policy_gradient, perturb, random_logits,
                                    scaled_advantages, sequence_log_probs, token_log_probs)
from rollout_correction import Aggregation, ClipRange, PolicyLoss


def bias_table(seeds: int = 5, mismatch: float = 0.3) -> None:
    """Print ‖g − g_on-policy‖ / ‖g_on-policy‖ for naive PPO and decoupled IS on the toy."""
    torch.set_num_threads(1)
    space = enumerate_sequences(vocab_size=3, horizon=3)
    configs = {
        "naive PPO (π_old as behaviour)": None,
        "decoupled token IS (untruncated)": RolloutCorrectionConfig(rollout_is="token",
                                                                    rollout_is_threshold=math.inf),
        "decoupled sequence IS (untruncated)": RolloutCorrectionConfig(rollout_is="sequence",
                                                                       rollout_is_threshold=math.inf),
    }
    errors: dict[str, list[float]] = {name: [] for name in configs}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        old = random_logits(space, 1.0, gen)
        mu = perturb(old, mismatch, gen)
        reward = torch.randn(space.batch_size, generator=gen, dtype=torch.float64)
        old_seq = sequence_log_probs(old, space)
        adv = reward - (old_seq.exp() * reward).sum()
        exact = exact_policy_gradient(old, space, adv)
        for name, cfg in configs.items():
            theta = old.clone().requires_grad_(True)
            loss, _ = compute_policy_loss(
                token_log_probs(theta, space), token_log_probs(old, space),
                scaled_advantages(adv, sequence_log_probs(mu, space), space), space.mask, config=cfg,
                rollout_log_prob=None if cfg is None else token_log_probs(mu, space),
                loss=PolicyLoss(
                    clip=ClipRange(low=1e6, high=1e6, dual=1e9),
                    aggregation=Aggregation("seq-mean-token-sum")))
            (grad,) = torch.autograd.grad(-loss, theta)
            errors[name].append(float((grad - exact).norm() / exact.norm()))
    print(f"V=3, T=3 (B={space.batch_size}), μ = π_old + N(0, {mismatch}²) logits, {seeds} seeds; "
          "relative gradient error at θ = π_old:")
    for name, errs in errors.items():
        errs.sort()
        print(f"  {name:<38} median {errs[len(errs) // 2]:.2e}   max {errs[-1]:.2e}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--mismatch", type=float, default=0.3, help="std of the logit noise of μ")
    args = parser.parse_args()
    bias_table(args.seeds, args.mismatch)
