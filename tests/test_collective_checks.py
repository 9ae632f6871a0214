"""Every collective agrees on what it will exchange, on every group it uses.

Each misuse runs on 2 gloo ranks, each rank a ``python -c`` child with a deadline (a hang fails
the test, it never blocks the suite), and must end on every rank with the same library error —
never a gloo transport error, a hang, or a number read from a short buffer:

* context-parallel ranks holding different numbers of rows (4 and 3);
* a context-parallel rank with no rows while its peer has some;
* different configurations with the same number of partials (``seq_sum_k2`` / ``seq_sum_k3``);
* ``on_nonfinite="raise"`` on one rank only (its check of the other ranks meets their exchange);
* with ``Parallel(verify="always")``, a configuration that changes on one rank after an agreed call;
* and the cache of agreed groups keeps no process group alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_distributed import _free_port

DEADLINE_S = 60
HERE = os.path.dirname(os.path.abspath(__file__))


def rank_main(case: str, rank: int, port: int, out: str) -> None:
    """One rank of ``case``: writes {"ok": ...} or {"error": type name, "message": ...} to ``out``."""
    import datetime
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from rollout_correction import Parallel, RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                           timeout=datetime.timedelta(seconds=DEADLINE_S))
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 6, generator=gen) * 2
    rollout = (old + 0.3 * torch.randn(4, 6, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    mask = torch.ones(4, 6)
    mask[:, 3 * (1 - rank):3 * (2 - rank)] = 0  # each rank holds its half of every row
    k2 = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_sum_k2", rollout_rs_threshold=0.5)
    k3 = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_sum_k3", rollout_rs_threshold=0.5)
    cp = dist.group.WORLD
    on_cp = Parallel(cp_group=cp)
    result: dict = {}
    try:
        if case == "rows":
            rows = 4 if rank == 0 else 3
            result["ok"] = compute_rollout_correction(old[:rows], rollout[:rows], mask[:rows], config=k2,
                                                      parallel=on_cp).metrics_as_floats()
        elif case == "empty":
            rows = 4 if rank == 0 else 0
            result["ok"] = compute_rollout_correction(old[:rows], rollout[:rows], mask[:rows], config=k2,
                                                      parallel=on_cp).metrics_as_floats()
        elif case == "configs":
            result["ok"] = compute_rollout_correction(old, rollout, mask, config=k2 if rank == 0 else k3,
                                                      parallel=on_cp).response_mask.tolist()
        elif case == "loss_configs":
            loss, _ = compute_policy_loss(old + 0.1, old, torch.ones(4, 6), mask, config=k2 if rank == 0 else k3,
                                          rollout_log_prob=rollout, parallel=on_cp)
            result["ok"] = float(loss)
        elif case in ("raise_dp", "raise_cp"):  # the raising rank checks its peers first; the other does not
            cfg = RolloutCorrectionConfig(rollout_is="token", on_nonfinite="raise" if rank == 0 else "reject")
            groups = Parallel(dp_group=cp) if case == "raise_dp" else on_cp
            result["ok"] = compute_rollout_correction(old, rollout, mask, config=cfg, parallel=groups).metrics_as_floats()
        elif case == "always":
            always = Parallel(cp_group=cp, verify="always")
            first = compute_rollout_correction(old, rollout, mask, config=k2, parallel=always)
            result["first"] = first.response_mask.tolist()
            compute_rollout_correction(old, rollout, mask, config=k2 if rank == 0 else k3, parallel=always)
            result["ok"] = True
        elif case == "dp_matrix":  # every scenario of DP_SCENARIOS, each on a group of its own
            for name in DP_SCENARIOS:
                what, at, path = name.split("_")
                scenario = result[name] = {}
                try:
                    _dp_calls(scenario, rank, what, int(at), path, old, rollout, torch.ones(4, 6), dist.new_group([0, 1]))
                except Exception as e:  # noqa: BLE001 - what each rank ended with is the subject of the test
                    scenario.update(error=type(e).__name__, message=str(e))
        elif case.startswith("cp_"):  # cp_rows_<call> / cp_empty_<call>: rank 1 holds other rows from <call> on
            _, what, at = case.split("_")
            result["calls"] = []
            for call in range(1, 6):
                rows = 4 if rank == 0 or call < int(at) else (3 if what == "rows" else 0)
                result["at"] = call
                res = compute_rollout_correction(old[:rows], rollout[:rows], mask[:rows], config=k2, parallel=on_cp)
                result["calls"].append(res.metrics_as_floats()["rollout_corr/kl"])
        elif case == "threads":  # one thread per setting, each on its own group, the same threshold change
            result.update(_threads(rank, old, rollout, torch.ones(4, 6)))
        elif case == "weak":
            group = dist.new_group([0, 1])
            ref = weakref.ref(group)
            compute_rollout_correction(old, rollout, mask, config=k2, parallel=Parallel(cp_group=group))
            compute_rollout_correction(old, rollout, mask, config=k2, parallel=Parallel(dp_group=group))
            dist.destroy_process_group(group)
            del group
            gc.collect()
            result["ok"] = ref() is None
    except Exception as e:  # noqa: BLE001 - what each rank ended with is the subject of the test
        result.update(error=type(e).__name__, message=str(e))
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


SETTINGS = {  # what a DP rank changes: its configuration, a threshold, or the statistics it records; and
    # settings whose collectives follow the statistics' reduction (M2PO's bisection, OPSM's reduction)
    "config": dict(rollout_is="sequence"),
    "threshold": dict(rollout_rs_threshold=0.7),
    "layout": dict(mismatch_metrics=True),
    "m2po": dict(rollout_m2po_threshold=0.01),
    "opsm": dict(rollout_opsm_delta=0.0),
}


#: ``<what>_<call>_<path>``: rank 1 changes <what> (SETTINGS) from call <call> on, on <path> (see _dp_calls).
DP_SCENARIOS = [f"{what}_{at}_{path}" for what in ("config", "layout", "threshold") for at in (2, 5)
                for path in ("cpu", "device")] + [f"{what}_3_{path}" for what in ("config", "layout", "threshold")
                                                 for path in ("all", "alldevice")] + [
    f"{what}_2_device" for what in ("m2po", "opsm")]


def _dp_calls(out, rank, what, at, path, old, rollout, mask, group, calls=6) -> None:
    """``calls`` corrections over a DP group of 2; rank 1 changes ``what`` from call ``at`` on. ``path``: "cpu"
    (host reads are free), "device" (the device's path: nothing read on the host), "all" / "alldevice" (both
    ranks change: a correct use). Records the kept tokens and the weights' sum per call, and the call that raised."""
    import dataclasses

    import torch

    from rollout_correction import Parallel, RolloutCorrectionConfig, compute_policy_loss, compute_rollout_correction
    from rollout_correction_core._src import stats

    free = stats.reads_are_free
    if path in ("device", "alldevice"):
        stats.reads_are_free = lambda device: False
    plain = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_sum_k2", rollout_rs_threshold=0.5)
    other = dataclasses.replace(plain, **SETTINGS[what])
    base, changed = (other, plain) if what == "m2po" else (plain, other)  # M2PO: the agreed settings have it
    out["calls"] = []
    try:
        for call in range(1, calls + 1):
            out["at"] = call
            cfg = changed if call >= at and (rank == 1 or path.startswith("all")) else base
            if what == "opsm":  # OPSM runs in the loss, on the sequences with a negative advantage
                loss, _ = compute_policy_loss((old - 0.1).requires_grad_(), old, -torch.ones(4, 6), mask, config=cfg,
                                              rollout_log_prob=rollout, parallel=Parallel(dp_group=group))
                loss.backward()
                out["calls"].append([float(loss), 0.0])
                continue
            res = compute_rollout_correction(old, rollout, mask, config=cfg, parallel=Parallel(dp_group=group))
            out["calls"].append([float(res.response_mask.sum()), float(res.weights.sum())])
    finally:
        stats.reads_are_free = free


