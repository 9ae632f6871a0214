"""Bias and variance of every correction method against the exact on-policy gradient.

On the enumerable toy (``tests/toy.py``: a tabular autoregressive policy, V = 3 tokens,
up to T = 4 steps with a stop token, every one of the 31 sequences one row), each method's loss is
run through the library exactly as a trainer would call it, with the rows' advantages scaled by
μ(y)·B so that the gradient of the batch loss is the method's *expected* gradient under the
rollout policy μ (docs/validation.md). Against the on-policy gradient g = E_πθ[A ∇log π_θ]:

* bias  = ‖E_μ[ĝ] − g‖ / ‖g‖
* std   = √(E_μ‖ĝ(y) − E_μ[ĝ]‖²) / ‖g‖, the spread of the one-sample estimate ĝ(y) (from the
  per-row gradients; the batch denominators of the full batch are kept)
* rmse  = √(bias² + std²/N), the relative error of a batch of N = 256 samples

Two settings, μ = π_old + N(0, 0.3²) logit noise (per-token KL ≈ 0.02, as in the demo):
at θ = π_old (the first minibatch of a PPO step) and after a step, θ = π_old + N(0, 0.2²).
Medians over seeds. Every preset runs with its default thresholds, tuned for LLM-scale data, with
the clip range ε = 0.2 and c = 3 (DPPO: divergence bound 0.2, ratio cap 3).

    python benchmarks/bench_methods_exact.py            # 5 seeds, ~1 min on one core
    python benchmarks/bench_methods_exact.py --seeds 2
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import math
import statistics
import time

import torch

from rollout_correction import RolloutCorrectionConfig, compute_policy_loss
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the enumerable toy lives with its tests
from toy import (enumerate_sequences, exact_policy_gradient, perturb, random_logits,
                                    scaled_advantages, sequence_log_probs, token_log_probs)
from rollout_correction import Aggregation, ClipRange, PolicyLoss

N_BATCH = 256

#: (label, preset or special) in table order; None = naive PPO (no correction).
METHODS = [
    ("naive PPO (π_old as behaviour)", None),
    ("sequence IS, untruncated (bypass REINFORCE)", "seq_is_untruncated"),
    ("decoupled token TIS", "decoupled_token_is"),
    ("decoupled sequence TIS", "decoupled_seq_is"),
    ("decoupled geometric TIS", "decoupled_geo_is"),
    ("decoupled token IcePop", "decoupled_token_icepop"),
    ("decoupled seq TIS + seq RS", "decoupled_seq_is_rs"),
    ("decoupled geometric RS", "decoupled_geo_rs"),
    ("decoupled mean-k3 RS", "decoupled_k3_rs"),
    ("bypass PPO-clip", "bypass_ppo_clip"),
    ("bypass REINFORCE, sequence TIS (pure IS)", "bypass_pg_is"),
    ("token TIS + OPSM", "decoupled_token_is_opsm"),
    ("token TIS + M2PO", "decoupled_token_is_m2po"),
    ("TOPR", "bypass_topr"),
    ("GSPO × geometric TIS", "decoupled_gspo_geo_is"),
    ("CISPO × token TIS", "decoupled_cispo_token_is"),
    ("DPPO-TV × token TIS", "decoupled_dppo_tv_token_is"),
    ("DPPO-KL × token TIS", "decoupled_dppo_kl_token_is"),
]


def config_for(name):
    if name is None:
        return None
    if name == "seq_is_untruncated":
        return RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=math.inf, bypass_mode=True,
                                       loss_type="reinforce")
    return RolloutCorrectionConfig.from_preset(name)


def gradients(cfg, space, theta, old, mu, adv, rows=None):
    """−∇_θ of the library loss (seq-mean-token-sum) with A(y)·μ(y)·B; ``rows`` keeps only those rows'
    advantages (token-sum then, so no denominator depends on which rows are kept)."""
    th = theta.clone().requires_grad_(True)
    scaled = scaled_advantages(adv, sequence_log_probs(mu, space), space)
    mode = "seq-mean-token-sum"
    if rows is not None:
        scaled = torch.where(rows.unsqueeze(-1), scaled, torch.zeros((), dtype=scaled.dtype))
        mode = "token-sum"
    nan = math.nan
    loss, _ = compute_policy_loss(
        token_log_probs(th, space, fill=nan), token_log_probs(old, space, fill=nan), scaled, space.mask,
        config=cfg, rollout_log_prob=None if cfg is None else token_log_probs(mu, space, fill=nan),
        loss=PolicyLoss(clip=ClipRange(low=0.2, high=0.2, dual=3.0), aggregation=Aggregation(mode)))
    (g,) = torch.autograd.grad(loss, th)
    return -g


def bias_and_std(cfg, space, theta, old, mu, adv):
    target = exact_policy_gradient(theta, space, adv)
    expected = gradients(cfg, space, theta, old, mu, adv)
    B = space.batch_size
    eye = torch.eye(B, dtype=torch.bool)
    per_row = torch.stack([gradients(cfg, space, theta, old, mu, adv, rows=eye[y]) for y in range(B)])
    total = per_row.sum(0)
    # Per-row shares of the expected gradient: the full batch divides by its own denominator.
    scale = float((expected * total).sum() / (total * total).sum()) if float(total.norm()) > 0 else 0.0
    contrib = per_row * scale
    mu_y = sequence_log_probs(mu, space).exp()
    second = float(((contrib ** 2).sum((1, 2)) / mu_y).sum())
    var = max(second - float((expected ** 2).sum()), 0.0)
    norm = float(target.norm())
    return float((expected - target).norm()) / norm, math.sqrt(var) / norm


def run(seeds: int, step: float, mismatch: float = 0.3):
    space = enumerate_sequences(vocab_size=3, horizon=4, stop_token=0)
    out = {label: {"at π_old": [], "after a step": []} for label, _ in METHODS}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        old = random_logits(space, 1.0, gen)
        mu = perturb(old, mismatch, gen)
        moved = perturb(old, step, gen)
        reward = torch.randn(space.batch_size, generator=gen, dtype=torch.float64)
        for setting, theta in (("at π_old", old), ("after a step", moved)):
            adv = reward - (sequence_log_probs(theta, space).exp() * reward).sum()
            for label, name in METHODS:
                out[label][setting].append(bias_and_std(config_for(name), space, theta, old, mu, adv))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--step", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = run(args.seeds, args.step)
    print(f"V=3, T≤4 with a stop token (B=31 sequences); μ = π_old + N(0, 0.3²) logits; θ after a step = "
          f"π_old + N(0, {args.step}²); medians over {args.seeds} seeds; rmse at N = {N_BATCH} samples\n")
    print("| method | preset | bias at π_old | std at π_old | rmse at π_old | bias after a step | "
          "std after a step | rmse after a step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, name in METHODS:
        cells = [label, "—" if name is None else f"`{name}`" if name != "seq_is_untruncated" else "(see text)"]
        for setting in ("at π_old", "after a step"):
            rows = out[label][setting]
            bias = statistics.median(b for b, _ in rows)
            std = statistics.median(s for _, s in rows)
            rmse = statistics.median(math.sqrt(b * b + s * s / N_BATCH) for b, s in rows)
            cells += [f"{bias:.3f}", f"{std:.2f}", f"{rmse:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
