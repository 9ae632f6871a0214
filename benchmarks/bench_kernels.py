"""What the correction launches, counted on the CPU, beside 0.2.0's figures: a regression shows on any machine.

Not a test (``tests/test_kernels.py`` asserts the ceilings): it prints one row per configuration.

* **Compiled pass** (the five configurations of ``benchmarks/bench_gpu.py``, 256×4096 float32):
  ``compute_rollout_correction(..., compile=True)`` called three times with the same shapes after
  ``torch._dynamo.reset()``, counting **graphs** (Dynamo's ``unique_graphs``: a recompilation is a
  second graph), **breaks** (``graph_break`` counters) and **kernels**, Inductor's own
  ``torch._inductor.metrics.generated_kernel_count`` (on the CPU one per fused loop nest, each a GPU
  kernel), with Inductor's caches off so every graph is compiled here. **FX ops**: the operations of
  the graph Dynamo traces (``torch._dynamo.explain`` of the per-token pass).
* **Eager device path** (the nine configurations of ``benchmarks/bench_vs_verl.py``):
  ``compute_rollout_correction(...).metrics_as_floats()`` against verl 0.9.1's
  ``compute_rollout_correction_and_rejection_mask``, ATen operations and host reads counted as in
  ``benchmarks/bench_dispatch.py`` (views and metadata excluded), after one warm-up call. On the CPU
  the core reads two values per block where a read is free and skips the work they fix; a device
  reads nothing. The count is that of a device: the core's CPU-only host reads are switched off
  (``logratio._host_value`` returns None, as it does off the CPU: ``tests/test_no_sync.py``'s
  ``device_path``) and the eager pass walks the batch in the device's blocks (16M tokens: one block
  here, ``correction.BLOCK_TOKENS = DEVICE_BLOCK_TOKENS``). "syncs" is the host reads of the call with
  its metrics read as floats: 1 is that read.

0.2.0's figures (:data:`BASELINE`) were measured with this script on commit 3cb637a
(``--source`` a checkout of it). Usage::

    python benchmarks/bench_kernels.py                       # this checkout
    python benchmarks/bench_kernels.py --json out.json       # also write the rows with their provenance
    python benchmarks/bench_kernels.py --source /tmp/v020    # another checkout (its src/ and core/src/)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: 0.2.0 (commit 3cb637a), this script with ``--source`` on a checkout of it (torch 2.13.0+cpu):
#: per compiled configuration (graphs, breaks, kernels, FX ops), per eager configuration ATen ops.
BASELINE = {
    "commit": "3cb637a",
    "compiled": {"metrics-only": (1, 0, 16, 63), "token TIS": (1, 0, 26, 84), "seq IS + seq_sum_k1": (1, 0, 22, 121),
                 "geo RS + token TIS": (1, 0, 27, 116), "3 chained RS": (1, 0, 33, 136)},
    "eager": {"metrics-only": 42, "token TIS": 65, "sequence TIS": 61, "IcePop": 68, "batch-norm TIS": 74,
              "seq IS + seq_sum_k1": 81, "geometric RS": 66, "k3 RS + TIS": 83, "3 chained RS": 108},
}


def _imports(source: Path):
    sys.path[:0] = [str(source / "src"), str(source / "core" / "src"), str(ROOT / "benchmarks"), str(ROOT / "tests")]
    import torch

    import rollout_correction as rc
    return torch, rc


def _inputs(torch, batch: int, length: int):
    """The inputs of bench_vs_verl.py: log-probs in [−3, 0], an engine off by N(0, 0.05²), right padding."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(batch, length, generator=gen) * 3.0
    rollout = (old + 0.05 * torch.randn(batch, length, generator=gen)).clamp_(max=0.0)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float32)
    return old, rollout, mask


def compiled_row(torch, rc, settings: dict, inputs) -> dict:
    """Graphs, breaks, Inductor kernels and FX ops of the compiled pass of one configuration."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as inductor_metrics
    from torch._dynamo.utils import counters

    inductor_config.fx_graph_cache = False
    cfg = rc.RolloutCorrectionConfig.from_dict(settings)
    torch._dynamo.reset()
    counters.clear()
    inductor_metrics.reset()
    start = time.perf_counter()
    for _ in range(3):  # the same shapes: any further graph is a recompilation
        rc.compute_rollout_correction(*inputs, config=cfg, compile=True).metrics_as_floats()
    row = {"graphs": int(counters["stats"]["unique_graphs"]), "breaks": int(sum(counters["graph_break"].values())),
           "kernels": int(inductor_metrics.generated_kernel_count), "compile_s": time.perf_counter() - start}
    local_pass = _correction_module()._local_pass  # the per-token pass as the library compiles it
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda a, b, c: local_pass(a, b, c, None, None, cfg))(*inputs)
    row["fx_ops"] = sum(len(ops) for ops in explained.ops_per_graph)
    return row


def eager_row(torch, rc, settings: dict, verl_kwargs: dict, inputs, verl) -> dict:
    """ATen operations and host reads of one eager call (device path) and of verl's helper."""
    from bench_dispatch import count

    cfg = rc.RolloutCorrectionConfig.from_dict(settings)
    ours = count(lambda: rc.compute_rollout_correction(*inputs, config=cfg).metrics_as_floats())
    theirs = count(lambda: verl.compute_rollout_correction_and_rejection_mask(*inputs, **verl_kwargs))
    return {"ops": sum(ours.ops.values()), "syncs": ours.syncs, "dynamic": sum(ours.dynamic.values()),
            "verl_ops": sum(theirs.ops.values()), "verl_syncs": theirs.syncs}


