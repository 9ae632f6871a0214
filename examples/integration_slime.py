"""slime: the custom TIS function, called the way slime's loss calls it.

In a slime run you change two flags (see docs/integrations.md)::

    --use-tis --custom-config-path mis.yaml \\
    --custom-tis-function-path rollout_correction.integrations.slime.tis_function

This script needs no slime install: it loads the function by that dotted path, feeds it a
slime-shaped micro-batch (per-sample 1-D log-probs and loss masks, a flat packed ``pg_loss``),
and reduces the returned metrics with slime's rule (per-sample mean over the loss mask, then the
mean over samples), printing what slime would log.

    python examples/integration_slime.py
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

# What --custom-config-path mis.yaml puts into slime's args (slime's own option names).
MIS_YAML = dict(
    use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None, tis_upper_bound=2.0,
    tis_batch_normalize=True, use_rs=True, rs_level="geometric", rs_lower_bound=0.9, rs_upper_bound=1.1,
    rs_veto_threshold=1e-4,
)


def main() -> None:
    torch.manual_seed(0)
    module, attr = "rollout_correction.integrations.slime.tis_function".rsplit(".", 1)
    tis_function = getattr(importlib.import_module(module), attr)  # what --custom-tis-function-path does

    lengths = [5, 8, 3, 6]
    rollout = [-torch.rand(n) - 0.1 for n in lengths]
    train = [(r + 0.15 * torch.randn(n)).clamp(max=0.0) for r, n in zip(rollout, lengths)]  # a bf16-vs-fp32 sized gap
    train[3] = train[3].clone()
    train[3][2] = rollout[3][2] - 12.0  # one catastrophic token: ratio e⁻¹² < 1e-4 → the veto drops sample 3
    masks = [torch.ones(n) for n in lengths]
    masks[1][4:6] = 0  # tool output inside a multi-turn response
    pg_loss = torch.randn(sum(lengths))

    pg_loss, new_masks, metrics = tis_function(
        SimpleNamespace(**MIS_YAML), pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
        loss_masks=masks, total_lengths=[n + 10 for n in lengths], response_lengths=lengths)

    print("kept tokens per sample:", [int(m.sum()) for m in new_masks], "of", [int(m.sum()) for m in masks])
    for name in sorted(metrics):
        if name.startswith("mis_") or name in ("rollout_corr/rollout_is_mean", "rollout_corr/kl"):
            per_sample = [(v * m).sum() / m.sum().clamp(min=1) for v, m in zip(metrics[name].split(lengths), masks)]
            print(f"{name:40s} {float(sum(per_sample) / len(per_sample)): .5f}")


if __name__ == "__main__":
    main()
