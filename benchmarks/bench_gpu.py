"""Time rollout-correction against verl 0.9.1's helper on a CUDA device.

Not a test: it prints one table per (shape, dtype) with, for verl 0.9.1's
``compute_rollout_correction_and_rejection_mask``, our eager call and our ``compile=True`` call:

* **time**: the median of ``--repeats`` calls measured with CUDA events (after ``--warmup``
  calls; the first compiled call of each configuration compiles), calls interleaved round-robin
  (verl, ours, compiled, verl, …). Every call includes reading the metrics as Python floats —
  verl's helper returns floats (it reads each metric with ``.item()``), ours reads them with
  ``metrics_as_floats()``, its one sync — so both are timed up to the same point. "call only" is
  our call without reading the metrics (kernels queued and run; nothing waits on the host);
* **launches**: CUDA kernels per call, counted with ``torch.profiler`` (kernel events of one call
  after the warm-up), and device-to-host copies (each one a host read, i.e. a sync);
* **peak memory**: ``torch.cuda.max_memory_allocated()`` during one call minus the memory
  allocated before it (the inputs): the call's temporaries and its returned weights and mask.

Configurations, on the inputs of ``bench_vs_verl.py`` (log-probs in [−3, 0], an engine off by
N(0, 0.05²) nats per token, right padding with lengths uniform in [T/4, T]): metrics only; token
TIS (C = 2); sequence TIS + ``seq_sum_k1 "0.5_2.0"``; geometric RS (``seq_mean_k1
"0.999_1.001"``) + token TIS; three chained options ``token_k1,seq_mean_k3,seq_max_k2``. verl gets
k1 bounds in its own sign convention (``docs/verl-differences.md`` §1), so both compute the same
masks; the script checks that they do.

verl is the installed package when it imports (``tests/verl_reference.py``), otherwise its two
source files run with stand-ins for the imports they do not use (``benchmarks/verl_light.py``);
the first line printed says which.

Usage::

    python benchmarks/bench_gpu.py                                   # every shape and dtype
    python benchmarks/bench_gpu.py --shapes 256x4096 --dtypes fp32 --repeats 10 --no-compile
    python benchmarks/bench_gpu.py --json results.json --markdown results.md

Needs a CUDA device (it refuses to run without one), verl 0.9.1 and rich.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "core" / "src")]  # the toolkit and the core, from this checkout

import rollout_correction as rc  # noqa: E402
from bench_vs_verl import CASES, Case, geometric_mean, make_inputs  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_BY_NAME = {c.name: c for c in CASES}
GPU_CASES: list[Case] = [
    _BY_NAME["metrics-only"],
    _BY_NAME["token TIS"],
    _BY_NAME["seq IS + seq_sum_k1"],
    Case("geo RS + token TIS", rollout_is="token", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    _BY_NAME["3 chained RS"],
]
IMPLS = ("verl", "ours", "compiled")


def load_verl() -> tuple[Any, Callable, str]:
    """(helper module, weights getter, description)."""
    from verl_reference import VerlUnavailable, load_verl_rollout_corr_helper

    try:
        helper = load_verl_rollout_corr_helper()
        return helper, lambda r: None if r[0] is None else r[0].batch["rollout_is_weights"], \
            "verl 0.9.1, the installed package"
    except VerlUnavailable as exc:
        import verl_light

        helper = verl_light.load_rollout_corr_helper()
        return helper, verl_light.weights_of, \
            f"verl 0.9.1's helper files with stand-ins for unused imports (benchmarks/verl_light.py; {exc})"


def make_runners(case: Case, inputs, helper, compile_: bool) -> dict[str, Callable[[], Any]]:
    old, rollout, mask = inputs
    cfg = rc.RolloutCorrectionConfig.from_dict(case.settings())
    kwargs = case.verl_kwargs()
    runners = {
        "verl": lambda: helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs),
        "ours": lambda: rc.compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats(),
        "call only": lambda: rc.compute_rollout_correction(old, rollout, mask, config=cfg),
    }
    if compile_:
        runners["compiled"] = lambda: rc.compute_rollout_correction(old, rollout, mask, config=cfg,
                                                                    compile=True).metrics_as_floats()
    return runners


def time_cuda(runners: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, float]:
    """Median milliseconds per runner between two CUDA events, calls interleaved round-robin."""
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end))
            del result
    return {name: statistics.median(v) for name, v in samples.items()}


def count_launches(fn: Callable[[], Any]) -> tuple[int, int]:
    """(CUDA kernels, device-to-host copies) of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = d2h = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name
        if name.startswith("Memcpy"):
            d2h += "DtoH" in name
        elif not name.startswith("Memset"):
            kernels += 1
    return kernels, d2h


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak allocated MiB of one call above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def check_agreement(case: Case, inputs, helper, weights_of) -> str:
    """Whether verl and ours give the same mask, and the largest relative weight difference."""
    old, rollout, mask = inputs
    theirs = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **case.verl_kwargs())
    ours = rc.compute_rollout_correction(old, rollout, mask, config=rc.RolloutCorrectionConfig.from_dict(case.settings()))
    same_mask = torch.equal(theirs[1].to(ours.response_mask.dtype), ours.response_mask)
    w_theirs = weights_of(theirs)
    if w_theirs is None or ours.weights is None:
        return "mask equal" if same_mask else "MASKS DIFFER"
    rel = float(((w_theirs.float() - ours.weights).abs() / w_theirs.float().abs().clamp_min(1e-30)).max())
    return ("mask equal" if same_mask else "MASKS DIFFER") + f", weights ≤{rel:.0e}"


