"""Peak extra memory and time of one correction call at growing sizes (ours; verl optional).

Not a test: it prints a table. For each (size, dtype, configuration) a fresh subprocess builds
the inputs, runs the call once on a tiny batch (lazy imports), resets the peak-RSS counter
(``/proc/self/clear_refs``), runs ``compute_rollout_correction(...).metrics_as_floats()`` once and
reports the peak RSS minus the RSS before the call, next to the bytes of what the call returns
(the (B, T) weights and mask, which no implementation can avoid). Allocations above 64 KiB are
forced to ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536``) so that freed tensors leave RSS at once and
the peak is the peak of live tensors. The same subprocess then times ``--repeats`` further calls
(median, one thread), so time and memory can be read side by side as the size grows.

Usage::

    python benchmarks/bench_memory.py --shapes 256x8192,512x16384,1024x32768 --dtypes fp32,bf16
    python benchmarks/bench_memory.py --shapes 256x8192 --impls ours,verl --cases "3 chained RS"
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_vs_verl import CASES, DTYPES, _rss_kib, make_inputs, make_runners  # noqa: E402


def _child(spec: dict) -> None:
    torch.set_num_threads(1)
    case = next(c for c in CASES if c.name == spec["case"])
    make_runners(case, make_inputs(4, 64, DTYPES[spec["dtype"]]))[spec["impl"]]()
    inputs = make_inputs(spec["batch"], spec["length"], DTYPES[spec["dtype"]])
    run = make_runners(case, inputs)[spec["impl"]]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before = _rss_kib("VmRSS")
    run()
    peak = _rss_kib("VmHWM")
    times = []
    for _ in range(spec["repeats"]):
        gc.collect()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    # What the call returns: the (B, T) mask (input dtype) and, with IS, the float32 weights.
    out_bytes = inputs[2].element_size() * inputs[2].numel()
    if case.rollout_is is not None:
        out_bytes += 4 * inputs[2].numel()
    print(json.dumps({"extra_mib": (peak - before) / 1024.0, "out_mib": out_bytes / 2**20,
                      "ms": statistics.median(times) if times else float("nan")}))


def measure(case: str, impl: str, batch: int, length: int, dtype: str, repeats: int) -> dict:
    spec = {"case": case, "impl": impl, "batch": batch, "length": length, "dtype": dtype, "repeats": repeats}
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="256x8192,512x16384,1024x32768")
    parser.add_argument("--dtypes", default="fp32")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--impls", default="ours", help="comma-separated: ours, verl")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the measured one")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    cases = [c.name for c in CASES if not wanted or c.name in wanted]
    print("| size | dtype | configuration | impl | returned MiB | peak extra MiB | extra / returned | ms (median) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        batch, length = (int(x) for x in shape.lower().split("x"))
        for dtype in args.dtypes.split(","):
            for case in cases:
                for impl in args.impls.split(","):
                    r = measure(case, impl, batch, length, dtype, args.repeats)
                    print(f"| {shape} | {dtype} | {case} | {impl} | {r['out_mib']:.0f} | {r['extra_mib']:.0f} | "
                          f"{r['extra_mib'] / r['out_mib']:.2f}× | {r['ms']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
