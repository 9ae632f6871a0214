"""``rollout-correction demo``: flags, then SFT → GRPO for every method × seed → report."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from rollout_correction.demo.config import DEFAULT_METHODS, METHODS, QUICK, QUICK_LONG, SCENARIOS, DemoConfig, quick_methods
from rollout_correction.demo.model import MODEL_SIZES, MOE_SIZES
from rollout_correction.demo.task import TASKS
from rollout_correction.demo.engine import PRECISIONS, QUANTS

DEFAULT_OUT = "demo-report"
# What makes a folder another run's report (an explicit --out holding one is refused without --force).
REPORT_MARKERS = ("report.md", "summary.json", "async-report.md", "async-summary.json", "runs")

# flag -> (type, help); the default of every flag comes from the scenario (then --quick).
_FLAGS: dict[str, tuple[type, str]] = {
    "task": (str, f"synthetic task: {', '.join(TASKS)}"),
    "digits": (int, "digits per prompt (= answer length)"),
    "tail": (int, "unscored continuation tokens after the answer (long responses; the long scenario)"),
    "reward": (str, "training reward: exact (all digits right) or partial (fraction of digits right)"),
    "model": (str, f"model size: {', '.join(MODEL_SIZES)}"),
    "precision": (str, f"rollout engine precision: {', '.join(PRECISIONS)}"),
    "quant": (str, f"rollout engine weight fake-quantisation: {', '.join(QUANTS)}"),
    "granularity": (str, "quantisation scale per output channel or per tensor: channel, tensor"),
    "lag": (int, "rollout engine weights lag this many optimizer steps behind the trainer"),
    "steps": (int, "GRPO steps per run"),
    "prompts": (int, "prompts per GRPO step"),
    "samples": (int, "samples per prompt (GRPO group size)"),
    "lr": (float, "GRPO learning rate (Adam)"),
    "minibatches": (int, "PPO mini-batches per step (>1 makes π_θ move away from π_old within a step)"),
    "clip_eps": (float, "PPO clip range ε"),
    "sft_steps": (int, "supervised warm-start steps"),
    "sft_lr": (float, "supervised warm-start learning rate"),
    "eval_every": (int, "evaluate every this many steps"),
    "eval_prompts": (int, "held-out prompts for greedy exact match"),
    "workers": (int, "parallel worker processes"),
    "threads": (int, "torch threads per process"),
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _method_list(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return tuple(METHODS)
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return names


def _async_mode_list(text: str) -> tuple[str, ...]:
    from rollout_correction.demo.async_runner import ASYNC_MODES

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in ASYNC_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown async mode(s) {unknown}; choose from {', '.join(ASYNC_MODES)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="stale",
                        help="named defaults: stale (fp32 engine 4 optimizer steps behind; default), "
                             "quantized (2-bit per-channel engine, short answers), long (2-bit engine, 16-token answers: "
                             "sequence IS against geometric), bf16-long (bf16 engine, long answers), moe")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (1 seed, the reference pair and the recommended correction, few steps) "
                             "for a first look and CI")
    parser.add_argument("--methods", type=_method_list, default=None,
                        help=f"comma-separated, from: {', '.join(METHODS)}; or 'all' (default: "
                             f"{', '.join(DEFAULT_METHODS)})")
    parser.add_argument("--seeds", type=_int_list, default=None, help="comma-separated seeds (default 0,1,2,3,4)")
    parser.add_argument("--out", default=None,
                        help=f"report folder (default: a new {DEFAULT_OUT}/<date>-<time>/, with "
                             f"{DEFAULT_OUT}/latest pointing at the newest); refused when it holds another "
                             f"report, unless --force")
    parser.add_argument("--force", action="store_true", help="write into an --out that holds another report")
    parser.add_argument("--resume", action="store_true",
                        help="reuse runs already saved in <out>/runs/ (default: in demo-report/latest/) with the "
                             "same settings")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (with a terminal) or progress lines (without one)")
    parser.add_argument("--list-methods", action="store_true", help="print the methods and exit")
    for name, (typ, text) in _FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=text)
    # Asynchronous RL (demo/async_runner.py): synchronous on-policy against async modes, side by side.
    parser.add_argument("--async", dest="async_mode", action="store_true",
                        help="compare synchronous on-policy RL with asynchronous RL (engine and trainer in "
                             "two processes) in wall-clock time; see docs/demo.md")
    parser.add_argument("--async-modes", type=_async_mode_list, default=None,
                        help="with --async: comma-separated modes (default: all; see docs/demo.md)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="with --async: η, batch k is sampled with a policy version ≥ k − η (default 4)")
    parser.add_argument("--queue-size", type=int, default=None,
                        help="with --async: batches the engine may hold ready (default 3)")


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """Scenario defaults, then ``--quick``, then every flag given explicitly."""
    values = dict(SCENARIOS[args.scenario])
    if "methods" not in values:  # the default five, with the scenario's recommended correction among them
        rec = values.get("recommended")
        values["methods"] = DEFAULT_METHODS if rec in DEFAULT_METHODS or rec is None else DEFAULT_METHODS[:-1] + (rec,)
    if args.quick:
        values.update(QUICK_LONG if args.scenario == "long" else QUICK)
        values["methods"] = quick_methods(SCENARIOS[args.scenario])
    for name in _FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.methods is not None:
        values["methods"] = args.methods
    # ``--methods all`` with a dense model: the routing-replay methods have no routers to replay.
    if args.methods == tuple(METHODS) and values.get("model", DemoConfig.model) not in MOE_SIZES:
        values["methods"] = tuple(m for m in METHODS if not METHODS[m].replay)
    if args.seeds is not None:
        values["seeds"] = args.seeds
    return DemoConfig(scenario=args.scenario, out=args.out or DEFAULT_OUT, **values)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dataclasses import replace

    from rollout_correction.console import report_folder
    from rollout_correction.demo.report import print_table, print_unwrapped, write_report
    from rollout_correction.demo.results import provenance
    from rollout_correction.demo.runner import run_experiment

    console = Console()
    if args.list_methods:
        for m in METHODS.values():
            console.print(f"[bold]{m.name}[/bold] ({m.preset or 'no correction'}): {m.description}")
        return 0
    cfg = config_from_args(args)  # a ValueError is one line at the command line (cli.py)
    if args.async_mode and not args.quick:  # the async comparison keeps its own batch, evaluation and seeds
        from rollout_correction.demo.async_runner import ASYNC_DEFAULTS

        cfg = cfg.replace(**{k: v for k, v in ASYNC_DEFAULTS.items() if getattr(args, k) is None})
    acfg = async_config_from_args(args) if args.async_mode else None  # checked before a folder is made
    out = report_folder(args.out, DEFAULT_OUT, REPORT_MARKERS, force=args.force, reuse=args.resume)
    cfg = replace(cfg, out=str(out))
    lines = not args.no_progress and not console.is_terminal  # a log: one plain line per finished unit
    bars = not args.no_progress and console.is_terminal
    command = "rollout-correction demo " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 1 and sys.argv[1] == "demo" else "rollout-correction demo (called from Python)"
    if args.async_mode:
        return run_async(cfg, acfg, console, command, bars, lines)
    n_runs = len(cfg.methods) * len(cfg.seeds)
    print_unwrapped(console, f"[bold]rollout-correction demo[/bold] — scenario {cfg.scenario}: {n_runs} runs "
                  f"({len(cfg.methods)} methods × {len(cfg.seeds)} seeds), {cfg.steps} GRPO steps each, "
                  f"engine {cfg.precision}/{cfg.quant}/lag {cfg.lag}, {cfg.workers} worker(s)")
    t0 = time.perf_counter()
    prov = provenance(command, cfg.workers, cfg.threads)
    print_unwrapped(console, f"report folder: {out}")
    raw = run_experiment(cfg, show_progress=bars, resume=args.resume, provenance=prov, lines=lines)
    summary = write_report(cfg, raw, Path(cfg.out), command, prov)
    print_table(summary, console)
    print_unwrapped(console, f"report: {Path(cfg.out) / 'report.md'}  ({time.perf_counter() - t0:.0f} s)")
    return 0


def async_config_from_args(args: argparse.Namespace):
    """The ``--async`` settings: the quick modes with ``--quick``, then every flag given."""
    from rollout_correction.demo.async_runner import QUICK_ASYNC_MODES, AsyncConfig

    values = {"modes": QUICK_ASYNC_MODES} if args.quick else {}
    for name in ("async_modes", "max_staleness", "queue_size"):
        if getattr(args, name) is not None:
            values["modes" if name == "async_modes" else name] = getattr(args, name)
    return AsyncConfig(**values)


def run_async(cfg: DemoConfig, acfg, console, command: str, bars: bool = True, lines: bool = False) -> int:
    """``--async``: every async mode × seed, one run at a time on the whole machine; then the report."""
    from rollout_correction.demo.async_report import print_table, write_report
    from rollout_correction.demo.async_runner import run_comparison
    from rollout_correction.demo.results import provenance

    console.print(f"[bold]rollout-correction demo --async[/bold] — {len(acfg.modes)} modes × {len(cfg.seeds)} "
                  f"seeds, {cfg.steps} GRPO steps each, η = {acfg.max_staleness}, queue {acfg.queue_size}")
    t0 = time.perf_counter()
    prov = provenance(command, 1, 1)  # one run at a time; each process one torch thread (sync: its own count)
    raw = run_comparison(cfg, acfg, show_progress=bars, console=console, lines=lines)
    summary = write_report(cfg, acfg, raw, Path(cfg.out), command, prov)
    print_table(summary, console)
    console.print(f"report: {Path(cfg.out) / 'async-report.md'}  ({time.perf_counter() - t0:.0f} s)")
    return 0
