"""verl 0.9.1: route the trainer's rollout correction through this library.

In your verl entry point (the script that builds ``RayPPOTrainer``), add two lines before the
trainer is constructed (docs/integrations.md)::

    from rollout_correction.integrations.verl import wire_trainer_config
    wire_trainer_config(config)          # config: the Hydra/OmegaConf trainer config

and keep ``algorithm.rollout_correction`` exactly as verl documents it. This script does the same
on verl's own default trainer YAML and then runs, on one synthetic batch, the three pieces a
training step uses: the correction on a ``DataProto`` (decoupled mode), the GRPO advantage over
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
        "rollout_is_batch_normalize": False})
    rc_verl.wire_trainer_config(config, driver=False)  # driver=True also routes RayPPOTrainer.fit's step
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

    batch, metrics = rc_verl.compute_rollout_correction_and_add_to_batch(batch, config.algorithm.rollout_correction)
    print("rejected rows:", (batch.batch["response_mask"].sum(-1) == 0).nonzero().flatten().tolist(),
          " rollout_corr/kl = %.4f" % metrics["rollout_corr/kl"])

    estimator = core_algos.get_adv_estimator_fn(config.algorithm.adv_estimator)
    adv, _ = estimator(token_level_rewards=rewards, response_mask=batch.batch["response_mask"],
                       index=batch.non_tensor_batch["uid"], config=config.algorithm)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, batch.batch["response_mask"],
                                                            batch.non_tensor_batch["uid"])
    print("group 1 advantages, accepted rows only:", [round(x, 3) for x in adv[4:8, -1].tolist()])
    print("group 1 advantages, verl's GRPO:       ", [round(x, 3) for x in verl_adv[4:8, -1].tolist()])

    actor = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                              "clip_ratio_c": 3.0, "global_batch_info": {},
                              "policy_loss": config.actor_rollout_ref.actor.policy_loss})
    log_prob = (old + 0.1 * torch.randn(B, T)).requires_grad_(True)
    args = (old, log_prob, adv, batch.batch["response_mask"], "token-mean", actor, batch.batch["rollout_is_weights"])
    ours, _ = core_algos.get_policy_loss_fn(rc_verl.LOSS_NAME)(*args)
    theirs, _ = core_algos.get_policy_loss_fn("vanilla")(*args)
    print("policy loss: ours %.6f, verl vanilla %.6f" % (ours.item(), theirs.item()))


if __name__ == "__main__":
    main()
