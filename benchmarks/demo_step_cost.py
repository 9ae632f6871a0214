"""CPU cost of one demo run under three settings, measured side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py [REPS] [--scenarios S1,S2,...] [--json FILE]

REPS repetitions (default 5); the scenarios among stale (default), quantized and long.

* former: 32 prompts × 8 samples per GRPO step, an evaluation every 25 steps (21 in a 500-step
  run), sampling and the trainer's forward through the model's own ``forward``;
* direct: 16 prompts × 8, an evaluation every 50 steps (11; ``long``: its own 25), the sampler
  calling a dense Llama's layers directly (``demo/model.py: dense_forward``), every row read in full;
* current: as ``direct``, each group's shared prompt read once, by the sampler and by the
  trainer's forward and backward (prefix sharing: ``group_size`` in ``sample`` and
  ``response_log_probs``), and Adam's fused kernel.

The settings alternate, 10 GRPO steps (decoupled token TIS) and one evaluation (512 prompts,
trainer only) at a time, so that a shared machine's load falls on all alike; a run is extrapolated
as its steps + 2 × its evaluations (trainer and engine), without the model set-up (about 1 s).
Ratios are medians over the repetitions of each one's paired runs (the machine's speed drifts).
Each step is also split into phases (``PHASES``: the CPU time inside the calls named there, the
rest is ``other``), the profile of a run before and after.
``--json`` writes the figures with their provenance (``docs/results/cpu-demo-step-cost.json``, rendered
in docs/demo.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import rollout_correction.demo.engine as engine
import rollout_correction.demo.trainer as trainer
from rollout_correction.demo.config import METHODS, SCENARIOS, DemoConfig
from rollout_correction.demo.model import build_model

SETTINGS = {  # name -> (prompts per step, evaluation every k steps (None: the scenario's), direct sampler,
    #                 prefix sharing, fused Adam)
    "former": (32, 25, False, False, False),
    "direct": (16, None, True, False, False),
    "current": (16, None, True, True, True),
}


#: phase -> the calls of a GRPO step whose CPU time it counts, as (owner, attribute); the optimizer's
#: ``step`` is added per optimizer.
PHASES = {
    "sampling": ((engine.RolloutEngine, "generate"),),
    "weight sync": ((engine.RolloutEngine, "sync"),),
    "forward": ((trainer, "response_log_probs"),),
    "backward": ((torch.Tensor, "backward"),),
    "correction and loss": ((trainer, "accepted_mask"), (trainer, "group_advantages"),
                            (trainer, "policy_loss")),
    "optimizer": ((torch.nn.utils, "clip_grad_norm_"),),
    "diagnostics": ((trainer, "weight_ess_by_length"),),
}


def _timed(phases: dict[str, float], opt) -> list[tuple[object, str, object]]:
    """Patches that add the CPU time of each phase's calls to ``phases`` (applied on top of a setting's)."""
    def wrap(phase, fn):
        def timed(*args, **kwargs):
            c = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[phase] += time.process_time() - c
        return timed

    calls = [(phase, owner, name) for phase, pairs in PHASES.items() for owner, name in pairs]
    calls.append(("optimizer", opt, "step"))
    return [(owner, name, wrap(phase, getattr(owner, name))) for phase, owner, name in calls]


def _patched(direct: bool, shared: bool) -> list[tuple[object, str, object]]:
    """(module or class, attribute, replacement) that turn the current code into a setting."""
    patches = []
    if not direct:
        patches.append((engine, "is_dense_llama", lambda model: False))
    if not shared:
        forward, generate = trainer.response_log_probs, engine.RolloutEngine.generate
        patches.append((trainer, "response_log_probs", lambda m, t, p, group_size=1: forward(m, t, p)))
        patches.append((engine.RolloutEngine, "generate",
                        lambda self, *a, group_size=1, **kw: generate(self, *a, **kw)))
    return patches


class _Applied:
    def __init__(self, patches):
        self.patches, self.saved = patches, []

    def __enter__(self):
        for owner, name, value in self.patches:
            self.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def __exit__(self, *exc):
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()


def measure(scenario: str, reps: int) -> dict:
    """Per-setting step and evaluation times (CPU s) of one scenario, and the run they extrapolate to."""
    method = METHODS["token_tis"]
    rc_cfg = trainer.correction_config(method)
    base = DemoConfig(**SCENARIOS[scenario])
    task = base.make_task()
    eval_digits = task.sample_digits(base.eval_prompts, torch.Generator().manual_seed(trainer.EVAL_SEED))
    weights, _ = trainer.sft(base.replace(sft_steps=5), 0, task)
    state = {}
    for name, (prompts, _, _, _, fused) in SETTINGS.items():
        cfg = base.replace(prompts=prompts)
        model = build_model(cfg.model, max_len=task.seq_len + 1)
        model.load_state_dict(weights)
        eng = engine.RolloutEngine(model, cfg.precision, cfg.quant, cfg.lag, cfg.granularity)
        state[name] = (cfg, model, eng, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=fused),
                       torch.Generator().manual_seed(1), ([], [], dict.fromkeys(PHASES, 0.0)))
    names = list(state)
    for rep in range(reps):
        # Rotate the order each repetition, so that no setting always runs first after the others.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            cfg, model, eng, opt, gen, (steps, evals, phases) = state[name]
            with _Applied(_patched(*SETTINGS[name][2:4])), _Applied(_timed(phases, opt)):
                c = time.process_time()
                for _ in range(10):
                    eng.sync(model)
                    trainer.grpo_step(cfg, method, rc_cfg, task, model, eng, opt, gen)
                steps.append((time.process_time() - c) / 10)
                c = time.process_time()
                trainer.exact_match(model, task, eval_digits)
                evals.append(time.process_time() - c)
    out = {"steps": base.steps, "settings": {}}
    for name, (*_, (steps, evals, phases)) in state.items():
        n_eval = base.steps // (SETTINGS[name][1] or base.eval_every) + 1
        step, evaluation = statistics.median(steps), statistics.median(evals)
        per_step = {phase: t / len(steps) / 10 for phase, t in phases.items()}
        per_step["other"] = statistics.fmean(steps) - sum(per_step.values())
        out["settings"][name] = {"step_s": steps, "eval_s": evals, "evaluations": n_eval,
                                 "run_cpu_s": base.steps * step + 2 * n_eval * evaluation,
                                 "phase_s_per_step": per_step}
    # The machine's speed drifts (a shared host): the ratio of each repetition's runs, paired.
    for f in out["settings"].values():
        f["former_over_this"] = paired_ratios(out["settings"]["former"], f, base.steps)
    return out


def paired_ratios(former: dict, this: dict, steps: int) -> list[float]:
    """former's run cost ÷ this setting's, per repetition (the same 10 steps and evaluation pair)."""
    def run(f, i):
        return steps * f["step_s"][i] + 2 * f["evaluations"] * f["eval_s"][i]
    return [run(former, i) / run(this, i) for i in range(len(this["step_s"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reps", type=int, nargs="?", default=5)
    parser.add_argument("--scenarios", default="stale", help="comma-separated: stale, quantized, long")
    parser.add_argument("--json", help="write the figures and their provenance to this file")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in ("stale", "quantized", "long")]
    if unknown or args.reps < 1:
        problem = (f"unknown scenario(s) {unknown}; choose from stale, quantized, long" if unknown
                   else "REPS must be >= 1")
        parser.exit(2, f"demo_step_cost.py: {problem}\n")
    trainer.setup_torch(1)
    load_before = os.getloadavg()
    results = {}
    for scenario in scenarios:
        results[scenario] = r = measure(scenario, args.reps)
        print(f"{scenario}: {r['steps']} steps per run, medians of {args.reps} (10 steps, 1 evaluation each)")
        for name, f in r["settings"].items():
            print(f"  {name:8s} {statistics.median(f['step_s']) * 1000:6.1f} ms per GRPO step, "
                  f"{statistics.median(f['eval_s']) * 1000:4.0f} ms per evaluation; {r['steps']} steps and "
                  f"{f['evaluations']} × 2 evaluations: {f['run_cpu_s']:5.1f} CPU s")
            phases = ", ".join(f"{k} {v * 1000:.1f}" for k, v in f["phase_s_per_step"].items())
            print(f"           {phases} ms")
        ratio = {name: statistics.median(f["former_over_this"]) for name, f in r["settings"].items()}
        print(f"  former / current: {ratio['current']:.2f}×, former / direct: {ratio['direct']:.2f}× "
              "(medians of the paired repetitions)", flush=True)
    if args.json:
        from rollout_correction.demo.results import provenance

        command = "OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py " + " ".join(sys.argv[1:])
        doc = {"provenance": provenance(command, 1, 1), "reps": args.reps,
               "load_average": {"before": load_before, "after": os.getloadavg()}, "scenarios": results}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
