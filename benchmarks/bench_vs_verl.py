"""Time rollout-correction against verl 0.9.1's ``rollout_corr_helper`` on the same inputs.

Not a test: it prints medians and ratios. Both implementations run in the same process,
one thread, on identical tensors; calls are interleaved (verl, ours, floor, verl, ours, ...)
so that machine noise hits all of them alike, and every timed call starts from cold caches (a
64 MiB write before it). The script re-runs itself with fixed glibc allocator settings
(``STEADY_MALLOC``: freed memory is kept and reused, as a caching allocator does), because with
the defaults the cost of page faults for fresh temporaries depends on the process's history
(``--system-malloc`` keeps the defaults). verl's helper returns Python floats, so our
timing includes ``metrics_as_floats()`` (the single device sync) to compare like with like.

The floor is one streaming pass over the inputs, ``old - rollout``: no correction can be
faster than reading its two inputs once. "ours (eager)" is the default call; "compiled" the same
call with ``compile=True`` (``--compile``).

Peak extra memory is measured in a fresh subprocess per (implementation, configuration):
inputs are built, the peak-RSS counter is reset (``/proc/self/clear_refs``), the call runs
once, and the growth of the peak over the resident size before the call is reported.

Usage::

    python benchmarks/bench_vs_verl.py                      # 256x4096 fp32 + bf16, all configurations
    python benchmarks/bench_vs_verl.py --shapes 512x8192 --repeats 5
    python benchmarks/bench_vs_verl.py --compile            # adds our torch.compile path
    python benchmarks/bench_vs_verl.py --memory             # adds peak extra memory (subprocesses)

Requires verl 0.9.1 (see tests/verl_reference.py for the install line) and rich.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "core" / "src")]  # the toolkit and the core, from this checkout

from verl_reference import load_verl_rollout_corr_helper, verl_equivalent_rs_threshold  # noqa: E402

import rollout_correction as rc  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One benchmark configuration (our keys; verl gets the same semantics, see verl_kwargs)."""

    name: str
    rollout_is: str | None = None
    rollout_is_threshold: str | float | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None

    def settings(self) -> dict[str, Any]:
        return {
            "rollout_is": self.rollout_is,
            "rollout_is_threshold": self.rollout_is_threshold,
            "rollout_is_batch_normalize": self.rollout_is_batch_normalize,
            "rollout_rs": self.rollout_rs,
            "rollout_rs_threshold": self.rollout_rs_threshold,
        }

    def verl_kwargs(self) -> dict[str, Any]:
        """verl's arguments for the same correction (k1 bounds in verl's sign convention)."""
        kwargs = self.settings()
        kwargs["rollout_rs_threshold"] = verl_equivalent_rs_threshold(self.rollout_rs, self.rollout_rs_threshold)
        return kwargs


