"""CPU cost of one demo run, former settings against current ones, measured in one process.

    OMP_NUM_THREADS=1 python benchmarks/demo_step_cost.py [REPS]

Former: 32 prompts × 8 samples per GRPO step, an evaluation every 25 steps (21 in a 500-step run),
sampling through the model's own forward. Current: 16 prompts × 8, an evaluation every 50 steps (11),
the sampler's direct layer calls (``demo/engine.py``). The two alternate, 10 GRPO steps (stale
scenario, decoupled token TIS) and one evaluation (512 prompts, trainer only) at a time, so that a
shared machine's load falls on both alike; a 500-step run is extrapolated as 500 steps + 2 × the
evaluations (trainer and engine), without the model set-up (about 1 s).
"""

from __future__ import annotations

import sys
import time

import torch

import rollout_correction.demo.engine as engine
from rollout_correction.demo.config import METHODS, SCENARIOS, DemoConfig
from rollout_correction.demo.model import build_model
from rollout_correction.demo.task import Task
from rollout_correction.demo.trainer import EVAL_SEED, correction_config, exact_match, grpo_step, setup_torch, sft

SETTINGS = {  # name -> (prompts per step, evaluations per 500-step run, sampler's direct path)
    "former": (32, 21, False),
    "current": (16, 11, True),
}


def main(reps: int = 5) -> None:
    setup_torch(1)
    direct = engine._is_dense_llama
    method = METHODS["token_tis"]
    rc_cfg = correction_config(method)
    eval_digits = Task("sort", 6).sample_digits(512, torch.Generator().manual_seed(EVAL_SEED))
    state = {}
    for name, (prompts, _, _) in SETTINGS.items():
        cfg = DemoConfig(**{**SCENARIOS["stale"], "prompts": prompts})
        task = Task(cfg.task, cfg.digits, cfg.reward)
        weights, _ = sft(cfg.replace(sft_steps=5), 0, task)
        model = build_model(cfg.model, max_len=task.seq_len + 1)
        model.load_state_dict(weights)
        eng = engine.RolloutEngine(model, cfg.precision, cfg.quant, cfg.lag, cfg.granularity)
        state[name] = (cfg, task, model, eng, torch.optim.Adam(model.parameters(), lr=cfg.lr),
                       torch.Generator().manual_seed(1), [0.0, 0.0])
    for _ in range(reps):
        for name, (cfg, task, model, eng, opt, gen, acc) in state.items():
            engine._is_dense_llama = direct if SETTINGS[name][2] else (lambda model: False)
            c = time.process_time()
            for _ in range(10):
                eng.sync(model)
                grpo_step(cfg, method, rc_cfg, task, model, eng, opt, gen)
            acc[0] += time.process_time() - c
            c = time.process_time()
            exact_match(model, task, eval_digits)
            acc[1] += time.process_time() - c
    engine._is_dense_llama = direct
    for name, (*_, acc) in state.items():
        step, evaluation = acc[0] / (10 * reps), acc[1] / reps
        n_eval = SETTINGS[name][1]
        print(f"{name}: {step * 1000:.1f} ms per GRPO step, {evaluation * 1000:.0f} ms per evaluation; 500 steps "
              f"and {n_eval} × 2 evaluations: {500 * step + 2 * n_eval * evaluation:.1f} CPU s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
