"""``rollout-correction demo --async``: synchronous against asynchronous RL, on the same cores.

Every *mode* trains the same SFT start for the same number of GRPO steps on the same batches
(batch k's prompts and sampling noise come from a generator seeded by (seed, k)):

* ``sync_on_policy`` — one process with ``sync_threads`` (2) torch threads: generate batch k with
  the current weights, then train on it. The reference.
* ``sync_on_policy_1t`` — the same with one thread: on a small model, or a machine shared with
  other jobs, two threads can be slower than one; the faster of the two is the fair baseline.
* ``async_*`` — the engine generates in its own process (one thread) with the latest weights it
  has received (:mod:`rollout_correction.demo.async_rollout`), the trainer trains in this process
  (one thread) and publishes its weights after every optimizer step. Batch k reaches step k
  ℓ_k = k − v_k ≤ η versions old; the mode names the loss that copes with it.

The clock. Each run's clock starts when its engine is ready (process start-up, a one-off cost, is
reported apart) and stops after the last optimizer step. Evaluation does not run on the clock: at
every ``eval_every`` steps the trainer clones its weights (a copy of 56k floats) with the time
since the start, and after the run every snapshot is scored by greedy exact match in this process.
Accuracy against wall-clock time is therefore "what the trainer held at time t", measured
identically for every mode. The health monitor and the staleness metrics run on the clock, in
every mode alike.

What varies between repetitions: which version samples which batch depends on the two processes'
timing, hence so does everything downstream in the asynchronous modes. With η = 0 the versions
are fixed (v_k = k) and an asynchronous run is deterministic, bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch

from rollout_correction_core import Aggregation, ClipRange, PolicyLoss
from rollout_correction.console import ProgressLines
from rollout_correction.demo.async_rollout import AsyncRollout, Batch, BatchSource, WeightPublisher
from rollout_correction.demo.config import METHODS, DemoConfig
from rollout_correction.demo.engine import RolloutEngine
from rollout_correction.demo.model import build_model
from rollout_correction.demo.trainer import (EVAL_SEED, correction_config, exact_match, policy_loss, setup_torch,
                                             sft, update_policy)


@dataclass(frozen=True)
class AsyncMode:
    name: str
    label: str
    method: str             # the demo method (``METHODS``) whose loss / preset the mode uses
    asynchronous: bool
    three_policy: bool      # the staleness-aware three-policy loss (``rollout_correction.staleness``)
    description: str


ASYNC_MODES: dict[str, AsyncMode] = {m.name: m for m in (
    AsyncMode("sync_on_policy", "synchronous on-policy", "on_policy", False, False,
              "generate with the current weights, then train; one process, both cores"),
    AsyncMode("sync_on_policy_1t", "synchronous on-policy, 1 thread", "on_policy", False, False,
              "the same with one torch thread (a shared machine can make two threads slower than one)"),
    AsyncMode("async_naive", "async naive PPO", "naive", True, False,
              "engine process + trainer process; PPO with π_old as the behaviour policy, staleness ignored"),
    AsyncMode("async_bypass_ppo", "async bypass PPO-clip", "bypass_ppo", True, False,
              "PPO ratio π_θ/π_rollout clipped to [1-ε, 1+ε] (bypass_ppo_clip)"),
    AsyncMode("async_opsm", "async token TIS + OPSM", "opsm", True, False,
              "the best correction of the stale scenario (decoupled_token_is_opsm)"),
    AsyncMode("async_three_policy", "async three-policy (AReaL)", "token_tis", True, True,
              "decoupled PPO against π_prox approximated log-linearly from the versions, "
              "token TIS π_prox/π_behav (compute_staleness_policy_loss)"),
)}
DEFAULT_ASYNC_MODES = tuple(ASYNC_MODES)
QUICK_ASYNC_MODES = ("sync_on_policy", "async_naive", "async_opsm")
#: The comparison's own defaults where the synchronous demo's differ (its budget and evaluation
#: grid: 32 prompts × 8 samples per step, 500 steps, an evaluation every 25 steps, three seeds); a flag given
#: explicitly still wins.
ASYNC_DEFAULTS = {"prompts": 32, "eval_every": 25, "seeds": (0, 1, 2), "steps": 500}


@dataclass
class AsyncConfig:
    """The asynchronous comparison's own settings (the rest comes from :class:`DemoConfig`)."""

    modes: tuple[str, ...] = DEFAULT_ASYNC_MODES
    max_staleness: int = 4      # η: batch k is sampled with a version ≥ k − η
    queue_size: int = 3         # batches the engine may hold ready
    sync_threads: int = 2       # torch threads of the synchronous process (the async ones use 1 each)

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in ASYNC_MODES]
        if unknown:
            raise ValueError(f"unknown async mode(s) {unknown}; choose from {list(ASYNC_MODES)}")
        if not self.modes:
            raise ValueError("at least one async mode is required")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness (η) must be >= 0, got {self.max_staleness}")
        if self.queue_size < 1 or self.sync_threads < 1:
            raise ValueError("queue_size and sync_threads must be >= 1")

    def to_dict(self) -> dict:
        return {"modes": list(self.modes), "max_staleness": self.max_staleness, "queue_size": self.queue_size,
                "sync_threads": self.sync_threads}


