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
    rollout = old + 0.3 * torch.randn(4, 6, generator=gen)
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
    _same_error(run_case("rows", tmp_path), "sequence_group [0, 1]", "rows 4' on rank 0", "rows 3' on rank 1")


def test_a_rank_without_rows_raises_with_its_peer(tmp_path):
    _same_error(run_case("empty", tmp_path), "sequence_group [0, 1]", "rows 4' on rank 0", "rows 0' on rank 1")


@pytest.mark.parametrize("case", ["configs", "loss_configs"])
def test_different_configs_with_as_many_partials_raise(case, tmp_path):
    _same_error(run_case(case, tmp_path), "sequence_group [0, 1]", "seq_sum_k2", "on rank 0", "seq_sum_k3",
                "on rank 1")


@pytest.mark.parametrize("case, group", [("raise_dp", "process_group"), ("raise_cp", "sequence_group")])
def test_a_check_only_some_ranks_make_raises(case, group, tmp_path):
    _same_error(run_case(case, tmp_path), f"{group} [0, 1]", "on_nonfinite='raise'", "on rank 0", "on rank 1")


def test_verify_always_repeats_the_agreement(tmp_path):
    results = run_case("always", tmp_path)
    assert all(r.get("first") is not None for r in results), results  # the first call was agreed and ran
    _same_error(results, "seq_sum_k3")


def test_agreed_groups_are_held_weakly(tmp_path):
    assert [r.get("ok") for r in run_case("weak", tmp_path)] == [True, True]
