"""Run every (method, seed) pair: one SFT per seed, then the GRPO runs, in worker processes.

Runs are independent, so they are spread over ``cfg.workers`` processes (each with
``cfg.threads`` intra-op threads — for a model this small, two one-thread processes beat one
two-thread process). Workers report each finished step through a queue so the main process can
draw the progress bars; without a terminal (``lines``), one plain line per finished SFT and run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queue_lib
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rollout_correction.console import ProgressLines
from rollout_correction.demo.config import METHODS, DemoConfig
from rollout_correction.demo.trainer import setup_torch, sft, train


# The expected cost of a unit of work, for the ETA of the progress lines, in sequences processed:
# an SFT step trains on ``sft_batch`` sequences, a GRPO step samples and trains on ``prompts ×
# samples``, and an evaluation generates greedily for ``eval_prompts`` prompts (once after the warm
# start; in a GRPO run every ``eval_every`` steps and at the end, with the trainer and the engine).
# On the CPU a sequence costs about the same in an SFT step as in a GRPO step, and an evaluation
# prompt about EVAL_WEIGHT of that (the trainer's own functions on one thread, default and long
# scenarios). Counting each unit alike made the ETA after the warm starts (about 1/17 of a run each
# by default) several times too short.
EVAL_WEIGHT = 0.4


def unit_costs(cfg: DemoConfig) -> tuple[float, float]:
    """The expected cost of one SFT warm start and of one GRPO run, in sequences processed."""
    evaluations = len({*range(0, cfg.steps, cfg.eval_every), cfg.steps})
    sft = cfg.sft_steps * cfg.sft_batch + EVAL_WEIGHT * cfg.eval_prompts
    run = cfg.steps * cfg.prompts * cfg.samples + EVAL_WEIGHT * 2 * evaluations * cfg.eval_prompts
    return sft, run


def _init_worker(threads: int) -> None:
    setup_torch(threads)


def _worker_ready() -> None:
    """A job that does nothing: waiting for it waits until a worker has started."""


def _sft_job(cfg: DemoConfig, seed: int):
    return seed, sft(cfg, seed, cfg.make_task())


def _train_job(cfg: DemoConfig, method: str, seed: int, sft_state, q) -> dict:
    def progress(n: int) -> None:
        q.put((method, seed, n))

    return train(cfg, method, seed, sft_state, progress=progress).to_dict()


# Settings that do not change a run's result (they may differ when resuming).
_NOT_RESULT = ("scenario", "methods", "seeds", "workers", "threads", "out", "claims")


def _run_key(cfg: DemoConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k not in _NOT_RESULT}


def _run_path(cfg: DemoConfig, method: str, seed: int) -> Path:
    return Path(cfg.out) / "runs" / f"{method}-seed{seed}.json"


def _save_run(cfg: DemoConfig, result: dict) -> None:
    """Keep each finished run in ``<out>/runs/`` so a long experiment is never lost (with the
    provenance of the invocation that ran it, when it has one)."""
    path = _run_path(cfg, result["method"], result["seed"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**result, "settings": _run_key(cfg)}))


def _load_run(cfg: DemoConfig, method: str, seed: int) -> dict | None:
    """A saved run with exactly these settings, or None."""
    path = _run_path(cfg, method, seed)
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if data.get("settings") == _run_key(cfg) else None


def run_experiment(cfg: DemoConfig, show_progress: bool = True, resume: bool = False,
                   provenance: dict | None = None, lines: bool = False) -> dict:
    """SFT per seed, then every method × seed; returns the raw results and timings.

    With ``resume``, runs already saved in ``<out>/runs/`` with the same settings are reused; each
    run keeps the ``provenance`` (``demo/results.py``) of the invocation that ran it. ``show_progress``
    draws progress bars; ``lines`` prints one plain line per finished unit instead (for logs).
    """
    stamp = {"provenance": provenance} if provenance is not None else {}
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    jobs = [(m, s) for s in cfg.seeds for m in cfg.methods]
    done = {(m, s): r for m, s in jobs if resume and (r := _load_run(cfg, m, s)) is not None}
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    sft_cost, run_cost = unit_costs(cfg)
    log = ProgressLines(len(cfg.seeds) + len(jobs), done=len(done), total_cost=len(cfg.seeds) * sft_cost +
                        len(jobs) * run_cost, done_cost=len(done) * run_cost) if lines else None

    def finished(label: str, detail: str = "", cost: float = sft_cost) -> None:
        if log is not None:
            log.finished(label, detail, cost)

    def finished_run(r: dict) -> None:
        final = r.get("evals", {}).get("trainer") or [float("nan")]
        finished(f"{METHODS[r['method']].label} · seed {r['seed']}", f"final exact match {final[-1]:.3f}", run_cost)

    with Progress(*columns, disable=not show_progress or lines, transient=False) as bars:
        sft_bar = bars.add_task("SFT warm start (per seed)", total=len(cfg.seeds))
        run_bars = {(m, s): bars.add_task(f"{METHODS[m].label} · seed {s}", total=cfg.steps,
                                          completed=cfg.steps if (m, s) in done else 0) for m, s in jobs}
        todo = [j for j in jobs if j not in done]

        if cfg.workers == 1:
            setup_torch(cfg.threads)
            sft_out = {}
            for seed in cfg.seeds:
                sft_out[seed] = sft(cfg, seed, cfg.make_task())
                bars.advance(sft_bar)
                finished(f"SFT warm start · seed {seed}")
            t_sft = time.perf_counter() - t0
            results = list(done.values())
            for m, s in todo:
                r = train(cfg, m, s, sft_out[s][0], progress=lambda n, key=(m, s): bars.advance(run_bars[key], n))
                results.append({**r.to_dict(), **stamp})
                _save_run(cfg, results[-1])
                finished_run(results[-1])
        else:
            ctx = mp.get_context("spawn")
            with ctx.Manager() as manager, ProcessPoolExecutor(
                max_workers=cfg.workers, mp_context=ctx, initializer=_init_worker, initargs=(cfg.threads,)
            ) as pool:
                # The workers start (spawn, import torch: seconds) before any unit, so that the ETA's
                # rate is that of the units; counted in, it made the first lines' ETA several times too long.
                for fut in [pool.submit(_worker_ready) for _ in range(cfg.workers)]:
                    fut.result()
                if log is not None:
                    log.units_start()
                sft_out = {}
                for fut in [pool.submit(_sft_job, cfg, s) for s in cfg.seeds]:
                    seed, out = fut.result()
                    sft_out[seed] = out
                    bars.advance(sft_bar)
                    finished(f"SFT warm start · seed {seed}")
                t_sft = time.perf_counter() - t0
                q = manager.Queue()
                futures = [pool.submit(_train_job, cfg, m, s, sft_out[s][0], q) for m, s in todo]
                pending = set(futures)
                while pending:
                    _drain(q, bars, run_bars, timeout=0.2)
                    for f in [f for f in pending if f.done()]:
                        pending.discard(f)
                        _save_run(cfg, {**f.result(), **stamp})
                        finished_run(f.result())
                _drain(q, bars, run_bars, timeout=0.0)
                results = list(done.values()) + [{**f.result(), **stamp} for f in futures]
    order = {j: i for i, j in enumerate(jobs)}
    results.sort(key=lambda r: order[(r["method"], r["seed"])])
    return {
        "results": results,
        "resumed": len(done),
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


def _many_train_job(index: int, cfg: DemoConfig, method: str, seed: int, sft_state) -> tuple[int, dict]:
    return index, train(cfg, method, seed, sft_state).to_dict()


def run_many(cfgs: list[DemoConfig], workers: int, provenance: dict | None = None, on_run=None) -> list[dict]:
    """Several experiments on one pool of ``workers`` one-process-per-run workers (each with its
    config's thread count): every SFT first, then every (config, method, seed) run, the most
    expensive configs first so that the pool drains evenly. ``on_run(cfg, result, done, total)`` is
    called as each run finishes. Returns one ``run_experiment``-shaped dict per config."""
    t0 = time.perf_counter()
    stamp = {"provenance": provenance} if provenance is not None else {}
    ctx = mp.get_context("spawn")
    raws = [{"results": [], "resumed": 0, "sft_reward": {}, "seconds": {}} for _ in cfgs]
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(cfgs[0].threads,)) as pool:
        sft_futs = {(i, s): pool.submit(_sft_job, cfg, s) for i, cfg in enumerate(cfgs) for s in cfg.seeds}
        sft_out = {k: f.result()[1] for k, f in sft_futs.items()}
        t_sft = time.perf_counter() - t0
        for (i, s), (_, reward) in sft_out.items():
            raws[i]["sft_reward"][s] = reward
        order = sorted(range(len(cfgs)), key=lambda i: -cfgs[i].steps * (cfgs[i].digits * 2 + cfgs[i].tail + 2))
        jobs = [(i, m, s) for i in order for s in cfgs[i].seeds for m in cfgs[i].methods]
        futs = [pool.submit(_many_train_job, i, cfgs[i], m, s, sft_out[(i, s)][0]) for i, m, s in jobs]
        from concurrent.futures import as_completed

        for done, f in enumerate(as_completed(futs), 1):
            i, r = f.result()
            r = {**r, **stamp}
            raws[i]["results"].append(r)
            _save_run(cfgs[i], r)
            if on_run is not None:
                on_run(cfgs[i], r, done, len(futs))
    for cfg, raw in zip(cfgs, raws):
        order = {(m, s): k for k, (m, s) in enumerate((m, s) for s in cfg.seeds for m in cfg.methods)}
        raw["results"].sort(key=lambda r: order[(r["method"], r["seed"])])
        raw["seconds"] = {"total": time.perf_counter() - t0, "sft": t_sft}
    return raws
