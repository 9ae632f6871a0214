"""Asynchronous rollout: the engine in its own process, weights in shared memory, a bounded queue.

The pieces of ``rollout-correction demo --async``:

* :class:`WeightPublisher` — the trainer's weights as one flat fp32 tensor in shared memory and
  a version counter V (the number of optimizer steps behind them), both under one condition
  variable. ``publish`` copies the parameters in after every optimizer step; ``load_into`` copies
  them out into the engine's model. Nothing is pickled after start-up.
* :class:`BatchSource` — what the engine does for batch k: draw P prompts and G samples each with a
  generator seeded by (seed, k), so the batch depends on the seed, k and the weights only.
* :func:`rollout_worker` — the engine process: for k = 0, 1, …, wait until the latest version
  is at least k − η, load it if it is newer than the one held, sample batch k, put it on the queue
  (blocking while the queue is full). It stops when told to or when the trainer's process is gone.
* :class:`AsyncRollout` — the trainer's side: start the worker, take batches in order, turn a
  dead worker into an error, and shut everything down.

The staleness bound η (``max_staleness``, AReaL's ``max_head_offpolicyness``). The trainer takes
batch k at its step k, holding version V = k, so the batch's lag is ℓ = k − v_k with v_k the
version it was sampled with. The producer starts batch k only once V ≥ k − η; versions never
decrease and batch k cannot be sampled with a version above k (that version needs batch k), so

    0 ≤ ℓ_k ≤ η   for every batch, and no batch is ever dropped.

η = 0 is synchronous RL in two processes. The queue (``queue_size`` batches) bounds how far the
engine runs ahead in memory; lags above ``queue_size + 1`` need η and a slow engine.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_lib
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from rollout_correction.demo.config import DemoConfig
from rollout_correction.demo.engine import RolloutEngine
from rollout_correction.demo.model import build_model
from rollout_correction.demo.task import Task

__all__ = ["WeightPublisher", "BatchSource", "Batch", "AsyncRollout", "RolloutWorkerError", "rollout_worker"]

_POLL_S = 0.2  # how often a blocked side looks at the stop flag / the other process


class RolloutWorkerError(RuntimeError):
    """The rollout engine process failed; the message carries its traceback or exit code."""


class WeightPublisher:
    """The trainer's parameters in one shared-memory fp32 vector, with a version counter.

    ``version`` is −1 until the first ``publish``. The vector and the counter change together
    under ``cond``, so a reader never sees the weights of one version with the number of another.
    """

    def __init__(self, model: torch.nn.Module, ctx) -> None:
        self.shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
        self.buffer = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float32).share_memory_()
        self._version = ctx.Value("q", -1, lock=False)
        self.cond = ctx.Condition()

    def _check(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        params = list(model.named_parameters())
        if [(n, tuple(p.shape)) for n, p in params] != self.shapes:
            raise ValueError("the model's parameters do not match the published layout")
        return [p for _, p in params]

    @property
    def version(self) -> int:
        with self.cond:
            return int(self._version.value)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Copy ``model``'s parameters in and set the version (after an optimizer step)."""
        flat = torch.cat([p.detach().float().reshape(-1) for p in self._check(model)])
        with self.cond:
            if version < self._version.value:
                raise ValueError(f"version {version} is older than the published {self._version.value}")
            self.buffer.copy_(flat)
            self._version.value = version
            self.cond.notify_all()

    def wait_for(self, version: int, halted) -> int | None:
        """Block until the published version is ≥ ``version``; returns it (None once ``halted()``)."""
        with self.cond:
            while self._version.value < version:
                if halted():
                    return None
                self.cond.wait(_POLL_S)
            return int(self._version.value)

    @torch.no_grad()
    def load_into(self, model: torch.nn.Module) -> int:
        """Copy the published weights into ``model``; returns their version."""
        params = self._check(model)
        with self.cond:
            for p, chunk in zip(params, self.buffer.split([p.numel() for p in params])):
                p.copy_(chunk.view_as(p))
            return int(self._version.value)


@dataclass
class Batch:
    """One rollout batch as it crosses the queue (numpy arrays: no shared-memory handles to leak)."""

    index: int                      # k: the trainer step that will use it
    version: int                    # v_k: the policy version that sampled it
    digits: np.ndarray              # (P·G, n) int64
    responses: np.ndarray           # (P·G, T) int64
    rollout_log_prob: np.ndarray    # (P·G, T) float32

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(self.digits), torch.from_numpy(self.responses),
                torch.from_numpy(self.rollout_log_prob))


