"""verl 0.9.1: this library's correction step, policy loss and GRPO estimator inside verl.

Installed, the package registers two names in verl's registries in every verl process (its
``verl.plugins`` entry point) and changes nothing else. The run is started through this library's
entry point, with verl's own overrides (docs/integrations.md, verl recipe)::

    python -m rollout_correction.integrations.verl.main_ppo ... \
        algorithm.rollout_correction.rollout_is=token ... \
        actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction \
        algorithm.adv_estimator=grpo_accepted

This script composes that config with the entry point's Hydra config (verl's ``ppo_trainer.yaml``),
asks the entry point which TaskRunner it would hand verl, and runs, on one synthetic batch, what a
training step calls: the correction step of the V1 trainer subclass (with the
``rollout_corr/backend/rollout_correction`` metric), the GRPO advantage over accepted rows, and the
registered policy loss, next to verl's own functions.

    pip install verl==0.9.1               # with its dependencies (ray, ...)
    python examples/integration_verl.py
"""

from __future__ import annotations

import numpy as np
import torch


def main() -> None:
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    from rollout_correction.integrations import verl as rc_verl  # registers the loss and estimator

    from rollout_correction.integrations.verl import main_ppo
    from rollout_correction.integrations.verl.trainer import trainer_class

    torch.manual_seed(0)
    config = main_ppo.compose([  # the command's overrides; verl's block keys, unchanged
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_rs=seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold=0.01",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={rc_verl.LOSS_NAME}",
        f"algorithm.adv_estimator={rc_verl.ADV_ESTIMATOR_NAME}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])  # every run sets it; the YAML has null
    runner = main_ppo.task_runner_class(config)  # what the entry point hands verl's run_ppo
    print("TaskRunner:", runner.__ray_actor_class__.__name__, "- trainer:",
          trainer_class(config.trainer.v1.trainer_mode).__name__)
    print("actor.policy_loss.loss_mode:", config.actor_rollout_ref.actor.policy_loss.loss_mode)
    print("algorithm.adv_estimator:    ", config.algorithm.adv_estimator)

    # One batch: 3 prompts × 4 responses; one response is far off-policy and gets rejected.
    B, T = 12, 10
    rollout = -torch.rand(B, T) - 0.7
    old = (rollout + 0.05 * torch.randn(B, T)).clamp(max=0.0)  # log-probs are ≤ 0
    old[5] = rollout[5] + 0.6
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 3, (B,)).float()
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                         "response_mask": torch.ones(B, T), "token_level_rewards": rewards},
                                non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)})

    trainer = object.__new__(trainer_class(config.trainer.v1.trainer_mode))  # its __init__ builds workers
    trainer.config = config
    batch, metrics = trainer.rollout_correction_step(batch)  # what its _compute_advantage calls
    print(rc_verl.BACKEND_METRIC, "=", metrics.get(rc_verl.BACKEND_METRIC))
    print("rejected rows:", (batch.batch["response_mask"].sum(-1) == 0).nonzero().flatten().tolist(),
          " rollout_corr/kl = %.4f" % metrics["rollout_corr/kl"])

    estimator = core_algos.get_adv_estimator_fn(config.algorithm.adv_estimator)
    adv, _ = estimator(token_level_rewards=rewards, response_mask=batch.batch["response_mask"],
                       index=batch.non_tensor_batch["uid"], config=config.algorithm)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, batch.batch["response_mask"],
                                                            batch.non_tensor_batch["uid"])
    print("group 1 advantages, accepted rows only:", [round(x, 3) for x in adv[4:8, -1].tolist()])
    print("group 1 advantages, verl's GRPO:       ", [round(x, 3) for x in verl_adv[4:8, -1].tolist()])

    # the config object verl's actor worker builds from its section (verl/workers/engine_workers.py)
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    log_prob = (old + 0.1 * torch.randn(B, T)).clamp(max=0.0).requires_grad_(True)
    args = (old, log_prob, adv, batch.batch["response_mask"], "token-mean", actor, batch.batch["rollout_is_weights"])
    ours, ours_metrics = core_algos.get_policy_loss_fn(rc_verl.LOSS_NAME)(*args)
    theirs, theirs_metrics = core_algos.get_policy_loss_fn("vanilla")(*args)
    print("policy loss: ours %.6f, verl vanilla %.6f" % (ours.item(), theirs.item()))
    # verl's trainer logs the loss's metrics with an "actor/" prefix
    print("loss metric actor/%s: ours %s, verl vanilla %s" % (rc_verl.BACKEND_METRIC, ours_metrics.get(
        rc_verl.BACKEND_METRIC), theirs_metrics.get(rc_verl.BACKEND_METRIC)))


if __name__ == "__main__":
    main()
