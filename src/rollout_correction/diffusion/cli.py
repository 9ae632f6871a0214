"""Sub-command hooks of ``rollout-correction diffusion-demo`` (``add_arguments`` / ``run``).

The command trains FlowGRPO on a tiny diffusers transformer (:mod:`.pipeline`);
``diffusion-demo --toy …`` runs the 2-D toy (:mod:`.example`).
"""

from rollout_correction.diffusion.pipeline.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