def _correction_module():
    """The measured library's correction module (0.2.0 kept it inside ``rollout_correction``)."""
    import importlib

    try:
        return importlib.import_module("rollout_correction._src.correction")
    except ImportError:
        return importlib.import_module("rollout_correction_core._src.correction")


def device_path() -> None:
    """Switch off the core's CPU-only host reads and use the device's block size (module docstring)."""
    correction = _correction_module()
    logratio = sys.modules[correction.__name__.rsplit(".", 1)[0] + ".logratio"]
    if hasattr(logratio, "_host_value"):  # 0.2.0 read nothing on the host
        logratio._host_value = lambda x, read: None
    if hasattr(correction, "DEVICE_BLOCK_TOKENS"):
        correction.BLOCK_TOKENS = correction.DEVICE_BLOCK_TOKENS


def markdown(result: dict) -> str:
    """The two tables of a run (:func:`main`'s rows, as ``--json`` writes them) beside the baseline's figures."""
    base, lines = result["baseline"], []
    if result["compiled"]:
        lines += ["Compiled pass (`compute_rollout_correction(..., compile=True)`, three calls with the same shapes):", "",
                  f"| configuration | graphs | breaks | Inductor kernels | FX ops | 0.2.0 (`{base['commit']}`): graphs, "
                  "breaks, kernels, FX ops |", "|---|---|---|---|---|---|"]
        for name, r in result["compiled"].items():
            lines.append(f"| {name} | {r['graphs']} | {r['breaks']} | {r['kernels']} | {r['fx_ops']} | "
                         f"{', '.join(map(str, base['compiled'][name]))} |")
        lines.append("")
    eager = result["eager"]
    lines += ["Eager device path (host reads off, one 16M-token block): ATen operations / host reads per call, "
              "metrics read as floats:", "",
              f"| configuration | ours | verl 0.9.1 | verl/ours | 0.2.0 (`{base['commit']}`) | verl/0.2.0 |",
              "|---|---|---|---|---|---|"]
    for name, r in eager.items():
        old = base["eager"][name]
        lines.append(f"| {name} | {r['ops']} / {r['syncs']} | {r['verl_ops']} / {r['verl_syncs']} | "
                     f"{r['verl_ops'] / r['ops']:.2f}× | {old} | {r['verl_ops'] / old:.2f}× |")
    ratios = [r["verl_ops"] / r["ops"] for r in eager.values()]
    old = [r["verl_ops"] / base["eager"][n] for n, r in eager.items()]
    lines += ["", f"Geometric mean of verl/ours: {geometric_mean(ratios):.2f}× (lowest {min(ratios):.2f}×); 0.2.0: "
                  f"{geometric_mean(old):.2f}× (lowest {min(old):.2f}×)."]
    return "\n".join(lines)


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="256x4096", help="BxT (default 256x4096)")
    parser.add_argument("--source", default=str(ROOT), help="checkout whose library is measured (default: this one)")
    parser.add_argument("--skip-compiled", action="store_true", help="eager counts only")
    parser.add_argument("--json", default="", help="write the rows and their provenance to this file")
    args = parser.parse_args(argv)
    torch, rc = _imports(Path(args.source).resolve())
    torch.set_num_threads(1)
    from bench_gpu import GPU_CASES
    from bench_vs_verl import CASES
    from verl_reference import load_verl_rollout_corr_helper

    batch, length = (int(x) for x in args.shape.lower().split("x"))
    inputs = _inputs(torch, batch, length)
    print(f"library: {rc.__file__}; torch {torch.__version__}; {batch}x{length} float32, one thread")
    compiled = {} if args.skip_compiled else {c.name: compiled_row(torch, rc, c.settings(), inputs) for c in GPU_CASES}
    device_path()
    verl = load_verl_rollout_corr_helper()
    eager = {c.name: eager_row(torch, rc, c.settings(), c.verl_kwargs(), inputs, verl) for c in CASES}
    print(markdown({"compiled": compiled, "eager": eager, "baseline": BASELINE}))
    if args.json:
        from rollout_correction.demo.results import provenance

        prov = provenance("python benchmarks/bench_kernels.py " + " ".join(sys.argv[1:] if argv is None else argv),
                          workers=1, threads=1)
        prov["load_average"] = os.getloadavg()
        Path(args.json).write_text(json.dumps({"provenance": prov, "shape": args.shape, "compiled": compiled,
                                               "eager": eager, "baseline": BASELINE}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
