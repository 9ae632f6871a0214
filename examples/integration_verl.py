"""verl 0.9.1: verl's correction step, policy loss and GRPO estimator from this library.

Installed, the package is imported by ``import verl`` in every process (its ``verl.plugins``
entry point); the run's config then decides (docs/integrations.md, verl recipe)::

    +algorithm.rollout_correction.backend=rollout_correction
    actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction      # optional
    algorithm.adv_estimator=grpo_accepted                                 # optional

This script applies those lines to verl's own default trainer YAML and runs, on one synthetic
batch, what a training step calls: verl's own ``rollout_corr_helper`` entry (now switched by the
config, with the ``rollout_corr/backend/rollout_correction`` metric), the GRPO advantage over
accepted rows, and the registered policy loss, next to verl's own functions.

    pip install verl==0.9.1               # with its dependencies (ray, ...)
    python examples/integration_verl.py
"""

from __future__ import annotations

import os

import numpy as np
import torch
from omegaconf import OmegaConf


def main() -> None:
    import verl
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    from rollout_correction.integrations import verl as rc_verl  # registers the loss and estimator

    torch.manual_seed(0)
    config = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__),
                                         "trainer/config/_generated_ppo_trainer.yaml"))
    config.algorithm.adv_estimator = "grpo"
    config.algorithm.rollout_correction = OmegaConf.create({  # verl's block, unchanged
        "rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01, "bypass_mode": False, "loss_type": "ppo_clip",
        "rollout_is_batch_normalize": False, "backend": rc_verl.BACKEND_NAME})
    config.actor_rollout_ref.actor.policy_loss.loss_mode = rc_verl.LOSS_NAME
    config.algorithm.adv_estimator = rc_verl.ADV_ESTIMATOR_NAME
    print("actor.policy_loss.loss_mode:", config.actor_rollout_ref.actor.policy_loss.loss_mode)
    print("algorithm.adv_estimator:    ", config.algorithm.adv_estimator)

    # One batch: 3 prompts × 4 responses; one response is far off-policy and gets rejected.
    B, T = 12, 10
    rollout = -torch.rand(B, T) - 0.1
    old = rollout + 0.05 * torch.randn(B, T)
    old[5] = rollout[5] + 0.6
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.randint(0, 3, (B,)).float()
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout,
                                         "response_mask": torch.ones(B, T), "token_level_rewards": rewards},
                                non_tensors={"uid": np.array([f"p{i // 4}" for i in range(B)], dtype=object)})

    from verl.trainer.ppo import rollout_corr_helper  # where verl's trainers look the step up

    batch, metrics = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(
        batch, config.algorithm.rollout_correction)
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

    config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 2  # every run sets it; the YAML has null
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    log_prob = (old + 0.1 * torch.randn(B, T)).requires_grad_(True)
    args = (old, log_prob, adv, batch.batch["response_mask"], "token-mean", actor, batch.batch["rollout_is_weights"])
    ours, ours_metrics = core_algos.get_policy_loss_fn(rc_verl.LOSS_NAME)(*args)
    theirs, theirs_metrics = core_algos.get_policy_loss_fn("vanilla")(*args)
    print("policy loss: ours %.6f, verl vanilla %.6f" % (ours.item(), theirs.item()))
    # verl's trainer logs the loss's metrics with an "actor/" prefix
    print("loss metric actor/%s: ours %s, verl vanilla %s" % (rc_verl.BACKEND_METRIC, ours_metrics.get(
        rc_verl.BACKEND_METRIC), theirs_metrics.get(rc_verl.BACKEND_METRIC)))


if __name__ == "__main__":
    main()
