"""``rollout-correction demo --async``: the engine process, the bounded queue, the staleness bound,
versions, failures and shutdown, and the comparison end to end."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from rollout_correction.demo.async_report import checks, kl_by_lag, lag_counts, time_to_target  # noqa: E402
from rollout_correction.demo.async_rollout import (AsyncRollout, BatchSource, RolloutWorkerError,  # noqa: E402
                                                   WeightPublisher)
from rollout_correction.demo.async_runner import AsyncConfig, train_mode  # noqa: E402
from rollout_correction.demo.config import DemoConfig  # noqa: E402
from rollout_correction.demo.model import build_model, response_log_probs  # noqa: E402
from rollout_correction.demo.task import Task  # noqa: E402

torch.set_num_threads(1)
CTX = torch.multiprocessing.get_context("spawn")
CFG = DemoConfig(digits=4, prompts=4, samples=2, steps=8, eval_every=4, eval_prompts=16, sft_steps=0)
TASK = Task(CFG.task, CFG.digits, CFG.reward)


def _model(seed: int):
    return build_model(CFG.model, max_len=TASK.seq_len + 1, seed=seed)


def _published():
    """A model and a publisher holding its weights as version 0."""
    model = _model(0)
    pub = WeightPublisher(model, CTX)
    pub.publish(model, 0)
    return model, pub


def _wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the rollout engine"
        time.sleep(0.05)


def _settled(rollout: AsyncRollout, expected: int) -> int:
    """Wait until the engine has produced ``expected`` batches, give it time to overshoot, return the count."""
    _wait(lambda: rollout.produced.value >= expected)
    time.sleep(1.0)
    return rollout.produced.value


class CrashingSource(BatchSource):
    """A source whose engine raises while making batch 2."""

    def make(self, engine, index, version):
        if index == 2:
            raise FloatingPointError("boom in batch 2")
        return super().make(engine, index, version)


def test_queue_bound_holds():
    model, pub = _published()
    # η larger than the run: only the queue holds the engine back.
    with AsyncRollout(BatchSource(CFG, 0), pub, CTX, steps=8, max_staleness=100, queue_size=2) as rollout:
        assert _settled(rollout, 2) == 2
        assert rollout.batches.qsize() == 2
        assert rollout.get().index == 0
        assert _settled(rollout, 3) == 3


def test_staleness_bound_makes_the_engine_wait_for_versions():
    model, pub = _published()
    # η = 1 with version 0 published: batches 0 and 1 (need a version ≥ −1, 0); batch 2 needs ≥ 1.
    with AsyncRollout(BatchSource(CFG, 0), pub, CTX, steps=8, max_staleness=1, queue_size=6) as rollout:
        assert _settled(rollout, 2) == 2
        pub.publish(model, 1)
        assert _settled(rollout, 3) == 3
        assert [rollout.get().version for _ in range(3)] == [0, 0, 1]


def test_versions_are_recorded_with_the_weights_that_sampled():
    """Every version has different weights; each batch's log-probs must be those of the version it names."""
    models = [_model(seed) for seed in range(7)]
    pub = WeightPublisher(models[0], CTX)
    pub.publish(models[0], 0)
    seen = []
    with AsyncRollout(BatchSource(CFG, 3), pub, CTX, steps=6, max_staleness=2, queue_size=2) as rollout:
        for k in range(6):
            batch = rollout.get()
            digits, responses, rollout_log_prob = batch.tensors()
            assert batch.index == k and 0 <= k - batch.version <= 2
            tokens = torch.cat([TASK.prompts(digits), responses], dim=1)
            with torch.no_grad():
                expected = response_log_probs(models[batch.version], tokens, TASK.prompt_len)
            torch.testing.assert_close(rollout_log_prob, expected, atol=2e-5, rtol=0)
            others = [v for v in range(k + 1) if v != batch.version]
            with torch.no_grad():  # and not those of any other version
                assert all((response_log_probs(models[v], tokens, TASK.prompt_len) - rollout_log_prob).abs().max()
                           > 1e-3 for v in others)
            seen.append(batch.version)
            pub.publish(models[k + 1], k + 1)
    assert seen[0] == 0 and seen == sorted(seen)