@dataclass
class BatchSource:
    """Batch k from the engine: prompts and samples drawn with a generator seeded by (seed, k)."""

    cfg: DemoConfig
    seed: int

    def task(self) -> Task:
        return self.cfg.make_task()

    def engine(self) -> RolloutEngine:
        """The engine's own model (same layout as the trainer's), at the configured numerics."""
        template = build_model(self.cfg.model, max_len=self.task().seq_len + 1)
        return RolloutEngine(template, self.cfg.precision, self.cfg.quant, 0, self.cfg.granularity)

    def generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(30_000 + 1_000_003 * self.seed + index)

    def make(self, engine: RolloutEngine, index: int, version: int) -> Batch:
        task = self.task()
        gen = self.generator(index)
        digits = task.sample_digits(self.cfg.prompts, gen).repeat_interleave(self.cfg.samples, dim=0)
        responses, rollout_log_prob = engine.generate(task.prompts(digits), task.response_len, generator=gen,
                                                      group_size=self.cfg.samples)
        return Batch(index, version, digits.numpy(), responses.numpy(), rollout_log_prob.numpy())


def rollout_worker(source: BatchSource, publisher: WeightPublisher, batches, errors, stop, ready, produced,
                   steps: int, max_staleness: int, threads: int = 1) -> None:
    """The engine process: batches 0 … steps − 1, each with the latest weights allowed (module docstring)."""
    parent = multiprocessing.parent_process()

    def halted() -> bool:  # asked to stop, or the trainer is gone (killed without a chance to say so)
        return stop.is_set() or (parent is not None and not parent.is_alive())

    try:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(True)
        engine = source.engine()
        mirror = build_model(source.cfg.model, max_len=source.task().seq_len + 1)
        held = -1
        ready.set()
        for k in range(steps):
            if publisher.wait_for(k - max_staleness, halted) is None:
                return
            if publisher.version != held:
                held = publisher.load_into(mirror)
                engine.sync(mirror)     # applies the engine's precision / quantisation
            batch = source.make(engine, k, held)
            while True:
                if halted():
                    return
                try:
                    batches.put(batch, timeout=_POLL_S)
                    break
                except queue_lib.Full:
                    continue
            with produced.get_lock():
                produced.value += 1
    except BaseException:  # noqa: BLE001 — report everything, then exit non-zero
        errors.put(traceback.format_exc())
        raise SystemExit(1)


class AsyncRollout:
    """The trainer's handle on the engine process (a context manager).

    ``get()`` returns the batches in order 0, 1, …; it raises :class:`RolloutWorkerError` when
    the worker dies (its traceback, or its exit code if it was killed) instead of waiting forever.
    Leaving the context stops the worker, joins it and terminates it if it does not stop.
    """

    def __init__(self, source: BatchSource, publisher: WeightPublisher, ctx, steps: int, max_staleness: int,
                 queue_size: int, threads: int = 1, start_timeout: float = 120.0) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.ctx, self.steps, self.max_staleness, self.queue_size = ctx, steps, max_staleness, queue_size
        self.start_timeout = start_timeout
        self.batches = ctx.Queue(maxsize=queue_size)
        self.errors = ctx.Queue()
        self.stop = ctx.Event()
        self.ready = ctx.Event()
        self.produced = ctx.Value("q", 0)
        self.process = ctx.Process(
            target=rollout_worker, name="rollout-engine", daemon=True,
            args=(source, publisher, self.batches, self.errors, self.stop, self.ready, self.produced, steps,
                  max_staleness, threads))
        self._next = 0

    def __enter__(self) -> "AsyncRollout":
        self.process.start()
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self.ready.wait(_POLL_S):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RolloutWorkerError(f"the rollout engine process did not start in "
                                             f"{self.start_timeout:.0f} s")
        except BaseException:
            self.close()
            raise
        return self

    def _failure(self) -> RolloutWorkerError:
        try:
            tb = self.errors.get(timeout=1.0)
            return RolloutWorkerError(f"the rollout engine process failed:\n{tb}")
        except queue_lib.Empty:
            return RolloutWorkerError(f"the rollout engine process died with exit code {self.process.exitcode} "
                                      "and no traceback (killed by a signal or out of memory?)")

    def _check_alive(self) -> None:
        if not self.process.is_alive():
            raise self._failure()

    def get(self) -> Batch:
        """The next batch (index = number of batches taken before); waits for the engine."""
        if self._next >= self.steps:
            raise RolloutWorkerError(f"all {self.steps} batches were already taken")
        while True:
            try:
                batch = self.batches.get(timeout=_POLL_S)
            except queue_lib.Empty:
                self._check_alive()
                continue
            if batch.index != self._next:
                raise RolloutWorkerError(f"expected batch {self._next}, got batch {batch.index}")
            self._next += 1
            return batch

    def close(self) -> None:
        self.stop.set()
        deadline = time.monotonic() + 10.0
        while self.process.is_alive() and time.monotonic() < deadline:
            try:  # unblock a producer waiting on a full queue
                while True:
                    self.batches.get_nowait()
            except (queue_lib.Empty, OSError, ValueError):
                pass
            self.process.join(_POLL_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        for q in (self.batches, self.errors):
            q.cancel_join_thread()
            q.close()

    def __exit__(self, *exc) -> None:
        self.close()
