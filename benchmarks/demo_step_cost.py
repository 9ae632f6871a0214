"""CPU cost of one demo run under three settings, measured side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py [REPS] [--scenario stale|quantized|long]

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
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rollout_correction.demo.engine as engine
import rollout_correction.demo.trainer as trainer
from rollout_correction.demo.config import METHODS, SCENARIOS, DemoConfig
from rollout_correction.demo.model import build_model
from rollout_correction.demo.task import Task

SETTINGS = {  # name -> (prompts per step, evaluation every k steps (None: the scenario's), direct sampler,
    #                 prefix sharing, fused Adam)
    "former": (32, 25, False, False, False),
    "direct": (16, None, True, False, False),
    "current": (16, None, True, True, True),
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reps", type=int, nargs="?", default=5)
    parser.add_argument("--scenario", default="stale", choices=("stale", "quantized", "long"))
    args = parser.parse_args()
    trainer.setup_torch(1)
    method = METHODS["token_tis"]
    rc_cfg = trainer.correction_config(method)
    base = DemoConfig(**SCENARIOS[args.scenario])
    task = Task(base.task, base.digits, base.reward)
    eval_digits = task.sample_digits(base.eval_prompts, torch.Generator().manual_seed(trainer.EVAL_SEED))
    weights, _ = trainer.sft(base.replace(sft_steps=5), 0, task)
    state = {}
    for name, (prompts, _, _, _, fused) in SETTINGS.items():
        cfg = base.replace(prompts=prompts)
        model = build_model(cfg.model, max_len=task.seq_len + 1)
        model.load_state_dict(weights)
        eng = engine.RolloutEngine(model, cfg.precision, cfg.quant, cfg.lag, cfg.granularity)
        state[name] = (cfg, model, eng, torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=fused),
                       torch.Generator().manual_seed(1), ([], []))
    for _ in range(args.reps):
        for name, (cfg, model, eng, opt, gen, (steps, evals)) in state.items():
            with _Applied(_patched(*SETTINGS[name][2:4])):
                c = time.process_time()
                for _ in range(10):
                    eng.sync(model)
                    trainer.grpo_step(cfg, method, rc_cfg, task, model, eng, opt, gen)
                steps.append((time.process_time() - c) / 10)
                c = time.process_time()
                trainer.exact_match(model, task, eval_digits)
                evals.append(time.process_time() - c)
    n_steps = base.steps
    print(f"{args.scenario}: {n_steps} steps per run, medians of {args.reps} (10 steps, 1 evaluation each)")
    runs = {}
    for name, (*_, (steps, evals)) in state.items():
        step, evaluation = statistics.median(steps), statistics.median(evals)
        n_eval = n_steps // (SETTINGS[name][1] or base.eval_every) + 1
        runs[name] = n_steps * step + 2 * n_eval * evaluation
        print(f"  {name:8s} {step * 1000:6.1f} ms per GRPO step, {evaluation * 1000:4.0f} ms per evaluation; "
              f"{n_steps} steps and {n_eval} × 2 evaluations: {runs[name]:5.1f} CPU s")
    print(f"  former / current: {runs['former'] / runs['current']:.2f}×, "
          f"direct / current: {runs['direct'] / runs['current']:.2f}×")


if __name__ == "__main__":
    main()