def test_a_crashed_worker_ends_the_run_with_its_traceback():
    model, pub = _published()
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match="(?s)rollout engine process failed.*boom in batch 2"):
        with AsyncRollout(CrashingSource(CFG, 0), pub, CTX, steps=8, max_staleness=8, queue_size=4) as rollout:
            pid = rollout.process.pid
            for _ in range(8):
                rollout.get()
    assert time.monotonic() - t0 < 120
    assert multiprocessing.active_children() == [] and not psutil.pid_exists(pid)


def test_a_killed_worker_ends_the_run_with_its_exit_code():
    model, pub = _published()
    with pytest.raises(RolloutWorkerError, match=f"exit code {-signal.SIGKILL}"):
        with AsyncRollout(BatchSource(CFG, 0), pub, CTX, steps=8, max_staleness=0, queue_size=1) as rollout:
            pid = rollout.process.pid
            rollout.get()       # batch 1 needs version 1, which never comes: the engine waits
            os.kill(pid, signal.SIGKILL)
            rollout.get()
    assert multiprocessing.active_children() == [] and not psutil.pid_exists(pid)


def test_shutdown_leaves_no_process_behind_when_the_trainer_fails():
    model, pub = _published()
    with pytest.raises(KeyboardInterrupt):
        # the engine is blocked on a full queue when the trainer stops
        with AsyncRollout(BatchSource(CFG, 0), pub, CTX, steps=8, max_staleness=8, queue_size=1) as rollout:
            pid = rollout.process.pid
            _settled(rollout, 1)
            raise KeyboardInterrupt
    assert multiprocessing.active_children() == [] and not psutil.pid_exists(pid)


def test_async_with_eta_zero_is_the_synchronous_run_bit_for_bit():
    """η = 0 fixes v_k = k: the two-process run must equal the one-process run (same thread count,
    and naive PPO is on-policy PPO when the engine is the trainer)."""
    state = _model(5).state_dict()
    acfg = AsyncConfig(modes=("sync_on_policy_1t", "async_naive"), max_staleness=0, queue_size=1)
    sync = train_mode(CFG, acfg, "sync_on_policy_1t", 5, state)
    asyn = train_mode(CFG, acfg, "async_naive", 5, state)
    assert asyn.history["version"] == list(map(float, range(CFG.steps)))
    assert asyn.history["lag"] == sync.history["lag"] == [0.0] * CFG.steps
    for key in ("reward", "loss", "grad_norm"):
        assert asyn.history[key] == sync.history[key], key
    assert asyn.evals["trainer"] == sync.evals["trainer"]
    assert asyn.evals["step"] == [0, 4, 8]
    assert multiprocessing.active_children() == []


def test_time_to_target_lag_counts_and_checks_by_hand():
    evals = {"step": [0, 25, 50], "seconds": [0.0, 2.5, 5.0], "trainer": [0.3, 0.79, 0.81]}
    assert time_to_target(evals, 0.8) == (5.0, 50)
    assert time_to_target(evals, 0.9) == (None, None)
    assert lag_counts({"lag": [0, 1, 2, 2, 4]}, 4) == [1, 1, 2, 0, 1]
    hist = {"rollout_corr/staleness/lag_0/kl": [0.0, 0.1], "rollout_corr/staleness/lag_0/token_count": [0, 5],
            "rollout_corr/staleness/lag_1plus/kl": [0.2, 0.4], "rollout_corr/staleness/lag_1plus/token_count": [1, 1]}
    assert kl_by_lag(hist) == pytest.approx({"lag_0": 0.1, "lag_1plus": 0.3})  # empty steps left out

    def mode(final, asynchronous, speedup):
        return {"final_reward": {"mean": final}, "asynchronous": asynchronous, "speedup": speedup,
                "speedup_vs_fastest_sync": speedup}

    c = checks({"sync_on_policy": mode(0.87, False, 1.0), "async_naive": mode(0.50, True, None),
                "async_opsm": mode(0.84, True, 1.6), "async_bypass_ppo": mode(0.80, True, 1.4)})
    assert c["async_reaching_target"] == ["async_opsm", "async_bypass_ppo"]
    assert c["async_1.5x_faster"] is False          # bypass reaches it only 1.4× faster
    assert c["best_corrected"] == "async_opsm" and c["corrected_within_0.05"] is True
    assert c["naive_cost"] == pytest.approx(0.37)
    # without the two-thread run, its one-thread variant is the reference
    c = checks({"sync_on_policy_1t": mode(0.90, False, 1.0), "async_naive": mode(0.50, True, 1.7)})
    assert c["reference"] == "sync_on_policy_1t" and c["naive_cost"] == pytest.approx(0.40)
    assert c["async_1.5x_faster"] is True
    assert checks({"async_naive": mode(0.5, True, 1.7)})["available"] is False


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="unknown async mode"):
        AsyncConfig(modes=("async_magic",))
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncConfig(max_staleness=-1)
    model = _model(0)
    pub = WeightPublisher(model, CTX)
    with pytest.raises(ValueError, match="do not match"):
        pub.publish(build_model("small", max_len=TASK.seq_len + 1), 0)
    pub.publish(model, 3)
    with pytest.raises(ValueError, match="older than"):
        pub.publish(model, 2)


