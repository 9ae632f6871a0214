"""OpenRLHF: swap the correction step of ``PolicyLoss`` for this library's, without editing OpenRLHF.

Start training with this library's launcher instead of OpenRLHF's, on the same command line
(docs/integrations.md)::

    python -m rollout_correction.integrations.openrlhf.train_ppo_ray <your OpenRLHF flags> ...

It runs OpenRLHF's own ``train_ppo_ray`` with a subclass of OpenRLHF's ``PolicyModelActor`` whose
trainer uses ``RolloutCorrectionPolicyLoss.from_args(args)`` and whose ``append`` passes each
experience through the loss's ``prepare_experience``. Keep the CLI flags (OpenRLHF 0.10.4 – 0.11.1: ``--algo.advantage.is_correction_enable
--algo.advantage.is_correction_type seq-mask-tis --algo.advantage.is_correction_threshold 0.5 5.0``;
OpenRLHF 0.11.2: ``--algo.advantage.is_correction_level seq --algo.advantage.is_correction_mode mask
--algo.advantage.is_correction_threshold 0.5 5.0``). This script parses that command line with the
installed OpenRLHF's own parser (the flags of its release), then on one batch shows
(1) a single token's log-ratio of +100 inside an accepted sequence: OpenRLHF's ``seq-mask-tis``
overflows, ours does not; (2) ``prepare_experience`` taking a rejected sequence out of the action
mask OpenRLHF counts its denominators from.

    pip install --no-deps openrlhf==0.11.2     # or 0.10.4 – 0.11.1, or a full OpenRLHF install
    python examples/integration_openrlhf.py
"""

from __future__ import annotations

import ast
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
    stand_in = "deepspeed" not in sys.modules
    if stand_in:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    package = types.ModuleType("openrlhf_models")
    package.__path__ = [str(models_dir)]
    sys.modules["openrlhf_models"] = package
    module = None
    for name in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"openrlhf_models.{name}", models_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    if stand_in:
        del sys.modules["deepspeed"]
    return module.PolicyLoss


def cli_path() -> Path:
    package = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0])
    return package / "cli" / "train_ppo_ray.py"


def gate_options() -> bool:
    """Whether the installed OpenRLHF has 0.11.2's is_correction_level / _mode / _gating options."""
    return "--algo.advantage.is_correction_level" in cli_path().read_text()


def openrlhf_args(argv: list[str]):
    """The args ``python -m openrlhf.cli.train_ppo_ray <argv>`` hands to ``train``: the body of its
    ``__main__`` block (argparse, ``hierarchize``, validation) without the final ``train(args)``."""
    path = cli_path()
    tree = ast.parse(path.read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    imports = [n for n in tree.body if isinstance(n, ast.Import) and n.names[0].name in ("argparse", "os")]
    imports += [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "datetime"]
    config_dir = path.parent.parent / "utils"  # openrlhf/utils/config.py, without openrlhf/utils/__init__
    spec = importlib.util.spec_from_file_location("openrlhf_utils_config", config_dir / "config.py")
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    body = [n for n in block.body[:-1]
            if not (isinstance(n, ast.ImportFrom) and n.module == "openrlhf.utils.config")]
    namespace = {"hierarchize": config.hierarchize, "__name__": "__main__"}
    old_argv, sys.argv = sys.argv, ["train_ppo_ray.py", *argv]
    try:
        exec(compile(ast.Module(body=imports + body, type_ignores=[]), str(path), "exec"), namespace)
    finally:
        sys.argv = old_argv
    return namespace["args"]


def main() -> None:
    torch.manual_seed(0)
    PolicyLoss = policy_loss_class()
    if gate_options():  # OpenRLHF 0.11.2
        flags = ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "mask"]
        theirs = PolicyLoss(is_correction_level="seq", is_correction_mode="mask",
                            is_correction_threshold=[0.5, 5.0])
    else:  # OpenRLHF 0.10.4 – 0.11.1
        flags = ["--algo.advantage.is_correction_enable",
                 "--algo.advantage.is_correction_type", "seq-mask-tis"]
        theirs = PolicyLoss(enable_vllm_is_correction=True, vllm_is_truncated_threshold=[0.5, 5.0],
                            vllm_is_correction_type="seq-mask-tis")
    args = openrlhf_args([
        "--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--algo.advantage.estimator", "group_norm",
        "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "4", *flags,
        "--algo.advantage.is_correction_threshold", "0.5", "5.0",
    ])
    ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=PolicyLoss)

    B, T = 4, 200
    rollout = -torch.rand(B, T) - 0.1
    old = (rollout + 0.1 * torch.randn(B, T)).clamp(max=0.0)  # log-probs are ≤ 0
    # Row 0: one token with log-ratio +100, the rest slightly negative. Its geometric-mean ratio is
    # inside [0.5, 5] both raw (OpenRLHF) and with each log-ratio clamped to ±20 (ours), so both
    # accept the row; OpenRLHF then multiplies the loss by exp(100) = inf in fp32.
    # (Both log-probs stay ≤ 0: the row is moved down before its rollout log-probs are set.)
    old[0] = old[0] - 1.0
    rollout[0] = old[0] - torch.tensor([100.0] + [-99.0 / (T - 1)] * (T - 1))
    # Row 3: every ratio e^-3, outside the band: the sequence is rejected.
    old[3] = rollout[3] - 3.0
    advantages = torch.randn(B, 1).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    # What the launcher's PolicyModelActor subclass hands the replay buffer in append.
    experience = SimpleNamespace(action_mask=mask.clone(), action_log_probs=old, rollout_log_probs=rollout,
                                 advantages=advantages.clone(), info={})
    ours.prepare_experience(experience)
    print("action tokens OpenRLHF counts:", int(mask.sum()), "->", int(experience.action_mask.sum()))
    print("rejected token fraction per sample:", experience.info["rollout_corr/openrlhf_rejected_token_fraction"].tolist())
    for name, fn, m in (("OpenRLHF seq-mask-tis", theirs, mask), ("rollout-correction", ours, experience.action_mask)):
        log_probs = (old + 0.05 * torch.randn(B, T)).clamp(max=0.0).requires_grad_(True)
        # four values up to OpenRLHF 0.11.1, five (is_filter_ratio last) in 0.11.2
        loss = fn(log_probs, old, advantages, action_mask=m, rollout_log_probs=rollout)[0]
        loss.backward()
        print(f"{name:24s} loss {loss.item(): .4f}  gradient finite: {bool(torch.isfinite(log_probs.grad).all())}")


if __name__ == "__main__":
    main()
