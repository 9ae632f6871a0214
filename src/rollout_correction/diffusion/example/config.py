"""The variants the toy FlowGRPO example compares, and its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["QUICKSTART_CORRECTION", "Variant", "RUNS", "ExampleConfig"]

#: The quickstart configuration of docs/diffusion.md,
#: used by the corrected variants (bypass_mode is set per variant).
QUICKSTART_CORRECTION = {
    "rollout_is": "sequence",
    "rollout_is_threshold": 2.0,
    "rollout_rs": "seq_mean_k1",
    "rollout_rs_threshold": "0.5_2.0",
}


@dataclass(frozen=True)
class Variant:
    description: str
    bypass: bool
    correction: Optional[dict] = None
    fp32_rollout: bool = False


RUNS: dict[str, Variant] = {
    "fp32_reference": Variant("fp32 rollout engine (no gap), recompute, no correction", False, None, True),
    "naive": Variant("low-precision rollout, fp32 recompute of π_old, no correction", False),
    "decoupled_is_rs": Variant(
        "recompute + IS×RS weights (seq IS 2.0, seq_mean_k1 0.5_2.0)",
        False,
        dict(QUICKSTART_CORRECTION, bypass_mode=False),
    ),
    "bypass": Variant("old := rollout log-probs, no rejection", True),
    "bypass_rs": Variant(
        "old := rollout + per-step RS (quickstart configuration)",
        True,
        dict(QUICKSTART_CORRECTION, bypass_mode=True),
    ),
}


@dataclass
class ExampleConfig:
    precision: str = "fp8"
    num_steps: int = 10
    window: int = 2
    window_max_start: int = 8
    eta: float = 0.3
    iters: int = 300
    groups: int = 8
    group_size: int = 16
    lr: float = 3e-4
    clip_range: float = 0.2
    adv_clip_max: float = 5.0
    denominator: str = "all"
    pretrain_steps: int = 3000
    pretrain_seed: int = 1234
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_samples: int = 4096
    eval_every: int = 50
    runs: tuple[str, ...] = tuple(RUNS)
    out: str = "runs/diffusion_toy"

    @classmethod
    def quick(cls, **kw: Any) -> "ExampleConfig":
        base = dict(iters=30, pretrain_steps=800, seeds=(0,), eval_samples=1024, eval_every=15, groups=4)
        base.update(kw)
        return cls(**base)