def _threads(rank, old, rollout, mask) -> dict:
    """Two threads at once, each on its own group and with its own verify setting: "once" in correct use,
    "always" with rank 1 changing a threshold at call 2. Records the setting each thread's reductions ran
    under, and how each thread ended."""
    import threading

    import torch.distributed as dist

    from rollout_correction import Parallel, RolloutCorrectionConfig, compute_rollout_correction
    from rollout_correction_core._src import agreement, stats

    groups = {v: dist.new_group([0, 1]) for v in ("once", "always")}
    out: dict = {"seen": {}}
    inside = threading.Barrier(2)  # both threads inside a call at the same time
    reduce = stats.SufficientStats.all_reduce

    def watched(self, group=None, what=("statistics",)):
        out["seen"].setdefault(threading.current_thread().name, set()).add(agreement.verify_setting())
        return reduce(self, group, what)

    stats.SufficientStats.all_reduce = watched

    def run(verify: str) -> None:
        try:
            for call in range(1, 5):
                threshold = 0.7 if verify == "always" and rank == 1 and call >= 2 else 0.5
                cfg = RolloutCorrectionConfig(rollout_is="token", rollout_rs="seq_sum_k2", rollout_rs_threshold=threshold)
                if call == 1:
                    inside.wait()
                compute_rollout_correction(old, rollout, mask, config=cfg,
                                           parallel=Parallel(dp_group=groups[verify], verify=verify))
            out[verify] = "ok"
        except Exception as e:  # noqa: BLE001 - the subject of the test
            out[verify] = f"{type(e).__name__} at call {call}"

    threads = [threading.Thread(target=run, args=(v,), name=v) for v in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["seen"] = {k: sorted(v) for k, v in out["seen"].items()}
    return out


def run_case(case: str, tmp_path) -> list[dict]:
    """Both ranks' results; fails if either is still running after the deadline."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", "import sys, test_collective_checks as t; "
                               f"t.rank_main({case!r}, {r}, {port}, {str(tmp_path / f'{r}.json')!r})"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=DEADLINE_S + 30)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: a rank is still running after {DEADLINE_S + 30} s (a hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for r in range(2):
        path = tmp_path / f"{r}.json"
        assert path.exists(), f"{case}: rank {r} wrote no result (crashed):\n{logs[r][-3000:]}"
        out.append(json.loads(path.read_text()))
    return out


def _same_error(results: list[dict], *needles: str) -> str:
    assert all("error" in r for r in results), results
    assert [(r["error"], r["message"]) for r in results[1:]] == [(results[0]["error"], results[0]["message"])], \
        f"the ranks ended differently: {results}"
    assert results[0]["error"] == "LayoutMismatchError", results[0]
    message = results[0]["message"]
    for needle in needles:
        assert needle in message, message
    return message


def test_different_row_counts_raise_on_every_rank(tmp_path):
    _same_error(run_case("rows", tmp_path), "cp_group [0, 1]", "rows 4' on rank 0", "rows 3' on rank 1")


def test_a_rank_without_rows_raises_with_its_peer(tmp_path):
    _same_error(run_case("empty", tmp_path), "cp_group [0, 1]", "rows 4' on rank 0", "rows 0' on rank 1")


@pytest.mark.parametrize("case", ["configs", "loss_configs"])
def test_different_configs_with_as_many_partials_raise(case, tmp_path):
    _same_error(run_case(case, tmp_path), "cp_group [0, 1]", "seq_sum_k2", "on rank 0", "seq_sum_k3",
                "on rank 1")


@pytest.mark.parametrize("case, group", [("raise_dp", "dp_group"), ("raise_cp", "cp_group")])
def test_a_check_only_some_ranks_make_raises(case, group, tmp_path):
    _same_error(run_case(case, tmp_path), f"{group} [0, 1]", "on_nonfinite='raise'", "on rank 0", "on rank 1")


def test_verify_always_repeats_the_agreement(tmp_path):
    results = run_case("always", tmp_path)
    assert all(r.get("first") is not None for r in results), results  # the first call was agreed and ran
    _same_error(results, "seq_sum_k3")


def test_agreed_groups_are_held_weakly(tmp_path):
    assert [r.get("ok") for r in run_case("weak", tmp_path)] == [True, True]


@pytest.fixture(scope="module")
def dp_matrix(tmp_path_factory):
    """Both ranks' results for every scenario of DP_SCENARIOS (one pair of processes for all of them)."""
    ranks = run_case("dp_matrix", tmp_path_factory.mktemp("dp_matrix"))
    return {name: [r[name] for r in ranks] for name in DP_SCENARIOS}


@pytest.mark.parametrize("at", [2, 5])
@pytest.mark.parametrize("what", ["config", "layout", "threshold"])
def test_a_dp_rank_that_changes_at_a_later_call_raises_on_every_rank(what, at, dp_matrix):
    """On the CPU every rank reads the verdict its exchange carried: the call where one rank changed raises
    on both, with the lines each rank holds."""
    results = dp_matrix[f"{what}_{at}_cpu"]
    message = _same_error(results, "dp_group [0, 1]", "on rank 0", "on rank 1")
    assert [r["at"] for r in results] == [at, at] and [len(r["calls"]) for r in results] == [at - 1, at - 1]
    key = next(iter(SETTINGS[what]))
    assert key in message, message


@pytest.mark.parametrize("at", [2, 5])
@pytest.mark.parametrize("what", ["config", "layout", "threshold"])
def test_on_a_device_the_mismatched_call_learns_nothing_and_the_next_one_raises(what, at, dp_matrix):
    """The device's path reads nothing in correct use: the call where one rank changed returns weights and
    mask zeroed on both ranks (nothing is learned from a batch corrected with settings that differ), and
    both ranks raise at their next exchange on the group, naming what differs."""
    results = dp_matrix[f"{what}_{at}_device"]
    assert [r.get("error") for r in results] == ["LayoutMismatchError"] * 2, results
    assert [r["at"] for r in results] == [at + 1, at + 1], results
    for r in results:
        assert r["calls"][at - 1] == [0.0, 0.0], r  # the mismatched call: nothing kept, no weight
        assert all(kept > 0 for kept, _ in r["calls"][:at - 1]), r
        assert "dp_group [0, 1]" in r["message"] and next(iter(SETTINGS[what])) in r["message"], r["message"]


@pytest.mark.parametrize("path", ["all", "alldevice"])
@pytest.mark.parametrize("what", ["config", "layout", "threshold"])
def test_every_rank_changing_to_the_same_settings_is_a_correct_use(what, path, dp_matrix):
    """A configuration that changes on every rank alike (a schedule) is agreed anew, on both paths."""
    results = dp_matrix[f"{what}_3_{path}"]
    assert [r.get("error") for r in results] == [None, None], results
    assert results[0]["calls"] == results[1]["calls"] and len(results[0]["calls"]) == 6


@pytest.mark.parametrize("what", ["m2po", "opsm"])
def test_collectives_after_the_reduction_follow_the_agreed_settings(what, dp_matrix):
    """M2PO's bisection and OPSM's reduction come after the statistics: a rank that dropped M2PO (or added
    OPSM) takes part in the collectives the group agreed on, so nobody hangs, and both ranks raise next."""
    results = dp_matrix[f"{what}_2_device"]
    assert [(r.get("error"), r["at"]) for r in results] == [("LayoutMismatchError", 3)] * 2, results
    assert all(next(iter(SETTINGS[what])) in r["message"] for r in results), results
    if what == "opsm":
        assert all(r["calls"][1][0] == 0.0 for r in results), results  # the mismatched call: a zero loss


def test_a_cp_rank_holding_more_rows_at_a_later_call_raises_on_every_rank(tmp_path):
    results = run_case("cp_rows_2", tmp_path)
    _same_error(results, "cp_group [0, 1]", "rows 4' on rank 0", "rows 3' on rank 1")
    assert [r["at"] for r in results] == [2, 2]


def test_an_empty_cp_rank_at_a_later_call_raises_on_every_rank(tmp_path):
    results = run_case("cp_empty_3", tmp_path)
    _same_error(results, "cp_group [0, 1]", "rows 4' on rank 0", "rows 0' on rank 1")
    assert [r["at"] for r in results] == [3, 3]


def test_two_threads_keep_their_own_verify_setting(tmp_path):
    results = run_case("threads", tmp_path)
    assert [r.get("error") for r in results] == [None, None], results
    for r in results:
        assert r["seen"] == {"once": ["once"], "always": ["always"]}, r
        assert r["once"] == "ok" and r["always"] == "LayoutMismatchError at call 2", r
