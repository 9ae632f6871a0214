"""What the agreement across ranks costs per call: host reads, collectives and time, against ``verify="once"``.

Not a test: it prints (and with ``--json`` writes) figures. Two gloo ranks (one thread each) run
``compute_rollout_correction`` on a data-parallel group (and, separately, on a context-parallel
group) ``--calls`` times with the same configuration; the first ``--warmup`` calls are left out
(the first call of a kind on a group agrees explicitly, with one read). Per call, in the steady state:

* **reads**: host reads of tensor values (``aten::_local_scalar_dense``, ``Tensor.tolist``,
  ``Tensor.item``), those of the agreement and of the pass alike. On a device a read waits for the
  stream: the number that matters there. ``--path device`` runs what a device runs on the CPU:
  the pass's free CPU reads (``logratio._host_value``) and the agreement's (``stats.reads_are_free``)
  switched off, so the reads counted are the ones a GPU would make;
* **collectives**: ``torch.distributed`` calls (all-reduce, all-gather);
* **ms**: the median wall time per call (rank 0), over the steady-state calls; the settings take turns
  call by call, and each call's time is divided by the same round's ``verify="once"`` time on the same
  group kind and path: the median of those paired ratios is what a shared machine's drift affects least.

Usage::

    python benchmarks/bench_agreement.py                       # 256x1024 fp32, 40 calls
    python benchmarks/bench_agreement.py --json docs/results/cpu-agreement.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [("dp", "once", "cpu"), ("dp", "always", "cpu"), ("dp", "once", "device"), ("dp", "always", "device"),
            ("cp", "once", "cpu"), ("cp", "always", "cpu"), ("cp", "once", "device"), ("cp", "always", "device")]


def rank_main(rank: int, port: int, shape: str, calls: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rollout_correction_core import Parallel, RolloutCorrectionConfig, compute_rollout_correction
    from rollout_correction_core._src import agreement, logratio, stats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    B, T = map(int, shape.split("x"))
    gen = torch.Generator().manual_seed(rank)
    rollout = -torch.rand(B, T, generator=gen) * 2 - 0.01
    old = (rollout + 0.1 * torch.randn(B, T, generator=gen)).clamp(max=-1e-3)
    mask = torch.ones(B, T, dtype=torch.bool)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)
    counts = {"reads": 0, "collectives": 0}
    saved = {}

    def counting(owner, name, key):
        fn = getattr(owner, name)
        saved[(owner, name)] = fn

        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        setattr(owner, name, wrapped)

    for name in ("tolist", "item"):
        counting(torch.Tensor, name, "reads")
    for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather_object"):
        if hasattr(dist, name):
            counting(dist, name, "collectives")
    dense = torch.ops.aten._local_scalar_dense.default  # float(t), bool(t), int(t)

    class Reads(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is dense:
                counts["reads"] += 1
            return func(*args, **(kwargs or {}))

    free_pass, free_agree = logratio._host_value, stats.reads_are_free
    check_pending = agreement.check_pending

    def uncounted_check(group):  # on a GPU the verdict it reads is a pinned host copy: no device read
        before = counts["reads"]
        check_pending(group)
        counts["reads"] = before

    agreement.check_pending = stats.check_pending = uncounted_check
    groups = {setting: dist.new_group([0, 1]) for setting in SETTINGS}
    rows = {setting: {"reads": [], "collectives": [], "ms": []} for setting in SETTINGS}
    for call in range(calls):  # the settings take turns, so that each call is paired with the others'
        for kind, verify, path in SETTINGS:
            group = groups[kind, verify, path]
            logratio._host_value = free_pass if path == "cpu" else (lambda x, read: None)
            stats.reads_are_free = free_agree if path == "cpu" else (lambda device: False)
            parallel = Parallel(dp_group=group, verify=verify) if kind == "dp" else Parallel(cp_group=group,
                                                                                             verify=verify)
            dist.barrier()
            before = dict(counts)
            start = time.perf_counter()
            with Reads():
                compute_rollout_correction(old, rollout, mask, config=cfg, parallel=parallel)
            elapsed = (time.perf_counter() - start) * 1e3
            if call >= warmup:
                row = rows[kind, verify, path]
                row["ms"].append(elapsed)
                for key in ("reads", "collectives"):
                    row[key].append(counts[key] - before[key])
    results = {f"{kind} verify={verify} {path}": {
        "reads": statistics.median(row["reads"]), "collectives": statistics.median(row["collectives"]),
        "ms": statistics.median(row["ms"]), "ms_min": min(row["ms"]), "ms_max": max(row["ms"]),
        "ratio_to_once": statistics.median(a / b for a, b in zip(row["ms"], rows[kind, "once", path]["ms"]))}
        for (kind, verify, path), row in rows.items()}
    agreement.check_pending = stats.check_pending = check_pending
    logratio._host_value, stats.reads_are_free = free_pass, free_agree
    for (owner, name), fn in saved.items():
        setattr(owner, name, fn)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="256x1024")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.calls <= args.warmup:
        print(f"bench_agreement: --calls ({args.calls}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        code = ("import sys; sys.path.insert(0, {!r}); import bench_agreement as b; "
                "b.rank_main({{}}, {}, {!r}, {}, {}, {!r})").format(str(ROOT / "benchmarks"), port, args.shape,
                                                                 args.calls, args.warmup, out)
        procs = [subprocess.Popen([sys.executable, "-c", code.format(r)], env=env) for r in range(2)]
        if any(p.wait(timeout=1800) for p in procs):
            print("bench_agreement: a rank failed", file=sys.stderr)
            return 1
        results = json.loads(Path(out).read_text())
    print(f"{args.shape} fp32, 2 gloo ranks, median of {args.calls - args.warmup} steady-state calls")
    print(f"{'setting':<28} {'reads':>6} {'collectives':>12} {'ms':>8}   {'paired ratio to once':>20}")
    for key, row in results.items():
        print(f"{key:<28} {row['reads']:>6g} {row['collectives']:>12g} {row['ms']:>8.2f}   "
              f"{row['ratio_to_once']:>19.2f}x")
    if args.json:
        sys.path.insert(0, str(ROOT / "src"))
        from rollout_correction.demo.results import provenance

        prov = provenance("python benchmarks/bench_agreement.py " + " ".join(argv or sys.argv[1:]), workers=2,
                          threads=1)
        Path(args.json).write_text(json.dumps({"provenance": prov, "shape": args.shape, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
