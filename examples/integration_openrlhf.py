"""OpenRLHF: swap the correction step of ``PolicyLoss`` for this library's.

In OpenRLHF's ``openrlhf/trainer/ray/ppo_actor.py`` the actor builds ``self.actor_loss_fn =
PolicyLoss(...)``. Replace that statement with (docs/integrations.md)::

    from rollout_correction.integrations.openrlhf import RolloutCorrectionPolicyLoss
    self.actor_loss_fn = RolloutCorrectionPolicyLoss.from_args(self.args)

and keep the CLI flags as they are (``--algo.advantage.is_correction_enable``,
``--algo.advantage.is_correction_type seq-mask-tis``, ``--algo.advantage.is_correction_threshold
0.5 5.0``). This script runs both losses on one batch where a single token's log-ratio is +100
inside an accepted sequence (OpenRLHF #1295): OpenRLHF's ``seq-mask-tis`` overflows, ours does not.

    pip install --no-deps openrlhf==0.10.4     # or a full OpenRLHF install
    python examples/integration_openrlhf.py
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from rollout_correction.integrations.openrlhf import RolloutCorrectionPolicyLoss


def policy_loss_class():
    """OpenRLHF's ``PolicyLoss``: from a full install, else from the wheel's loss module alone."""
    try:
        from openrlhf.models import PolicyLoss
        return PolicyLoss
    except ImportError:
        pass
    # Installed with --no-deps: run openrlhf/models/{utils,loss}.py without the package __init__
    # (which needs DeepSpeed); utils.py imports deepspeed but PolicyLoss never uses it.
    models_dir = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0]) / "models"
    sys.modules.setdefault("deepspeed", types.ModuleType("deepspeed"))
    package = types.ModuleType("openrlhf_models")
    package.__path__ = [str(models_dir)]
    sys.modules["openrlhf_models"] = package
    module = None
    for name in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"openrlhf_models.{name}", models_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module.PolicyLoss


def main() -> None:
    torch.manual_seed(0)
    PolicyLoss = policy_loss_class()
    args = SimpleNamespace(  # the fields of OpenRLHF's parsed CLI that the loss reads
        actor=SimpleNamespace(eps_clip_low_high=(0.2, 0.2), dual_clip=None, loss_agg_mode="token-mean",
                              policy_loss_type="ppo"),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_enable=True, is_correction_type="seq-mask-tis",
                                                       is_correction_threshold=[0.5, 5.0])),
    )
    theirs = PolicyLoss(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 5.0],
                        vllm_is_correction_type="seq-mask-tis")
    ours = RolloutCorrectionPolicyLoss.from_args(args, PolicyLoss)

    B, T = 4, 200
    rollout = -torch.rand(B, T) - 0.1
    old = rollout + 0.1 * torch.randn(B, T)
    # Row 0: one token with log-ratio +100, the rest slightly negative. Its geometric-mean ratio is
    # inside [0.5, 5] both raw (OpenRLHF) and with each log-ratio clamped to ±20 (ours), so both
    # accept the row; OpenRLHF then multiplies the loss by exp(100) = inf in fp32.
    old[0] = rollout[0] + torch.tensor([100.0] + [-99.0 / (T - 1)] * (T - 1))
    advantages = torch.randn(B, 1).expand(B, T).clone()
    mask = torch.ones(B, T)
    for name, fn in (("OpenRLHF seq-mask-tis", theirs), ("rollout-correction", ours)):
        log_probs = (old + 0.05 * torch.randn(B, T)).requires_grad_(True)
        loss, clip_ratio, ppo_kl, vllm_kl = fn(log_probs, old, advantages, action_mask=mask,
                                              rollout_log_probs=rollout)
        loss.backward()
        print(f"{name:24s} loss {loss.item(): .4f}  gradient finite: {bool(torch.isfinite(log_probs.grad).all())}")
    print("metrics of the last call:", {k: round(float(v), 4) for k, v in ours.last_metrics.items()
                                        if "rs_seq_masked" in k or k.endswith("rollout_is_max")})


if __name__ == "__main__":
    main()
