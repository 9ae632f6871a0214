"""verl's V1 trainers with this library's correction step (what :mod:`.main_ppo` runs).

verl 0.9.1's default trainer (``trainer.use_v1: true``, any ``trainer.v1.trainer_mode``) runs its
decoupled correction step inside ``PPOTrainer._compute_advantage``
(``verl/trainer/ppo/v1/trainer_base.py``), which calls ``compute_rollout_correction_and_add_to_batch``
inline, between the KL penalty and the advantage estimator, with no method of its own to override.
:class:`RolloutCorrectionTrainerMixin` therefore overrides ``_compute_advantage``: when a decoupled
correction runs (the block is set, not in bypass mode, and the rollout stored its log-probs) it takes
the same four steps as verl's method — fetch the batch from TransferQueue, KL penalty, correction,
advantages, write back — with the correction step being its method :meth:`~RolloutCorrectionTrainerMixin.rollout_correction_step`;
otherwise it is verl's method. It also writes the corrected ``response_mask`` as the workers'
``loss_mask``: verl's V1 agent loop stores ``loss_mask = response_mask`` at rollout time, every verl
engine counts ``batch_num_tokens`` (the token-mean denominator) from ``loss_mask``, and verl's method
writes back only ``response_mask``, so rejected tokens would leave the numerator but stay in the
denominator.

:func:`trainer_class` gives the subclass of the trainer verl registered for a mode (``sync``,
``colocate_async``, ``separate_async``, or one a recipe registered). Importing this module imports
verl's V1 trainer modules (and TransferQueue); the plugin module does not.

``trainer.rollout_correction_dump_dir=DIR`` (off by default; beside verl's own
``trainer.rollout_data_dir``) makes the correction step write, once per training step, the batch's
rollout and trainer log-probs, response mask, lengths and the step to ``DIR/step_{N}.pt``, which
``rollout-correction diagnose DIR`` reads.
"""

from __future__ import annotations

from typing import Any

from . import (BACKEND_METRIC, _block_settings, _say_once, check_trainer_config,
               compute_rollout_correction_and_add_to_batch)

__all__ = ["DUMP_KEY", "RolloutCorrectionTrainerMixin", "trainer_class"]

#: ``trainer.rollout_correction_dump_dir``: when set, each correction step writes the batch's rollout and
#: trainer log-probs and mask there (``rollout_correction.integrations.dump``) for ``rollout-correction diagnose``.
DUMP_KEY = "rollout_correction_dump_dir"

_FIELDS = ["uid", "response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob", "values"]


class RolloutCorrectionTrainerMixin:
    """Put before a verl V1 ``PPOTrainer`` subclass: its decoupled correction step is this library's."""

    config: Any
    #: The :class:`~rollout_correction.monitor.HealthMonitor` the correction step feeds once per
    #: training step (None: none). ``RolloutCorrectionTaskRunnerV1.health_monitor`` sets it.
    health_monitor: Any = None

    def rollout_correction_step(self, data: Any) -> tuple[Any, dict[str, float]]:
        """This library's correction step on the trainer's ``DataProto`` (decoupled mode).

        Checks that the block's loss-side keys reach the loss (:func:`~rollout_correction.integrations.verl.check_trainer_config`),
        rewrites ``response_mask``, adds ``rollout_is_weights`` when IS is on, and returns the
        ``rollout_corr/...`` metrics with :data:`~rollout_correction.integrations.verl.BACKEND_METRIC` = 1.
        """
        check_trainer_config(self.config)
        dump_dir = (self.config.get("trainer") or {}).get(DUMP_KEY, None)  # the entry point's config has it
        if dump_dir:  # once per step, before the correction changes the mask
            from rollout_correction.integrations.dump import write_step_dump

            step = int(getattr(self, "global_steps", 0) or 0)
            write_step_dump(str(dump_dir), step, old_log_probs=data.batch["old_log_probs"],
                            rollout_log_probs=data.batch["rollout_log_probs"],
                            response_mask=data.batch["response_mask"], rank=None)
        block = _block_settings(self.config.algorithm.rollout_correction)
        data, metrics = compute_rollout_correction_and_add_to_batch(data, block, monitor=self.health_monitor)
        _say_once("step", "rollout_correction: verl's rollout-correction step runs this library "
                  f"({type(self).__name__}._compute_advantage)")
        return data, {**metrics, BACKEND_METRIC: 1.0}

    def _compute_advantage(self, batch: Any, metrics: dict) -> Any:
        block = self.config.algorithm.get("rollout_correction", None)
        if block is None or block.get("bypass_mode", False):
            return super()._compute_advantage(batch, metrics)  # no decoupled step: verl's method

        import numpy as np
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.protocol import DataProto
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty
        from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories
        from verl.workers.utils.padding import response_to_nested

        fetched = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=_FIELDS)
        if "rollout_log_probs" not in fetched.keys():
            return super()._compute_advantage(batch, metrics)  # the rollout stored no log-probs: verl's method
        nested_mask = fetched["response_mask"]  # jagged: each row's response length
        data = DataProto(batch=fetched.to_padded_tensor())
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        data.non_tensor_batch["uid"] = np.array(data.batch.pop("uid").tolist(), dtype=object)

        algorithm = self.config.algorithm
        if algorithm.use_kl_in_reward:
            data, kl_metrics = apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward, kl_penalty=algorithm.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]

        data, step_metrics = self.rollout_correction_step(data)
        metrics.update(step_metrics)

        data = compute_advantage_for_multi_trajectories(
            data, batch_keys=batch.keys, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma,
            lam=algorithm.lam, num_repeat=self.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm)

        # the workers train on loss_mask: the corrected mask, so rejected tokens leave batch_num_tokens
        data.batch["loss_mask"] = data.batch["response_mask"].to(nested_mask.dtype)
        fields = ["advantages", "returns", "response_mask", "loss_mask"]
        if algorithm.use_kl_in_reward:
            fields.append("token_level_rewards")
        if "rollout_is_weights" in data.batch.keys():
            fields.append("rollout_is_weights")
        output = TensorDict({f: response_to_nested(data.batch[f], nested_mask) for f in fields}, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)


_CLASSES: dict[type, type] = {}


def trainer_class(mode: str) -> type:
    """The subclass of the V1 trainer verl registered as ``mode`` (``trainer.v1.trainer_mode``) with
    this library's correction step (:class:`RolloutCorrectionTrainerMixin` first in its bases)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    base = get_trainer_cls(str(mode))
    if issubclass(base, RolloutCorrectionTrainerMixin):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"RolloutCorrection{base.__name__}", (RolloutCorrectionTrainerMixin, base), {
            "__module__": __name__,
            "__doc__": f"verl's {base.__name__} (trainer_mode={mode!r}) with this library's correction step.",
        })
    return _CLASSES[base]