def mode_loss(mode: AsyncMode, rc_cfg, clip_eps: float, versions: torch.Tensor, current_version: int,
              num_buckets: int = 4):
    """The ``loss_fn`` of :func:`update_policy` for ``mode``: the method's loss (or the
    three-policy loss), plus on every step the staleness metrics of π_old against π_behav by lag
    bucket and the mismatch KL(π_behav‖π_old) — the same numbers for every mode."""
    from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
    from rollout_correction.staleness import compute_staleness_policy_loss, staleness_metrics

    method = METHODS[mode.method]

    def loss_fn(log_prob, old_log_prob, rollout_log_prob, advantages, mask, rows):
        v = versions[rows]
        if mode.three_policy:
            loss, m = compute_staleness_policy_loss(
                log_prob, rollout_log_prob, advantages, mask, v, current_version, config=rc_cfg,
                proximal_method="loglinear", num_buckets=num_buckets,
                loss=PolicyLoss(ClipRange(clip_eps, clip_eps), Aggregation("token-mean")))
            m = metrics_to_floats(m)
        else:
            loss, m = policy_loss(method, rc_cfg, log_prob, old_log_prob, rollout_log_prob, advantages, mask,
                                  clip_eps)
        gap = {**compute_offpolicy_metrics(old_log_prob, rollout_log_prob, mask),
               **staleness_metrics(old_log_prob, rollout_log_prob, mask, v, current_version,
                                   num_buckets=num_buckets)}
        return loss, {**m, **metrics_to_floats(gap)}

    return loss_fn


