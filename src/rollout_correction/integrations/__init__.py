"""Adapters for the engines people already run; each module imports its engine lazily or on use.

* :mod:`rollout_correction.integrations.verl`     — verl 0.9.1: registered policy loss, DataProto
  correction step, GRPO over accepted rows, config wiring for the workers.
* :mod:`rollout_correction.integrations.trl`      — TRL: ``RolloutCorrectionGRPOTrainer``.
* :mod:`rollout_correction.integrations.slime`    — slime: ``tis_function`` for
  ``--custom-tis-function-path``.
* :mod:`rollout_correction.integrations.openrlhf` — OpenRLHF: option mapping and a drop-in
  ``PolicyLoss`` wrapper.

See docs/integrations.md for the lines to change in each engine.
"""
