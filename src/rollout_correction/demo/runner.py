"""Run every (method, seed) pair: one SFT per seed, then the GRPO runs, in worker processes.

Runs are independent, so they are spread over ``cfg.workers`` processes (each with
``cfg.threads`` intra-op threads — for a model this small, two one-thread processes beat one
two-thread process). Workers report each finished step through a queue so the main process can
draw the progress bars.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_lib
import time
from concurrent.futures import ProcessPoolExecutor

from rollout_correction.demo.config import METHODS, DemoConfig
from rollout_correction.demo.task import Task
from rollout_correction.demo.trainer import setup_torch, sft, train


def _init_worker(threads: int) -> None:
    setup_torch(threads)


def _sft_job(cfg: DemoConfig, seed: int):
    return seed, sft(cfg, seed, Task(cfg.task, cfg.digits, cfg.reward))


def _train_job(cfg: DemoConfig, method: str, seed: int, sft_state, q) -> dict:
    def progress(n: int) -> None:
        q.put((method, seed, n))

    return train(cfg, method, seed, sft_state, progress=progress).to_dict()


def run_experiment(cfg: DemoConfig, show_progress: bool = True) -> dict:
    """SFT per seed, then every method × seed; returns the raw results and timings."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    jobs = [(m, s) for s in cfg.seeds for m in cfg.methods]
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show_progress, transient=False) as bars:
        sft_bar = bars.add_task("SFT warm start (per seed)", total=len(cfg.seeds))
        run_bars = {(m, s): bars.add_task(f"{METHODS[m].label} · seed {s}", total=cfg.steps) for m, s in jobs}

        if cfg.workers == 1:
            setup_torch(cfg.threads)
            sft_out = {}
            for seed in cfg.seeds:
                sft_out[seed] = sft(cfg, seed, Task(cfg.task, cfg.digits, cfg.reward))
                bars.advance(sft_bar)
            t_sft = time.perf_counter() - t0
            results = []
            for m, s in jobs:
                r = train(cfg, m, s, sft_out[s][0], progress=lambda n, key=(m, s): bars.advance(run_bars[key], n))
                results.append(r.to_dict())
        else:
            ctx = mp.get_context("spawn")
            with ctx.Manager() as manager, ProcessPoolExecutor(
                max_workers=cfg.workers, mp_context=ctx, initializer=_init_worker, initargs=(cfg.threads,)
            ) as pool:
                sft_out = {}
                for fut in [pool.submit(_sft_job, cfg, s) for s in cfg.seeds]:
                    seed, out = fut.result()
                    sft_out[seed] = out
                    bars.advance(sft_bar)
                t_sft = time.perf_counter() - t0
                q = manager.Queue()
                futures = [pool.submit(_train_job, cfg, m, s, sft_out[s][0], q) for m, s in jobs]
                while not all(f.done() for f in futures):
                    _drain(q, bars, run_bars, timeout=0.2)
                _drain(q, bars, run_bars, timeout=0.0)
                results = [f.result() for f in futures]
    return {
        "results": results,
        "sft_reward": {s: sft_out[s][1] for s in cfg.seeds},
        "seconds": {"total": time.perf_counter() - t0, "sft": t_sft},
    }


def _drain(q, bars, run_bars, timeout: float) -> None:
    try:
        item = q.get(timeout=timeout) if timeout else q.get_nowait()
        while True:
            method, seed, n = item
            bars.advance(run_bars[(method, seed)], n)
            item = q.get_nowait()
    except queue_lib.Empty:
        pass