CASES: list[Case] = [
    Case("metrics-only"),
    Case("token TIS", rollout_is="token"),
    Case("sequence TIS", rollout_is="sequence"),
    Case("IcePop", rollout_is="token", rollout_is_threshold="0.5_5.0"),
    Case("batch-norm TIS", rollout_is="token", rollout_is_batch_normalize=True),
    Case("seq IS + seq_sum_k1", rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    Case("geometric RS", rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    Case("k3 RS + TIS", rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    Case(
        "3 chained RS",
        rollout_rs="token_k1,seq_mean_k3,seq_max_k2",
        rollout_rs_threshold="0.5_2.0,0.01,2.0",
    ),
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(batch: int, length: int, dtype: torch.dtype, seed: int = 0):
    """Log-probs of a plausible policy, a rollout engine off by ~0.05 nats (at most 0, as every
    log-prob: a positive one drops its row under the default log_prob_ceiling), right padding."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen) * 3.0
    rollout = (old + 0.05 * torch.randn(batch, length, generator=gen)).clamp_(max=0.0)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float32)
    return old.to(dtype), rollout.to(dtype), mask


def our_config(case: Case) -> "rc.RolloutCorrectionConfig":
    return rc.RolloutCorrectionConfig.from_dict(case.settings())


def make_runners(case: Case, inputs, compiled: bool = False) -> dict[str, Callable[[], Any]]:
    old, rollout, mask = inputs
    verl = load_verl_rollout_corr_helper()
    cfg = our_config(case)
    kwargs = case.verl_kwargs()

    def run_verl():
        return verl.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)

    def run_ours():
        out = rc.compute_rollout_correction(old, rollout, mask, config=cfg)
        return out.metrics_as_floats()

    def run_floor():
        return old - rollout

    runners = {"verl": run_verl, "ours": run_ours, "floor": run_floor}
    if compiled and _has_compile_path():

        def run_compiled():
            out = rc.compute_rollout_correction(old, rollout, mask, config=cfg, compile=True)
            return out.metrics_as_floats()

        runners["ours (compiled)"] = run_compiled
    return runners


def _has_compile_path() -> bool:
    """Whether the core offers ``compute_rollout_correction(..., compile=True)``."""
    return "compile" in inspect.signature(rc.compute_rollout_correction).parameters


#: Written before every timed call so that each call starts with cold caches (64 MiB, twice the
#: last-level cache of the development machine): no runner inherits data another left in cache.
_FLUSH = torch.zeros(16 << 20)


def flush_caches() -> None:
    _FLUSH.add_(1.0)


def time_interleaved(runners: dict[str, Callable[[], Any]], repeats: int, warmup: int) -> dict[str, float]:
    """Median wall time (ms) of each runner, calls interleaved round-robin, each call from cold
    caches. Also ``floor (hot)``: the floor called again right after itself (inputs in cache)."""
    for _ in range(warmup):
        for fn in runners.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    samples["floor (hot)"] = []
    for _ in range(repeats):
        for name, fn in runners.items():
            cheap = name == "floor"
            for _ in range(4 if cheap else 1):  # the floor is cheap: sample it more often
                gc.collect()
                flush_caches()
                start = time.perf_counter()
                fn()
                samples[name].append((time.perf_counter() - start) * 1e3)
                if cheap:
                    start = time.perf_counter()
                    fn()
                    samples["floor (hot)"].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items() if values}


# ----------------------------------------------------------------------------- memory


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(spec: dict) -> None:
    torch.set_num_threads(1)
    case = next(c for c in CASES if c.name == spec["case"])
    small = make_inputs(4, 64, DTYPES[spec["dtype"]])
    inputs = make_inputs(spec["batch"], spec["length"], DTYPES[spec["dtype"]])
    for warm in (small,):  # load lazy modules / kernels on a tiny batch
        make_runners(case, warm)[spec["impl"]]()
    run = make_runners(case, inputs)[spec["impl"]]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _rss_kib("VmRSS")
    result = run()
    peak = _rss_kib("VmHWM")
    del result
    print(json.dumps({"extra_mib": (peak - before) / 1024.0}))


def measure_memory(case: Case, impl: str, batch: int, length: int, dtype: str) -> float:
    spec = {"case": case.name, "impl": impl, "batch": batch, "length": length, "dtype": dtype}
    # Not the timings' STEADY_MALLOC: its top pad (64 MiB added to every heap extension) makes the
    # resident size depend on where small allocations land, and measured 10-40 MiB for one same call.
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TOP_PAD_"}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(
        [sys.executable, __file__, "--memory-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["extra_mib"]


# ----------------------------------------------------------------------------- allocator

#: glibc malloc settings for the timings: every freed block stays in the process and is reused,
#: so no call pays page faults for fresh memory. Without them the result depends on the process's
#: history: glibc raises its mmap threshold only after freeing a large mmapped block, and returns
#: memory above its trim threshold to the system, so the same (B, T) temporaries are sometimes
#: reused and sometimes faulted in again (verl's helper took 14 ms or 50 ms for the same
#: metrics-only call on an idle machine, depending on what had run before). A trainer's caching
#: allocator (PyTorch's on GPU) reuses memory, which is what the fixed settings model.
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 33),
                 "MALLOC_TOP_PAD_": str(1 << 26)}


def steady_allocator(argv: list[str]) -> None:
    """Re-run this script with :data:`STEADY_MALLOC` unless it is already in effect."""
    if all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], {**os.environ, **STEADY_MALLOC})


# ----------------------------------------------------------------------------- main


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def markdown_tables(results: list[dict[str, Any]]) -> str:
    """One Markdown table per (shape, dtype): medians in ms, ratios, peak extra MiB."""
    out = []
    for key in dict.fromkeys((r["shape"], r["dtype"]) for r in results):
        rows = [r for r in results if (r["shape"], r["dtype"]) == key]
        compiled = any("ours (compiled)" in r for r in rows)
        memory = any("verl_mib" in r for r in rows)
        head = ["configuration", "verl 0.9.1 ms", "ours ms", "verl/ours", "ours/floor"]
        if compiled:
            head += ["compiled ms", "verl/compiled", "compiled/floor"]
        if memory:
            head += ["verl MiB", "ours MiB", "verl/ours MiB"]
        floor = statistics.median(r["floor"] for r in rows)
        hot = statistics.median(r["floor (hot)"] for r in rows)
        lines = [f"**{key[0]} {key[1]}** (floor `old - rollout`: {floor:.2f} ms from cold caches, {hot:.2f} ms hot)",
                 "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [r["case"], f"{r['verl']:.1f}", f"{r['ours']:.1f}", f"{r['verl'] / r['ours']:.1f}×",
                     f"{r['ours'] / r['floor']:.0f}×"]
            if compiled:
                c = r.get("ours (compiled)")
                cells += [f"{c:.1f}", f"{r['verl'] / c:.1f}×", f"{c / r['floor']:.0f}×"] if c else ["n/a"] * 3
            if memory:
                cells += [f"{r['verl_mib']:.0f}", f"{r['ours_mib']:.0f}", f"{r['verl_mib'] / max(r['ours_mib'], 1e-3):.1f}×"]
            lines.append("| " + " | ".join(cells) + " |")
        speed = geometric_mean([r["verl"] / r["ours"] for r in rows])
        lines.append("")
        lines.append(f"Geometric-mean speed-up of eager over verl: {speed:.1f}×"
                     + (f"; compiled: {geometric_mean([r['verl'] / r['ours (compiled)'] for r in rows if 'ours (compiled)' in r]):.1f}×" if compiled else ""))
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x4096", help="comma-separated BxT, e.g. 256x4096,512x8192")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per implementation")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--compile", action="store_true", help="also time our torch.compile path")
    parser.add_argument("--memory", action="store_true", help="also measure peak extra memory (subprocesses)")
    parser.add_argument("--json", default="", help="write raw results to this file")
    parser.add_argument("--markdown", default="", help="write the tables as Markdown to this file")
    parser.add_argument("--system-malloc", action="store_true",
                        help="time with glibc's default (history-dependent) allocator settings")
    parser.add_argument("--memory-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_child:
        _memory_child(json.loads(args.memory_child))
        return 0
    if not args.system_malloc:
        steady_allocator(sys.argv[1:] if argv is None else argv)

    from rich.console import Console
    from rich.table import Table

    torch.set_num_threads(1)
    load_start = os.getloadavg()
    console = Console(width=200)
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    cases = [c for c in CASES if not wanted or c.name in wanted]
    results: list[dict[str, Any]] = []

    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.lower().split("x"))
        for dtype_name in args.dtypes.split(","):
            inputs = make_inputs(batch, length, DTYPES[dtype_name])
            table = Table(title=f"{batch}x{length} {dtype_name}, 1 thread, median of {args.repeats} (ms)")
            for col in ("configuration", "verl 0.9.1", "ours (eager)", "verl/ours", "ours/floor"):
                table.add_column(col, justify="right" if col != "configuration" else "left")
            if args.compile:
                table.add_column("ours (compiled)", justify="right")
                table.add_column("verl/compiled", justify="right")
                table.add_column("compiled/floor", justify="right")
            if args.memory:
                table.add_column("verl MiB", justify="right")
                table.add_column("ours MiB", justify="right")
                table.add_column("mem ratio", justify="right")
            speedups, compiled_speedups = [], []
            for case in cases:
                if args.compile:
                    # A trainer compiles one configuration; start each case from an empty
                    # compile cache so that no case runs into dynamo's recompile limit.
                    torch._dynamo.reset()
                runners = make_runners(case, inputs, compiled=args.compile)
                med = time_interleaved(runners, args.repeats, args.warmup)
                row = {"shape": shape, "dtype": dtype_name, "case": case.name, **med}
                speedups.append(med["verl"] / med["ours"])
                cells = [
                    case.name,
                    f"{med['verl']:.2f}",
                    f"{med['ours']:.2f}",
                    f"{med['verl'] / med['ours']:.1f}x",
                    f"{med['ours'] / med['floor']:.0f}x",
                ]
                if args.compile:
                    if "ours (compiled)" in med:
                        c = med["ours (compiled)"]
                        compiled_speedups.append(med["verl"] / c)
                        cells += [f"{c:.2f}", f"{med['verl'] / c:.1f}x", f"{c / med['floor']:.0f}x"]
                    else:
                        cells += ["n/a", "", ""]
                if args.memory:
                    mv = measure_memory(case, "verl", batch, length, dtype_name)
                    mo = measure_memory(case, "ours", batch, length, dtype_name)
                    row.update(verl_mib=mv, ours_mib=mo)
                    cells += [f"{mv:.0f}", f"{mo:.0f}", f"{mv / max(mo, 1e-3):.1f}x"]
                table.add_row(*cells)
                results.append(row)
            console.print(table)
            console.print(
                f"floor (old - rollout): {med['floor']:.3f} ms from cold caches, {med['floor (hot)']:.3f} ms hot; "
                f"geometric-mean speed-up over verl: {geometric_mean(speedups):.1f}x eager"
                + (f", {geometric_mean(compiled_speedups):.1f}x compiled" if compiled_speedups else "")
            )
            del inputs
    if args.json:  # the rows, with where and how they were measured (tools/render_results.py renders them)
        from rollout_correction.demo.results import provenance

        prov = provenance("python benchmarks/bench_vs_verl.py " + " ".join(sys.argv[1:]), workers=1, threads=1)
        prov.update(verl=importlib.metadata.version("verl"), load_average=[load_start, os.getloadavg()])
        Path(args.json).write_text(json.dumps({"provenance": prov, "rows": results}, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown_tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
