"""OpenRLHF's policy actor with this library's correction: the two places OpenRLHF gives no plugin point.

OpenRLHF builds its loss in ``ActorPPOTrainer.__init__`` (``self.actor_loss_fn = PolicyLoss(...)``) and
fills the actor's replay buffer in ``PolicyModelActor.append``
(``openrlhf/trainer/ray/ppo_actor.py``). :func:`policy_model_actor` subclasses OpenRLHF's own
``PolicyModelActor`` class (the one given, so every supported release works) with
:class:`RolloutCorrectionActorMixin`:

* ``init_model_from_pretrained`` runs OpenRLHF's, then sets the trainer it built to use
  :class:`~rollout_correction.integrations.openrlhf.RolloutCorrectionPolicyLoss` built from the
  same args (``from_args``: the same clip range, dual clip, loss type and aggregation, OpenRLHF's own
  correction off, this library's on);
* ``append`` hands each experience to the loss's ``prepare_experience`` (rejected tokens leave the
  action mask, hence ``batch_num_tokens`` / ``global_batch_size``) before OpenRLHF's ``append``;
* with ``rollout_correction_dump_dir`` set (the launcher's ``--rollout_correction.dump_dir DIR``; off by
  default), ``append`` also keeps a CPU copy of each experience's π_old and π_rollout log-probs and
  action mask (before the correction's rejection), and ``fit`` writes them once per training step to
  ``DIR/step_{N}[_rank_{R}].pt`` (:mod:`rollout_correction.integrations.dump`; N counts this actor's
  training steps from 0) before OpenRLHF trains, for ``rollout-correction diagnose DIR``.

The subclass is what :mod:`.train_ppo_ray` hands OpenRLHF's launcher; Ray ships the class to each
actor process, so nothing has to be installed or rebound there.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["RolloutCorrectionActorMixin", "policy_model_actor"]


class RolloutCorrectionActorMixin:
    """Put before OpenRLHF's ``PolicyModelActor`` class in the bases.

    ``rollout_correction_config`` (class attribute): None maps OpenRLHF's own correction flags
    (``from_args(args)``); a preset name, a mapping or a config replaces them
    (``from_args(args, config)``; the flags must still turn the correction on, for the log-probs).
    ``rollout_correction_metrics``: the metric families (None: the config's).
    """

    rollout_correction_config: Any = None
    rollout_correction_metrics: Optional[tuple[str, ...]] = None
    rollout_correction_dump_dir: Optional[str] = None
    trainer: Any
    _dump: Any = None
    _dump_steps = 0

    def init_model_from_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        from . import RolloutCorrectionPolicyLoss

        result = super().init_model_from_pretrained(*args, **kwargs)
        self.trainer.actor_loss_fn = RolloutCorrectionPolicyLoss.from_args(
            self.trainer.args, self.rollout_correction_config, metrics=self.rollout_correction_metrics)
        return result

    def append(self, experience: Any) -> Any:
        if self.rollout_correction_dump_dir:
            if self._dump is None:
                from rollout_correction.integrations.dump import StepDump

                self._dump = StepDump(self.rollout_correction_dump_dir)
            if experience.rollout_log_probs is not None:
                self._dump.add(experience.action_log_probs, experience.rollout_log_probs, experience.action_mask)
        return super().append(self.trainer.actor_loss_fn.prepare_experience(experience))

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        if self._dump is not None and len(self._dump):
            self._dump.flush(self._dump_steps)
        self._dump_steps += 1
        return super().fit(*args, **kwargs)


def policy_model_actor(base: Any, config: Any = None, dump_dir: Optional[str] = None,
                       metrics: Optional[tuple[str, ...]] = None) -> type:
    """The subclass of OpenRLHF's ``PolicyModelActor`` with this library's correction.

    ``base`` is OpenRLHF's class or its Ray actor class (``@ray.remote``; its class is taken);
    ``config`` is stored as ``rollout_correction_config``, ``dump_dir`` as
    ``rollout_correction_dump_dir``, ``metrics`` as ``rollout_correction_metrics``. Returns a plain
    class: wrap it with ``ray.remote(num_gpus=1)`` as OpenRLHF does its own.
    """
    base = getattr(base, "__ray_actor_class__", base)
    return type(f"RolloutCorrection{base.__name__}", (RolloutCorrectionActorMixin, base), {
        "__module__": __name__, "rollout_correction_config": config, "rollout_correction_dump_dir": dump_dir,
        "rollout_correction_metrics": metrics,
        "__doc__": f"OpenRLHF's {base.__name__} with this library's rollout correction.",
    })