def run(args) -> list[dict[str, Any]]:
    helper, weights_of, verl_desc = load_verl()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | CUDA {torch.version.cuda} | {verl_desc}",
          flush=True)
    results = []
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.lower().split("x"))
        for dtype_name in args.dtypes.split(","):
            cpu = make_inputs(B, T, DTYPES[dtype_name])
            inputs = tuple(t.cuda() for t in cpu)
            del cpu
            input_mib = sum(t.numel() * t.element_size() for t in inputs) / 2**20
            for case in GPU_CASES:
                if args.configs and case.name not in args.configs.split(","):
                    continue
                t0 = time.perf_counter()
                # Each configuration starts from an empty compile cache, as a trainer with one
                # configuration does: the compiled passes of all configurations are one function, and
                # past torch's recompile limit (8) a further one would run eagerly.
                torch._dynamo.reset()
                runners = make_runners(case, inputs, helper, not args.no_compile)
                row: dict[str, Any] = {"shape": shape, "dtype": dtype_name, "case": case.name,
                                       "input_mib": input_mib}
                row["agreement"] = check_agreement(case, inputs, helper, weights_of)
                row.update({f"{k} ms": v for k, v in time_cuda(runners, args.repeats, args.warmup).items()})
                for impl in [i for i in IMPLS if i in runners]:
                    row[f"{impl} kernels"], row[f"{impl} d2h"] = count_launches(runners[impl])
                    row[f"{impl} MiB"] = peak_mib(runners[impl])
                row["call only kernels"], row["call only d2h"] = count_launches(runners["call only"])
                results.append(row)
                if args.json:  # after every row, so that an interrupted run keeps what it measured
                    Path(args.json).write_text(json.dumps(results, indent=1))
                print(f"  {shape} {dtype_name} {case.name}: verl {row['verl ms']:.2f} ms, ours {row['ours ms']:.2f} ms"
                      + (f", compiled {row['compiled ms']:.2f} ms" if "compiled ms" in row else "")
                      + f"; {row['agreement']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            del inputs
            torch.cuda.empty_cache()
    return results


COLUMNS = [
    ("configuration", lambda r: r["case"]),
    ("verl ms", lambda r: f"{r['verl ms']:.2f}"),
    ("ours ms", lambda r: f"{r['ours ms']:.2f}"),
    ("verl/ours", lambda r: f"{r['verl ms'] / r['ours ms']:.1f}×"),
    ("compiled ms", lambda r: f"{r['compiled ms']:.2f}" if "compiled ms" in r else "–"),
    ("verl/compiled", lambda r: f"{r['verl ms'] / r['compiled ms']:.1f}×" if "compiled ms" in r else "–"),
    ("call only ms", lambda r: f"{r['call only ms']:.2f}"),
    ("kernels verl / ours / compiled", lambda r: f"{r['verl kernels']} / {r['ours kernels']} / "
                                                 f"{r.get('compiled kernels', '–')}"),
    ("D2H copies verl / ours / compiled", lambda r: f"{r['verl d2h']} / {r['ours d2h']} / {r.get('compiled d2h', '–')}"),
    ("call-only kernels / D2H", lambda r: f"{r['call only kernels']} / {r['call only d2h']}"),
    ("peak MiB verl / ours / compiled", lambda r: f"{r['verl MiB']:.0f} / {r['ours MiB']:.0f} / "
                                                  + (f"{r['compiled MiB']:.0f}" if "compiled MiB" in r else "–")),
    ("verl/ours MiB", lambda r: f"{r['verl MiB'] / max(r['ours MiB'], 1e-3):.1f}×"),
    ("agreement", lambda r: r["agreement"]),
]


def groups(results):
    for key in dict.fromkeys((r["shape"], r["dtype"]) for r in results):
        yield key, [r for r in results if (r["shape"], r["dtype"]) == key]


def summary(rows) -> str:
    text = f"geometric-mean speed-up over verl: eager {geometric_mean([r['verl ms'] / r['ours ms'] for r in rows]):.1f}×"
    if all("compiled ms" in r for r in rows):
        text += f", compiled {geometric_mean([r['verl ms'] / r['compiled ms'] for r in rows]):.1f}×"
    return text


def markdown(results) -> str:
    out = []
    for (shape, dtype), rows in groups(results):
        lines = [f"**{shape} {dtype}** (inputs {rows[0]['input_mib']:.0f} MiB)", "",
                 "| " + " | ".join(name for name, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cell(r) for _, cell in COLUMNS) + " |" for r in rows]
        lines += ["", summary(rows)]
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def print_tables(results) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=260)
    for (shape, dtype), rows in groups(results):
        table = Table(title=f"{shape} {dtype} (inputs {rows[0]['input_mib']:.0f} MiB)")
        for name, _ in COLUMNS:
            table.add_column(name, justify="left" if name in ("configuration", "agreement") else "right")
        for r in rows:
            table.add_row(*(cell(r) for _, cell in COLUMNS))
        console.print(table)
        console.print(summary(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x4096,1024x8192,1024x32768", help="comma-separated BxT")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of: " + ",".join(DTYPES))
    parser.add_argument("--configs", default="", help="comma-separated configuration names (default: all): "
                        + ", ".join(c.name for c in GPU_CASES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="leave out our compile=True path")
    parser.add_argument("--json", metavar="OUT", help="write the raw results as JSON")
    parser.add_argument("--markdown", metavar="OUT", help="write the tables as Markdown")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device: torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). "
              "For the CPU comparison run benchmarks/bench_vs_verl.py.", file=sys.stderr)
        return 2
    results = run(args)
    print_tables(results)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
