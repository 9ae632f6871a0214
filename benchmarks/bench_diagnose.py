"""How long `rollout-correction diagnose` takes on a large dump.

Writes a ragged Parquet file of ``--tokens`` response tokens (default 10M; response lengths
uniform in [1, 2·mean]; trainer log-probs = rollout log-probs + N(0, 0.03²) noise, a few
outlier tokens) in row groups, then runs the command on it ``--repeats`` times in a fresh
process and prints the median wall-clock time (import, read, all presets' what-if, report), the
CPU time of the process (less sensitive to other load on the machine) and the load average.

    python benchmarks/bench_diagnose.py                 # 10M tokens, 3 runs
    python benchmarks/bench_diagnose.py --tokens 2e6 --repeats 1 --format jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def write_dump(path: str, tokens: int, mean_len: int, fmt: str, seed: int = 0) -> tuple[int, int]:
    """Writes the dump group by group (bounded memory); returns (rows, tokens)."""
    rng = np.random.default_rng(seed)
    n_rows, n_tok = 0, 0
    writer = None
    fh = open(path, "w") if fmt == "jsonl" else None
    try:
        while n_tok < tokens:
            lengths = rng.integers(1, 2 * mean_len, size=1024)
            total = int(lengths.sum())
            roll = -rng.exponential(0.8, size=total).astype(np.float32)
            old = (roll + 0.03 * rng.standard_normal(total)).astype(np.float32)
            out = rng.random(total) < 1e-4
            old[out] = roll[out] - 3.0
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            if fmt == "jsonl":
                for i in range(len(lengths)):
                    a, b = offsets[i], offsets[i + 1]
                    fh.write(json.dumps({"rollout_log_probs": roll[a:b].tolist(),
                                         "old_log_probs": old[a:b].tolist()}) + "\n")
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                table = pa.table({
                    "rollout_log_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(roll)),
                    "old_log_probs": pa.ListArray.from_arrays(pa.array(offsets), pa.array(old)),
                })
                if writer is None:
                    writer = pq.ParquetWriter(path, table.schema)
                writer.write_table(table)
            n_rows += len(lengths)
            n_tok += total
    finally:
        if writer is not None:
            writer.close()
        if fh is not None:
            fh.close()
    return n_rows, n_tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=10e6)
    ap.add_argument("--mean-length", type=int, default=500)
    ap.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the diagnose run")
    ap.add_argument("--dir", default=None, help="where to write the dump (default: a temporary directory)")
    args = ap.parse_args()

    tmp = args.dir or tempfile.mkdtemp(prefix="bench_diagnose_")
    os.makedirs(tmp, exist_ok=True)
    path = os.path.join(tmp, f"dump.{args.format}")
    t0 = time.perf_counter()
    rows, tokens = write_dump(path, int(args.tokens), args.mean_length, args.format)
    print(f"wrote {rows:,} rows / {tokens:,} tokens ({os.path.getsize(path) / 1e6:.0f} MB {args.format}) "
          f"in {time.perf_counter() - t0:.1f} s → {path}")
    cmd = [sys.executable, "-m", "rollout_correction.cli", "diagnose", path, "--out", os.path.join(tmp, "report"),
           "--threads", str(args.threads), "--quiet"]
    times, cpu = [], []
    for _ in range(args.repeats):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True)
        times.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    summary = json.load(open(os.path.join(tmp, "report", "summary.json")))
    inner = summary["input"]["elapsed_seconds"]
    med = statistics.median(times)
    print(f"diagnose: median {med:.1f} s over {args.repeats} run(s) (all {len(summary['what_if'])} presets, "
          f"report included; read + statistics {inner:.1f} s), {tokens / med / 1e6:.2f} M tokens/s, "
          f"torch threads {args.threads}")
    print(f"runs: {', '.join(f'{t:.1f}' for t in times)} s wall; CPU time (user + sys) median "
          f"{statistics.median(cpu):.1f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"recommended preset: {summary['recommended_preset']}")


if __name__ == "__main__":
    main()
