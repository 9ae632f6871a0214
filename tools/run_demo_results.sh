#!/usr/bin/env bash
# The demo's headline results files, in one invocation on one machine and one commit:
#
#     tools/run_demo_results.sh OUT WORKERS [--quick] [--only SCENARIO[,SCENARIO]]
#
# runs the stale, quantized and long scenarios (or those named by --only) with every method listed below on seeds 0-4 (one
# process per run, one torch thread each, all scenarios' runs sharing WORKERS processes, the most
# expensive first), prints one line per finished run, and writes OUT/demo-stale.json,
# OUT/demo-quantized.json, OUT/demo-long.json (each a demo summary.json, with its report beside it
# in OUT/<scenario>/) and OUT/demo-long-by-length.png. Then:
#
#     cp OUT/demo-*.json docs/results/ && cp OUT/demo-long-by-length.png docs/img/
#     python tools/render_results.py
#
# --quick runs every scenario at a tiny size (two seeds, a few steps) to check the pipeline end to
# end; its files are not results. Run from a clean checkout: the files record the commit.
set -euo pipefail
usage="usage: tools/run_demo_results.sh OUT WORKERS [--quick] [--only SCENARIO[,SCENARIO]]"
if [ $# -lt 2 ]; then echo "$usage" >&2; exit 2; fi
CMDLINE="tools/run_demo_results.sh $*"
OUT=$1 WORKERS=$2 QUICK="" ONLY="stale,quantized,long"
shift 2
case "$WORKERS" in (''|*[!0-9]*|0) echo "run_demo_results.sh: WORKERS must be a positive integer, got '$WORKERS'" >&2; exit 2;; esac
while [ $# -gt 0 ]; do
  case "$1" in
    (--quick) QUICK=--quick; shift;;
    (--only) [ $# -ge 2 ] || { echo "run_demo_results.sh: --only needs a comma-separated list of scenarios" >&2; exit 2; }
             ONLY=$2; shift 2;;
    (*) echo "run_demo_results.sh: unknown option '$1'; $usage" >&2; exit 2;;
  esac
done
for s in ${ONLY//,/ }; do
  case "$s" in (stale|quantized|long) ;; (*) echo "run_demo_results.sh: --only: unknown scenario '$s' (stale, quantized, long)" >&2; exit 2;; esac
done
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONPATH="$PWD/src:$PWD/core/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
# The driver runs as ``python -c`` (worker processes are spawned and must not re-run it).
read -r -d '' DRIVER <<'EOF' || true
import argparse, json, shutil, sys, time
from pathlib import Path

from rollout_correction.demo.cli import add_arguments, config_from_args
from rollout_correction.demo.report import write_report
from rollout_correction.demo.results import provenance
from rollout_correction.demo.runner import run_many

out, workers, quick, command = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "--quick", sys.argv[5].strip()
only = sys.argv[4].split(",")
# Every listed method on five seeds. Aliases at one update per batch (GSPO, CISPO, DPPO-TV/-KL, seq
# TIS; config.ALIASES) run only in the several-updates table; the newer criteria run in stale. 155
# runs; the CPU time each took is in docs/demo.md's Time table (benchmarks/demo_step_cost.py splits it).
METHODS = {
    "stale": "on_policy,naive,bypass_ppo,token_tis,seq_is_rs,geo_rs,pure_is,icepop,geo_is,opsm,m2po,topr,"
             "binary_kl_rs,veto2,kpop_rs,dp_rs,lp_err_rs,minpro,rollout_is",
    "quantized": "on_policy,naive,token_tis,bypass_ppo,icepop,m2po",
    "long": "on_policy,naive,token_tis,seq_is,geo_is,geo_rs_long",
}
SEEDS = "0,1,2,3,4"
parser = argparse.ArgumentParser()
add_arguments(parser)
cfgs = []
for scenario, methods in METHODS.items():
    if scenario not in only:
        continue
    argv = ["--scenario", scenario, "--methods", methods, "--seeds", SEEDS, "--workers", str(workers),
            "--threads", "1", "--out", str(out / scenario)]
    if quick:
        argv += ["--seeds", "0,1", "--steps", "6", "--eval-every", "3", "--eval-prompts", "32", "--prompts", "4",
                 "--samples", "4", "--sft-steps", "5"] + (["--digits", "8"] if scenario == "long" else [])
    cfgs.append(config_from_args(parser.parse_args(argv)))
runs = sum(len(c.methods) * len(c.seeds) for c in cfgs)
print(f"{runs} runs ({', '.join(f'{c.scenario}: {len(c.methods)} methods × {len(c.seeds)} seeds' for c in cfgs)}) "
      f"on {workers} workers", flush=True)
prov = provenance(command, workers, 1)
t0 = time.perf_counter()


def line(cfg, r, done, total):
    print(f"[{done}/{total}] {time.perf_counter() - t0:5.0f} s  {cfg.scenario} {r['method']} seed {r['seed']}: final "
          f"{r['evals']['trainer'][-1]:.2f}, {r['cpu_seconds']:.0f} CPU s", flush=True)


raws = run_many(cfgs, workers, provenance=prov, on_run=line)
for cfg, raw in zip(cfgs, raws):
    summary = write_report(cfg, raw, out / cfg.scenario, command, prov)
    shutil.copy(out / cfg.scenario / "summary.json", out / f"demo-{cfg.scenario}.json")
    held = [c for c in summary["claims"]["claims"] if c.get("holds")]
    print(f"{cfg.scenario}: {len(held)} of {len(summary['claims']['claims'])} claims hold -> {out / f'demo-{cfg.scenario}.json'}",
          flush=True)
if (out / "long" / "by_length.png").is_file():
    shutil.copy(out / "long" / "by_length.png", out / "demo-long-by-length.png")
cpu = sum(r["cpu_seconds"] for raw in raws for r in raw["results"])
print(f"done in {time.perf_counter() - t0:.0f} s; {cpu:.0f} CPU s in the runs ({cpu / runs:.1f} per run)", flush=True)
EOF
exec python -c "$DRIVER" "$OUT" "$WORKERS" "$QUICK" "$ONLY" "$CMDLINE"
