"""verl with this library's correction step: ``python -m rollout_correction.integrations.verl.main_ppo``.

The same command line as ``python -m verl.trainer.main_ppo`` (verl's Hydra overrides, composed on
verl's own ``ppo_trainer.yaml``); what differs is the trainer: verl's V1 trainer for the configured
``trainer.v1.trainer_mode`` subclassed with :class:`~.trainer.RolloutCorrectionTrainerMixin`, whose
decoupled correction step is this library's. verl runs its trainer inside its ``TaskRunnerV1`` Ray
actor; :data:`RolloutCorrectionTaskRunner` is that actor with the subclass, so the choice holds in the
process where the step runs (verl's workers need nothing: the loss and the estimator are looked up
in verl's registries by name, where the package's ``verl.plugins`` entry point put them).

The config has one key more than verl's, ``algorithm.rollout_correction.backend``
(``rollout_correction`` by default; ``verl`` keeps verl's own step), read and removed here before
verl sees the config. Refused here, each naming what to change: a misspelt ``backend``; keys verl's
own step would ignore when ``backend=verl``; loss-side keys the loss cannot see
(:func:`~rollout_correction.integrations.verl.check_trainer_config`); and this library's step on
verl's legacy trainer (``trainer.use_v1=false``), whose ``RayPPOTrainer.fit`` calls the step inline
with no method to override.

For your own entry point: ``run_ppo(config, task_runner_class=task_runner_class(config))`` with
verl's ``verl.trainer.main_ppo.run_ppo``.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import hydra
import ray
from omegaconf import OmegaConf, open_dict
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

from . import (BACKEND_KEY, ENTRY_POINT, backend_requested, check_trainer_config, refuse_keys_verls_step_ignores,
               require_registration)

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "RolloutCorrectionTaskRunner", "compose", "main", "task_runner_class"]

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")
CONFIG_NAME = "rollout_correction_ppo_trainer"


class RolloutCorrectionTaskRunnerV1(TaskRunnerV1.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` whose trainer is :func:`~.trainer.trainer_class` of the configured mode.

    To watch training health, subclass it and return a monitor from :meth:`health_monitor`; the
    trainer's correction step feeds it once per step (docs/monitoring.md)."""

    def health_monitor(self, config: Any) -> Any:
        """The :class:`~rollout_correction.monitor.HealthMonitor` the trainer's correction step feeds
        (None, the default: no monitor). Called once in the TaskRunner process, before training."""
        return None

    def run(self, config: Any) -> None:
        # verl 0.9.1's TaskRunnerV1.run, with the trainer class this library's subclass
        import transfer_queue as tq
        from verl.utils.logging_utils import configure_verl_logging

        from .trainer import trainer_class

        configure_verl_logging()
        trainer_cls = trainer_class(config.trainer.v1.trainer_mode)
        config.transfer_queue.enable = True
        print(OmegaConf.to_yaml(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.health_monitor = self.health_monitor(config)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


#: verl's TaskRunnerV1 Ray actor with this library's trainer subclass.
RolloutCorrectionTaskRunner = ray.remote(RolloutCorrectionTaskRunnerV1)


def compose(overrides: Sequence[str] = ()) -> Any:
    """The config this entry point gets for ``overrides`` (Hydra's compose API on the same files)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))


def task_runner_class(config: Any) -> Any:
    """Read and remove ``algorithm.rollout_correction.backend``, check the config, and return the
    TaskRunner actor class to hand to verl's ``run_ppo``: :data:`RolloutCorrectionTaskRunner`, or
    verl's own (``backend=verl``, or the legacy trainer in bypass mode, where no step runs). A config
    selecting this library's loss or estimator when registering them failed raises here
    (:func:`~rollout_correction.integrations.verl.require_registration`)."""
    require_registration(config)
    block = config.algorithm.get("rollout_correction", None)
    ours = True
    if block is not None:
        ours = backend_requested(block)  # a misspelt value raises, naming it
        if BACKEND_KEY in block:
            with open_dict(block):
                block.pop(BACKEND_KEY)
        check_trainer_config(config)
        if not ours:
            refuse_keys_verls_step_ignores(block)
    decoupled = block is not None and not block.get("bypass_mode", False)
    if config.trainer.use_v1:
        return RolloutCorrectionTaskRunner if ours else TaskRunnerV1
    if ours and decoupled:
        raise ValueError(
            "trainer.use_v1=false: verl's legacy RayPPOTrainer calls its correction step inline in fit(), with "
            f"no method a subclass could override, so {ENTRY_POINT} cannot run this library's step there. Use "
            "verl's default V1 trainer (drop trainer.use_v1=false), or keep verl's step with "
            f"algorithm.rollout_correction.{BACKEND_KEY}=verl (the rollout_correction loss and the grpo_accepted "
            "estimator still apply), or bypass mode (the correction in the loss)")
    from verl.trainer.main_ppo_v0 import TaskRunner

    return TaskRunner


@hydra.main(config_path="config", config_name=CONFIG_NAME, version_base=None)
def main(config: Any) -> None:
    """verl's ``main_ppo.main`` with :func:`task_runner_class` choosing the TaskRunner."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    runner = task_runner_class(config)  # removes the backend key before verl reads the config
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    run_ppo(config, task_runner_class=runner)


if __name__ == "__main__":
    main()
