#!/usr/bin/env bash
# The demo's headline results files, in one invocation on one machine and one commit:
#
#     tools/run_demo_results.sh OUT WORKERS [--quick] [--only NAME[,NAME]]
#
# writes every file of src/rollout_correction/demo/headline.py (or those named by --only: default,
# stale, stale-seeds5-9, quantized, long):
#
#   1. OUT/demo-default.json: `rollout-correction demo --no-progress` alone on the machine (its wall
#      time is the README's: run this on otherwise idle cores);
#   2. then OUT/demo-stale.json, OUT/demo-stale-seeds5-9.json, OUT/demo-quantized.json and
#      OUT/demo-long.json: every (file, method, seed) run sharing WORKERS processes of one torch thread
#      each, the most expensive first, one line per finished run; each a demo summary.json with its
#      report beside it in OUT/<name>/, and the plots docs/demo.md shows in OUT/img/.
#
# Then:
#
#     cp OUT/demo-*.json docs/results/ && cp OUT/img/*.png docs/img/
#     python tools/render_results.py
#
# --quick runs everything at a tiny size (two seeds, a few steps) to check the pipeline end to end;
# its files are not results. Run from a clean checkout: the files record the commit.
set -euo pipefail
usage="usage: tools/run_demo_results.sh OUT WORKERS [--quick] [--only NAME[,NAME]]"
if [ $# -lt 2 ]; then echo "$usage" >&2; exit 2; fi
CMDLINE="tools/run_demo_results.sh $*"
OUT=$1 WORKERS=$2 QUICK="" ONLY="default,stale,stale-seeds5-9,quantized,long"
shift 2
case "$WORKERS" in (''|*[!0-9]*|0) echo "run_demo_results.sh: WORKERS must be a positive integer, got '$WORKERS'" >&2; exit 2;; esac
while [ $# -gt 0 ]; do
  case "$1" in
    (--quick) QUICK=--quick; shift;;
    (--only) [ $# -ge 2 ] || { echo "run_demo_results.sh: --only needs a comma-separated list of results files" >&2; exit 2; }
             ONLY=$2; shift 2;;
    (*) echo "run_demo_results.sh: unknown option '$1'; $usage" >&2; exit 2;;
  esac
done
for s in ${ONLY//,/ }; do
  case "$s" in
    (default|stale|stale-seeds5-9|quantized|long) ;;
    (*) echo "run_demo_results.sh: --only: unknown results file '$s' (default, stale, stale-seeds5-9, quantized, long)" >&2; exit 2;;
  esac
done
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH="$PWD/src:$PWD/core/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
if [[ ",$ONLY," == *",default,"* ]]; then
  # The default command first, alone on the machine: its wall time is the README's.
  python -m rollout_correction.cli demo $QUICK --no-progress --force --out "$OUT/default"
  cp "$OUT/default/summary.json" "$OUT/demo-default.json"
  echo "default -> $OUT/demo-default.json"
fi
# The driver runs as ``python -c`` (worker processes are spawned and must not re-run it).
read -r -d '' DRIVER <<'EOF' || true
import argparse, shutil, sys, time
from pathlib import Path

from rollout_correction.demo.cli import add_arguments, config_from_args
from rollout_correction.demo.config import METHODS
from rollout_correction.demo.headline import FIELD_PRESETS, HEADLINES, IMAGES, key
from rollout_correction.demo.report import write_report
from rollout_correction.demo.results import provenance
from rollout_correction.demo.runner import run_many

out, workers, quick, command = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "--quick", sys.argv[5].strip()
only = sys.argv[4].split(",")
missing = [m for m in FIELD_PRESETS if m not in METHODS]
if missing and "quantized" in only:
    print(f"quantized: {', '.join(missing)} not defined at this commit; their rows are left out", flush=True)
parser = argparse.ArgumentParser()
add_arguments(parser)
names, cfgs = [], []
for name, h in HEADLINES.items():
    if h.default_command or key(name) not in only:
        continue
    argv = ["--scenario", h.scenario, "--methods", ",".join(h.methods), "--seeds", ",".join(map(str, h.seeds)),
            "--workers", str(workers), "--threads", "1", "--out", str(out / key(name))]
    if quick:
        argv += ["--seeds", ",".join(map(str, h.seeds[:2])), "--steps", "6", "--eval-every", "3",
                 "--eval-prompts", "32", "--prompts", "4", "--samples", "4", "--sft-steps", "5"]
        argv += ["--tail", "24"] if h.scenario == "long" else []
    names.append(name)
    cfgs.append(config_from_args(parser.parse_args(argv)))
if not cfgs:
    sys.exit(0)
runs = sum(len(c.methods) * len(c.seeds) for c in cfgs)
shape = ", ".join(f"{key(n)}: {len(c.methods)} methods × {len(c.seeds)} seeds" for n, c in zip(names, cfgs))
print(f"{runs} runs ({shape}) on {workers} workers", flush=True)
prov = provenance(command, workers, 1)
t0 = time.perf_counter()


def line(cfg, r, done, total):
    print(f"[{done}/{total}] {time.perf_counter() - t0:5.0f} s  {Path(cfg.out).name} {r['method']} seed {r['seed']}: "
          f"final {r['evals']['trainer'][-1]:.2f}, {r['cpu_seconds']:.0f} CPU s", flush=True)


raws = run_many(cfgs, workers, provenance=prov, on_run=line)
for name, cfg, raw in zip(names, cfgs, raws):
    summary = write_report(cfg, raw, Path(cfg.out), command, prov)
    shutil.copy(Path(cfg.out) / "summary.json", out / name)
    held = [c for c in summary["claims"]["claims"] if c.get("holds")]
    print(f"{key(name)}: {len(held)} of {len(summary['claims']['claims'])} claims hold -> {out / name}", flush=True)
    (out / "img").mkdir(exist_ok=True)
    for src, dst in IMAGES.get(name, {}).items():
        if (Path(cfg.out) / src).is_file():
            shutil.copy(Path(cfg.out) / src, out / "img" / dst)
cpu = sum(r["cpu_seconds"] for raw in raws for r in raw["results"])
print(f"done in {time.perf_counter() - t0:.0f} s; {cpu:.0f} CPU s in the runs ({cpu / runs:.1f} per run)", flush=True)
EOF
exec python -c "$DRIVER" "$OUT" "$WORKERS" "$QUICK" "$ONLY" "$CMDLINE"
