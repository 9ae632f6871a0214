"""The ``rollout-correction`` command.

Each product surface owns its sub-command in ``<surface>/cli.py`` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this module only dispatches, and imports a
surface only when its sub-command is used, so the core stays free of optional dependencies.

An expected failure — a bad flag, an unreadable or foreign file (``ValueError``, ``OSError``), a
missing extra, a :class:`~rollout_correction.console.CommandError` — ends as one line on stderr
and exit 2; anything else as one line and exit 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rollout_correction.console import ArgumentParser, CommandError, one_line

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


def _source_checkout() -> Path | None:
    """The checkout this package runs from (an editable install, or ``src/`` on the path), or None
    for an installed wheel."""
    here = Path(__file__).resolve().parents[2]  # <checkout>/src/rollout_correction/cli.py
    return here if (here / "pyproject.toml").is_file() and "site-packages" not in here.parts else None


def install_hint(command: str) -> str:
    """The pip command that installs the optional dependencies of ``command``: ``pip install -e
    '<checkout>[extra]'`` for an editable install, ``pip install 'rollout-correction[extra]'`` else."""
    extra = _EXTRAS.get(command, command)
    source = _source_checkout()
    if source is not None:
        where = "." if source == Path.cwd().resolve() else str(source)
        return f"pip install -e '{where}[{extra}]'"
    return f"pip install 'rollout-correction[{extra}]'"


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the full traceback instead of one line")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (each surface may pull in heavy
    optional dependencies, and a sub-command should not pay for the others). An ImportError of
    that module (a missing extra) propagates."""
    parser = ArgumentParser(
        prog="rollout-correction",
        description="Rollout correction for LLM reinforcement learning.",
    )
    from rollout_correction import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_debug(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name, (module_name, help_text) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module_name)
        if name != command:
            continue
        _add_debug(sp)
        importlib.import_module(module_name).add_arguments(sp)
    return parser


def _missing(exc: ImportError, command: str) -> str:
    """``<module> is not installed; install it with: <pip command right for this install>``."""
    err: BaseException | None = exc
    while err is not None and not getattr(err, "name", None):
        err = err.__cause__
    what = f"the module {err.name!r}" if err is not None else f"a dependency ({exc})"
    return f"{what} is not installed; install it with: {install_hint(command)}"


def _fail(command: str | None, message: object, hint: str = "") -> int:
    name = f"rollout-correction {command}" if command else "rollout-correction"
    print(f"{name}: {one_line(message)}{hint}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command. Expected failures (bad arguments or files, a missing extra, a report
    folder in use) are one line on stderr and exit 2; ``--debug`` shows the traceback instead."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    command = next((a for a in argv if not a.startswith("-")), None)
    command = command if command in _COMMANDS else None
    try:
        parser = build_parser(command)
    except ImportError as exc:
        if debug:
            raise
        return _fail(command, _missing(exc, command or ""))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named with the sub-command whose flags they are not
        where = f"rollout-correction {args.command}" if args.command else "rollout-correction"
        parser.exit(2, f"{where}: unrecognized arguments: {' '.join(unknown)} (see {where} --help)\n")
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"rollout-correction {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, ValueError, OSError, ImportError) as exc:
        if debug:
            raise
        if isinstance(exc, CommandError):
            return _fail(args.command, exc)
        if isinstance(exc, ImportError):
            return _fail(args.command, _missing(exc, args.command))
        if isinstance(exc, OSError) and exc.strerror:
            exc = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
        return _fail(args.command, exc, " (--debug shows the traceback)")
    except Exception as exc:  # an unexpected failure: one line too, and the way to the traceback
        if debug:
            raise
        _fail(args.command, f"{type(exc).__name__}: {exc}", " (an internal error; --debug shows the traceback)")
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
