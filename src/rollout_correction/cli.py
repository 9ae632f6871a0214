"""The ``rollout-correction`` command.

Each product surface owns its sub-command in ``<surface>/cli.py`` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only dispatches, and imports a
surface only when its sub-command is used, so the core stays free of optional dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("rollout_correction.demo.cli",
             "train a small LM with a mismatched rollout engine: naive PPO vs. rollout correction"),
    "diagnose": ("rollout_correction.diagnose.cli",
                 "measure the training-inference mismatch in dumped log-probs and recommend a preset"),
    "diffusion-demo": ("rollout_correction.diffusion.cli",
                       "FlowGRPO on a diffusers transformer: a bf16/fp8 rollout engine with and without rollout correction"),
    "presets": ("rollout_correction.presets_cli", "list the configuration presets"),
    "monitor": ("rollout_correction.monitor.cli",
                "replay a logged metrics history through the training health monitor: plot, alerts, summary"),
    "verl-check": ("rollout_correction.integrations.verl_cli",
                   "check that `import verl` loads this library's plugin in this environment"),
}
# sub-command -> the pyproject extra that installs what it needs (when it is not the command's name)
_EXTRAS: dict[str, str] = {"diffusion-demo": "diffusion", "presets": "cli", "verl-check": "verl"}


def install_hint(command: str) -> str:
    """The pip command that installs the optional dependencies of ``command``."""
    return f"pip install 'rollout-correction[{_EXTRAS.get(command, command)}]'"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (each surface may pull in heavy
    optional dependencies, and a sub-command should not pay for the others)."""
    parser = argparse.ArgumentParser(
        prog="rollout-correction",
        description="Rollout correction for LLM reinforcement learning.",
    )
    from rollout_correction import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        if name != command:
            continue
        # A sub-command whose module cannot be imported (a missing extra) still shows up in
        # --help; the error is raised when it is run.
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # pragma: no cover - depends on installed extras
            sp.set_defaults(_import_error=exc)
            continue
        module.add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in _COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    err = getattr(args, "_import_error", None)
    if err is not None:
        print(
            f"rollout-correction {args.command}: a dependency is missing ({err}).\n"
            f"Install the extra: {install_hint(args.command)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
