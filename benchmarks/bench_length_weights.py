"""Sequence vs length-normalised (geometric) IS weights as responses grow long.

Each row has L tokens whose log-ratio log ρ_t = log π_train − log π_rollout is drawn from
N(−σ²/2, σ²) — E[ρ_t] = 1, a per-token mismatch KL of σ²/2 — and the library computes the weights
of ``rollout_is="sequence"`` and ``rollout_is="geometric"`` (both truncated at C = 2). Printed per
length: the mean truncated weight the loss would use, the share of rows whose raw product weight
is below 0.1, and the Kish ESS of the raw row weights, (Σw)² / (n·Σw²), from the library's
pre-truncation statistics and from ``diagnose``'s profile (which also gives its recommendation).

    python benchmarks/bench_length_weights.py              # σ = 0.05 (KL 1.25e-3 per token)
    python benchmarks/bench_length_weights.py --sigma 0.02
"""

from __future__ import annotations

import argparse

import torch

from rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from rollout_correction.diagnose import diagnose_tensors


def batch(length: int, rows: int, sigma: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rollout = -0.2 - torch.rand(rows, length, generator=gen)
    lr = -0.5 * sigma ** 2 + sigma * torch.randn(rows, length, generator=gen)
    return rollout + lr, rollout, torch.ones(rows, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sigma", type=float, default=0.05)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--lengths", default="100,1000,4000,8000")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"σ = {args.sigma} (per-token KL ≈ {args.sigma ** 2 / 2:.2e}), {args.rows} rows per length\n")
    print("| tokens | sequence: mean weight (C=2) | rows with ∏ρ < 0.1 | sequence ESS | geometric: mean weight (C=2) "
          "| geometric ESS | diagnose recommends |")
    print("|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        old, rollout, mask = batch(length, args.rows, args.sigma, seed=length)
        row = [str(length)]
        for level in ("sequence", "geometric"):
            cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=2.0, metrics=["default", "detail"])
            m = compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats()
            row.append(f"{m['rollout_corr/rollout_is_mean']:.3f}")
            if level == "sequence":
                row.append(f"{m['rollout_corr/rollout_is_seq_collapsed_fraction']:.2f}")
            row.append(f"{m['rollout_corr/rollout_is_seq_raw_ess']:.3f}")
        rec = diagnose_tensors(old, rollout, mask, presets=[]).recommendation
        row.append(f"`{rec.preset}` ({rec.case})")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