@dataclass
class ModeResult:
    mode: str
    seed: int
    history: dict[str, list[float]] = field(default_factory=dict)   # per GRPO step
    evals: dict[str, list[float]] = field(default_factory=dict)     # step, seconds, trainer
    seconds: float = 0.0          # wall clock of the training loop
    startup_seconds: float = 0.0  # engine process start-up (before the clock)
    cpu_seconds: float = 0.0      # CPU time of the trainer process
    alerts: list[dict] = field(default_factory=list)                # the health monitor's, live

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def train_mode(cfg: DemoConfig, acfg: AsyncConfig, mode_name: str, seed: int, sft_state: dict[str, torch.Tensor],
               progress=None, eval_model: bool = True) -> ModeResult:
    """GRPO from ``sft_state`` in ``mode_name``; ``progress(1)`` after each step."""
    from rollout_correction import RolloutCorrectionConfig
    from rollout_correction.monitor import HealthMonitor

    mode = ASYNC_MODES[mode_name]
    method = METHODS[mode.method]
    setup_torch(acfg.sync_threads if mode_name == "sync_on_policy" else 1)
    task = cfg.make_task()
    torch.manual_seed(seed)
    model = build_model(cfg.model, max_len=task.seq_len + 1)
    model.load_state_dict(sft_state)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rc_cfg = RolloutCorrectionConfig.from_preset("decoupled_token_is") if mode.three_policy \
        else correction_config(method)
    result = ModeResult(mode_name, seed)
    hist, snapshots = result.history, []
    monitor = HealthMonitor(log_alerts=False)
    max_lag = acfg.max_staleness if mode.asynchronous else 0

    def log(key, value):
        hist.setdefault(key, []).append(float(value))

    with contextlib.ExitStack() as stack:
        if mode.asynchronous:
            ctx = torch.multiprocessing.get_context("spawn")
            publisher = WeightPublisher(model, ctx)
            publisher.publish(model, 0)
            t_start = time.perf_counter()
            rollout = stack.enter_context(AsyncRollout(BatchSource(cfg, seed), publisher, ctx, cfg.steps,
                                                       acfg.max_staleness, acfg.queue_size))
            result.startup_seconds = time.perf_counter() - t_start

            def next_batch(step: int) -> Batch:
                return rollout.get()
        else:  # the engine is the trainer: fp32, current weights
            source = BatchSource(cfg.replace(precision="fp32", quant="none"), seed)
            engine = RolloutEngine(model, "fp32", "none", 0)

            def next_batch(step: int) -> Batch:
                engine.sync(model)
                return source.make(engine, step, step)

        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(cfg.steps + 1):
            if step % cfg.eval_every == 0 or step == cfg.steps:
                snapshots.append((step, time.perf_counter() - t0,
                                  {k: v.detach().clone() for k, v in model.state_dict().items()}))
            if step == cfg.steps:
                break
            batch = next_batch(step)
            lag = step - batch.version
            if not 0 <= lag <= max_lag:
                raise RuntimeError(f"batch {step} was sampled with version {batch.version}: lag {lag} outside "
                                   f"[0, {max_lag}]")
            digits, responses, rollout_log_prob = batch.tensors()
            versions = torch.full((digits.shape[0],), batch.version, dtype=torch.int64)
            stats = update_policy(cfg, method, rc_cfg, task, model, opt, digits, responses, rollout_log_prob,
                                  loss_fn=mode_loss(mode, rc_cfg, cfg.clip_eps, versions, step,
                                                    num_buckets=acfg.max_staleness + 1))
            if mode.asynchronous:
                publisher.publish(model, step + 1)
            for alert in monitor.update(step, stats):
                result.alerts.append({"step": alert.step, "rule": alert.name, "severity": alert.severity})
            stats.update(version=batch.version, lag=lag)
            for k, v in stats.items():
                log(k, v)
            if progress is not None:
                progress(1)
        result.seconds = time.perf_counter() - t0
        result.cpu_seconds = time.process_time() - c0

    if eval_model:  # off the clock: score every snapshot
        eval_digits = task.sample_digits(cfg.eval_prompts, torch.Generator().manual_seed(EVAL_SEED))
        for step, seconds, state in snapshots:
            model.load_state_dict(state)
            result.evals.setdefault("step", []).append(step)
            result.evals.setdefault("seconds", []).append(seconds)
            result.evals.setdefault("trainer", []).append(exact_match(model, task, eval_digits))
    return result


def run_comparison(cfg: DemoConfig, acfg: AsyncConfig, show_progress: bool = True, console=None,
                   lines: bool = False) -> dict:
    """SFT per seed, then every mode for every seed, one run at a time (seed-major, so a change in
    the machine's load falls on every mode of a seed alike); returns the raw results. ``lines``:
    no bars, and each finished run's line carries the elapsed time and an ETA (for logs)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    setup_torch(acfg.sync_threads)
    task = cfg.make_task()
    sft_out = {seed: sft(cfg, seed, task) for seed in cfg.seeds}
    t_sft = time.perf_counter() - t0
    results = []
    log = ProgressLines(len(cfg.seeds) * len(acfg.modes)) if lines else None
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not show_progress or lines, transient=False) as bars:
        for seed in cfg.seeds:
            for name in acfg.modes:
                bar = bars.add_task(f"{ASYNC_MODES[name].label} · seed {seed}", total=cfg.steps)
                r = train_mode(cfg, acfg, name, seed, sft_out[seed][0],
                               progress=lambda n, bar=bar: bars.advance(bar, n))
                results.append(r.to_dict())
                line = (f"{ASYNC_MODES[name].label} · seed {seed}: {r.seconds:.1f} s on the clock "
                        f"(+{r.startup_seconds:.1f} s start-up), final exact match {r.evals['trainer'][-1]:.3f}")
                if log is not None:
                    log.finished(line)
                elif console is not None:
                    console.print(line)
    setup_torch(1)
    return {
        "results": results,
        "sft_reward": {s: sft_out[s][1] for s in cfg.seeds},
        "seconds": {"total": time.perf_counter() - t0, "sft": t_sft},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "cpu_count": os.cpu_count(),
    }
