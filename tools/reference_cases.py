"""Fixed reference cases of ``compute_rollout_correction``: every preset and a set of configurations
beyond them, each on eight small batches holding odd values (NaN, ±inf, engine sentinels, |log ρ|
beyond ±20, empty rows), in float32 and bfloat16.

``python tools/reference_cases.py FILE`` records, for each case, a digest of its weights, its mask
and every metric's float64 bits (with the names of the metrics digested) into FILE, with the commit,
torch version and CPU capability it ran on; ``tests/test_metric_families.py`` recomputes the cases
with every metric family selected and compares bit for bit. The first recording (432 cases) was made
at commit a50a7b9, before the families existed, and selecting every family gave that commit's numbers
(commit da626b9). ``tests/reference_cases.json`` was recorded again at c701005, which adds the
presets ``prime_rl_ipo`` / ``prime_rl_icepop`` and clamps the effective sample sizes to at most 1 (16
cases of a50a7b9 had an ESS of 1 + 2e-8 from rounding; with that clamp lifted, c701005 reproduces all
432 of a50a7b9's digests).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from rollout_correction import RolloutCorrectionConfig, Segments, compute_rollout_correction

__all__ = ["CASES", "case_batch", "run_case", "digest", "record"]

ODD_VALUES = [math.nan, math.inf, -math.inf, -5000.0, -1000.0, -999.5, 1e31, -1e31, 3.0, -30.0]
#: Configurations beyond the presets (keys over :class:`RolloutCorrectionConfig` defaults).
EXTRA = {
    "expect zero": {"expect_zero_atol": 0.5, "expect_zero_action": "warn"},
    "veto both sides": {"rollout_is": "token", "rollout_token_veto_threshold": 0.2,
                        "rollout_token_veto_threshold_high": 5.0},
    "probability gates": {"rollout_rs": "token_tv,seq_max_binary_kl,seq_mean_kpop",
                          "rollout_rs_threshold": "0.1,0.05,0.02"},
    "dp bands": {"rollout_rs": "token_dp,seq_mean_dp", "rollout_rs_threshold": "-0.3_0.3,-0.05_0.05"},
    "segments": {"rollout_is": "segment_geometric", "rollout_rs": "segment_sum_k1,segment_max_k3",
                 "rollout_rs_threshold": "0.5_2.0,0.1"},
    "segment IS": {"rollout_is": "segment", "rollout_is_batch_normalize": True},
    "prefix min": {"rollout_is": "prefix_min", "rollout_is_threshold": 1.5},
    "k3 chain + clip": {"rollout_is": "geometric", "rollout_is_threshold": "0.8_1.2", "rollout_is_mode": "clip",
                        "rollout_rs": "token_k3,seq_max_k2,seq_logprob_error", "rollout_rs_threshold": "0.5,2.0,1.5"},
    "alignment": {"rollout_is": "token", "check_alignment": True},
    "no floor": {"rollout_is": "sequence", "log_prob_floor": None},
}
SEEDS = range(8)
#: (name, config keys, whether advantages are passed): every preset, then the configurations above,
#: with the mismatch metrics on (the largest set of metrics a call reported before the families).
CASES: list[tuple[str, dict, bool]] = (
    [(name, {"preset": name}, False) for name in RolloutCorrectionConfig.preset_names()]
    + [(name, keys, False) for name, keys in EXTRA.items()]
    + [("advantages", {"rollout_is": "token", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}, True)])


def config_of(keys: dict, **extra) -> RolloutCorrectionConfig:
    """The case's config. Without the log-prob ceiling, which the recorded commit did not have: the batches
    hold log-probs > 0 among their odd values, and the recording is what the families must reproduce."""
    keys = dict(keys)
    cfg = RolloutCorrectionConfig.from_preset(keys.pop("preset")) if "preset" in keys else RolloutCorrectionConfig()
    return cfg.replace(**keys, mismatch_metrics=True, **{"log_prob_ceiling": None, **extra})


def case_batch(seed: int):
    """(old, rollout, mask, segments, advantages) of seed ``seed``: a random small batch with odd values
    sprinkled over valid and masked positions of either input; float32 for even seeds, bfloat16 for odd."""
    g = torch.Generator().manual_seed(1000 + seed)
    B, T = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
    rollout = -torch.rand(B, T, generator=g) * 3
    old = rollout + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[int(torch.randint(0, B, (1,), generator=g))] = False  # an empty row
    odd = torch.tensor(ODD_VALUES)
    for x in (old, rollout):  # about one position in 40 of either input, valid or masked
        at = torch.rand(B, T, generator=g) < 1 / 40
        x[at] = odd[torch.randint(0, len(ODD_VALUES), (int(at.sum()),), generator=g)]
    ids = (torch.arange(T).expand(B, T) * 3 // T).contiguous()
    adv = torch.randn(B, generator=g)
    dtype = torch.float32 if seed % 2 == 0 else torch.bfloat16
    return old.to(dtype), rollout.to(dtype), mask, Segments(ids, 3), adv


def run_case(cfg: RolloutCorrectionConfig, seed: int, advantages: bool):
    old, roll, mask, segments, adv = case_batch(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compute_rollout_correction(old, roll, mask, config=cfg, segments=segments if cfg.uses_segments else None,
                                         advantages=adv if advantages else None)
        return out.weights, out.response_mask, out.metrics_as_floats()


def digest(weights, mask, metrics: dict[str, float], names=None) -> str:
    """sha256 of the weights' and the mask's bytes and of each metric's name and float64 bits (the
    metrics in ``names`` only, when given)."""
    h = hashlib.sha256()
    for t in (weights, mask):
        h.update(b"none" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes())
    for k in sorted(metrics if names is None else names):
        h.update(f"{k}={float(metrics[k]).hex()};".encode())
    return h.hexdigest()


def record(path: str) -> None:
    rows, names = [], {}
    for name, keys, adv in CASES:
        cfg = config_of(keys, metrics="all")  # every family: what the test recomputes
        for seed in SEEDS:
            weights, mask, metrics = run_case(cfg, seed, adv)
            names[name] = sorted(metrics)  # the names depend on the configuration only
            rows.append({"case": name, "seed": seed, "digest": digest(weights, mask, metrics)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    head = {"commit": commit, "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "command": "python tools/reference_cases.py " + path}
    lines = [json.dumps(head)[:-1] + ', "metrics": {']  # one line per configuration and per case
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in names.items()]
    lines[-1] = lines[-1][:-1]
    lines += ['}, "cases": [', ",\n".join("  " + json.dumps(r) for r in rows), "]}"]
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} cases recorded in {path}")


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(1)
    record(sys.argv[1])