def test_async_quick_end_to_end(tmp_path):
    from rollout_correction.cli import main

    out = tmp_path / "report"
    assert main(["demo", "--async", "--quick", "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "async-summary.json").read_text())
    assert (out / "async-wallclock.png").stat().st_size > 0 and (out / "async-report.md").is_file()
    assert set(summary["modes"]) == {"sync_on_policy", "async_naive", "async_opsm"}
    from rollout_correction.demo.results import PROVENANCE_FIELDS

    prov = summary["provenance"]
    assert set(PROVENANCE_FIELDS) <= set(prov) and prov["command"].startswith("rollout-correction demo")
    assert prov["torch"] == torch.__version__ and prov["logical_cpus"] >= 1
    eta, steps = summary["async"]["max_staleness"], summary["config"]["steps"]
    for run in summary["runs"]:
        assert run["seconds"] > 0 and run["steps_per_second"] == pytest.approx(steps / run["seconds"])
        assert sum(run["lag_counts"]) == steps and len(run["lag_counts"]) == eta + 1
        if run["mode"] == "sync_on_policy":
            assert run["lag_counts"][0] == steps and run["startup_seconds"] == 0
        else:
            assert run["startup_seconds"] > 0 and run["lag_counts"][0] < steps
    raw = json.loads((out / "async-runs.json").read_text())
    for r in raw:
        secs = r["evals"]["seconds"]
        assert secs == sorted(secs) and secs[-1] <= r["seconds"]
        assert r["history"]["rollout_corr/staleness/lag_mean"] == pytest.approx(r["history"]["lag"])
    assert summary["checks"]["available"] and "naive_cost" in summary["checks"]
    buckets = {f"lag_{k}" for k in range(eta)} | {f"lag_{eta}plus"}
    assert set(summary["modes"]["async_naive"]["kl_by_lag"]) <= buckets
    assert multiprocessing.active_children() == []


def test_the_engine_exits_when_the_trainer_process_is_killed(tmp_path):
    """SIGKILL gives the trainer no chance to stop its engine: the engine must notice and exit."""
    import subprocess
    import sys
    import textwrap

    import rollout_correction

    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent("""
        import time, torch
        from rollout_correction.demo.async_rollout import AsyncRollout, BatchSource, WeightPublisher
        from rollout_correction.demo.config import DemoConfig
        from rollout_correction.demo.model import build_model
        if __name__ == "__main__":
            cfg = DemoConfig(digits=4, prompts=4, samples=2, steps=8, sft_steps=0)
            ctx = torch.multiprocessing.get_context("spawn")
            model = build_model(cfg.model, max_len=11)
            pub = WeightPublisher(model, ctx)
            pub.publish(model, 0)
            with AsyncRollout(BatchSource(cfg, 0), pub, ctx, steps=8, max_staleness=0, queue_size=1) as r:
                print(r.process.pid, flush=True)
                time.sleep(600)
    """))
    src = os.path.dirname(os.path.dirname(rollout_correction.__file__))
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pid = int(trainer.stdout.readline())
        assert psutil.pid_exists(pid)
    finally:
        trainer.kill()
        trainer.wait()

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    _wait(gone, timeout=30)
