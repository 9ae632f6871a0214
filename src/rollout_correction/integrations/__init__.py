"""Adapters for the engines people already run; each module imports its engine lazily or on use.

* :mod:`rollout_correction.integrations.verl`     — verl 0.9.1: registered policy loss and GRPO over
  accepted rows (the ``verl.plugins`` entry point), config wiring for the workers; the entry point
  ``python -m rollout_correction.integrations.verl.main_ppo`` runs verl's V1 trainer subclassed with
  this library's correction step.
* :mod:`rollout_correction.integrations.trl`      — TRL: ``RolloutCorrectionGRPOTrainer``.
* :mod:`rollout_correction.integrations.slime`    — slime: ``tis_function`` for
  ``--custom-tis-function-path``.
* :mod:`rollout_correction.integrations.openrlhf` — OpenRLHF: option mapping, a drop-in
  ``PolicyLoss`` wrapper, a subclass of its policy actor and the launcher
  ``python -m rollout_correction.integrations.openrlhf.train_ppo_ray``.

Installing the package changes no engine; each adapter acts where the user selects it (a config
key naming it, a class, a launcher). See docs/integrations.md for each engine's recipe.
"""
