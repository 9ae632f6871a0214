"""Sub-command hooks for the diffusion toy (``add_arguments`` / ``run``), for the CLI dispatcher."""

from rollout_correction.diffusion.example.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
