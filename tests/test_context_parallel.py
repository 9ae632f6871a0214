"""Context parallelism: sequences split across a group give the unsplit result, with one collective.

gloo ranks on 127.0.0.1 form a grid of DP × CP ranks (global rank = dp · CP + cp): each data-
parallel rank holds its own rows, and each of its CP ranks holds part of every one of those rows,
in one of two layouts — a contiguous slice of the columns (uneven, one slice possibly empty) or
Megatron's zig-zag split (2·CP equal chunks after padding; rank r holds chunks r and 2·CP−1−r).
Rows include: no valid token, a NaN at a valid position (dropped, counted as non-finite), holes
in the mask, NaN/inf in padding. Every result of every rank — weights and masks of its tokens,
every metric, the loss shares (they add up to the unsplit loss) and the gradients of its tokens —
is compared with one process computing on the whole, unsplit rows: masks bit for bit, values to
float32 rounding (relative 2e-6, absolute 1e-7: the split rows' partial sums add up in another
order than the unsplit row's; a one-token difference is orders of magnitude larger).

The default run covers one preset per family and the hand-picked chains at CP = 2 (every group
flavour) and a few at CP = 3; ``-m slow`` runs every preset and every loss type at CP = 2 and 3.

The collectives are counted by wrapping ``torch.distributed``'s functions in each rank: a call
with ``sequence_group`` (compute_rollout_correction, compute_policy_loss, agg_loss and the packed
entry point) makes exactly one ``all_gather_into_tensor`` over the sequence group, of a (B, k)
tensor (k per-row scalars: the same k when the rows are four times as long), and no other
collective over that group; only ``all_reduce`` over ``process_group`` besides. The first call of
an exchange layout (the call, the configuration, the row count, the partials) also agrees on it
over the group: one all-reduce of a 2-element fingerprint before the gather.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollout_correction import (RolloutCorrectionConfig, compute_offpolicy_metrics, compute_policy_loss,
                                compute_rollout_correction)
from rollout_correction_core._src.losses import LOSS_AGG_MODES, agg_loss
from rollout_correction.packed import compute_rollout_correction_packed
from test_distributed import CONFIGS, _free_port, init_dp_cp
from rollout_correction import Aggregation, Parallel, PolicyLoss

ROWS = 7  # per data-parallel rank
LENGTH = 19

ALL_PRESETS = RolloutCorrectionConfig.preset_names()
# One preset per family (token / sequence / geometric IS, IcePop, k1 / k3 rejection, bypass PPO /
# policy gradient, disabled) for the fast run; every preset in the slow one.
FAMILY_PRESETS = ["decoupled_token_is", "decoupled_seq_is_rs", "decoupled_token_icepop", "decoupled_geo_rs_token_tis",
                  "decoupled_k3_rs_seq_tis", "bypass_ppo_clip_k3_rs", "bypass_pg_geo_rs_seq_tis",
                  "decoupled_token_is_m2po", "disabled"]
# Losses compared: PPO clip, bypass REINFORCE, CISPO, DPPO, and the sequence-level GSPO and TOPR.
LOSS_PRESETS = ["decoupled_seq_is_rs", "bypass_pg_geo_rs_token_tis", "decoupled_cispo_token_is",
                "decoupled_dppo_tv_token_is", "decoupled_gspo_geo_is", "bypass_topr", "bypass_rollout_is",
                "bypass_cispo"]
EXTRA = CONFIGS  # the hand-picked configurations of the data-parallel tests


def config(name: str) -> RolloutCorrectionConfig:
    if name in EXTRA:
        return RolloutCorrectionConfig.from_dict(EXTRA[name])
    return getattr(RolloutCorrectionConfig, name)()


def make_rows(dp_rank: int):
    """The rows of one data-parallel rank (deterministic)."""
    gen = torch.Generator().manual_seed(4321 + dp_rank)
    old = -torch.rand(ROWS, LENGTH, generator=gen) * 3.0 - 0.05
    rollout = (old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=gen)
    lengths[2] = 0  # no valid token
    lengths[4] = LENGTH  # no padding
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
    mask[5, 1:3] = 0  # a hole (e.g. tool output in a multi-turn response)
    if dp_rank == 0:
        old[6, LENGTH - 3] = float("nan")  # valid position: the row is dropped
        mask[6, LENGTH - 3] = 1
    pad = mask == 0
    old = torch.where(pad & (torch.arange(LENGTH) % 3 == 0), torch.full_like(old, float("nan")), old)
    rollout = torch.where(pad & (torch.arange(LENGTH) % 3 == 1), torch.full_like(old, -float("inf")), rollout)
    log_prob = (old.nan_to_num(-1.0) + 0.25 * torch.randn(ROWS, LENGTH, generator=gen)).clamp(max=0.0)
    adv = torch.randn(ROWS, 1, generator=gen).expand(ROWS, LENGTH).contiguous()
    return old, rollout, mask, log_prob, adv


def columns(layout: str, cp: int, cp_rank: int) -> torch.Tensor:
    """Column indices (of the padded row) held by ``cp_rank``; -1 is a padding column."""
    if layout == "contiguous":
        cuts = {2: [0, 7, LENGTH], 3: [0, 0, 11, LENGTH]}[cp]  # CP = 3: rank 0 holds nothing
        return torch.arange(cuts[cp_rank], cuts[cp_rank + 1])
    chunk = math.ceil(LENGTH / (2 * cp))
    idx = torch.arange(2 * cp * chunk)
    idx = torch.where(idx < LENGTH, idx, torch.full_like(idx, -1))
    return torch.cat([idx[cp_rank * chunk:(cp_rank + 1) * chunk],
                      idx[(2 * cp - 1 - cp_rank) * chunk:(2 * cp - cp_rank) * chunk]])


def take(x: torch.Tensor, cols: torch.Tensor, fill: float) -> torch.Tensor:
    """The columns ``cols`` of ``x``; padding columns (-1) hold ``fill``."""
    out = x[:, cols.clamp_min(0)]
    return torch.where(cols >= 0, out, torch.full_like(out, fill))


def compute_all(old, rollout, mask, log_prob, adv, names, losses, *, sequence_group=None, process_group=None):
    """Everything compared, for one call site."""
    out = {}
    for name in names:
        res = compute_rollout_correction(
            old, rollout, mask, config=config(name),
            parallel=Parallel(dp_group=process_group, cp_group=sequence_group))
        out[name] = (res.weights, res.response_mask, res.metrics_as_floats())
    offpolicy = compute_offpolicy_metrics(
        old, rollout, mask, parallel=Parallel(dp_group=process_group, cp_group=sequence_group))
    out["offpolicy"] = (None, mask, {k: float(v) for k, v in offpolicy.items()})
    for mode in LOSS_AGG_MODES:
        for name in losses:
            lp = log_prob.clone().requires_grad_(True)
            loss, metrics = compute_policy_loss(
                lp, old, adv, mask, config=config(name), rollout_log_prob=rollout,
                parallel=Parallel(dp_group=process_group, cp_group=sequence_group),
                loss=PolicyLoss(aggregation=Aggregation(mode, scale_factor=LENGTH)))
            loss.backward()
            out[f"loss/{name}/{mode}"] = (float(loss.detach()), lp.grad.clone(),
                                          {k: float(v) for k, v in metrics.items()})
        lm = (log_prob - old.nan_to_num(0.0)) * adv
        out[f"agg/{mode}"] = float(agg_loss(
            lm, mask, parallel=Parallel(cp_group=sequence_group),
            aggregation=Aggregation(mode, scale_factor=LENGTH)))
    return out


COUNTED = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
           "all_to_all_single", "gather", "reduce")


def count_collectives(calls: list):
    """Wrap the collectives of ``torch.distributed`` so that each call appends (name, group, numel)."""
    for name in COUNTED:
        fn = getattr(dist, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            group = kwargs.get("group")
            tensor = args[0] if args else kwargs.get("tensor")
            calls.append((_name, group, tensor.numel() if isinstance(tensor, torch.Tensor) else None,
                          args[1].numel() if len(args) > 1 and isinstance(args[1], torch.Tensor) else None))
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapper)


def _worker(rank, world_size, cp, names, losses, thorough, port, result_dir):
    dp_rank, cp_rank, cp_group, dp_group = init_dp_cp(rank, world_size, cp, port)
    try:
        rows = make_rows(dp_rank)
        results = {}
        calls: list = []
        count_collectives(calls)
        for layout in ("contiguous", "zigzag"):
            cols = columns(layout, cp, cp_rank)
            old, rollout, mask, log_prob, adv = (take(rows[0], cols, float("nan")), take(rows[1], cols, -float("inf")),
                                                  take(rows[2], cols, 0.0), take(rows[3], cols, 0.0),
                                                  take(rows[4], cols, 0.0))
            for pg_name, pg in (("dp", dp_group), ("dp_cp", dist.group.WORLD), ("none", None)):
                if pg_name != "dp" and layout == "zigzag" and not thorough:
                    continue  # keep the fast run short: the group semantics are covered by the other layout
                results[(layout, pg_name)] = compute_all(old, rollout, mask, log_prob, adv, names, losses,
                                                         sequence_group=cp_group, process_group=pg)
            # Collective count of single calls, in the steady state (the first call of an exchange
            # layout also agrees on it: one all_reduce of a 2-element fingerprint before the gather).
            cfg = config("decoupled_geo_rs_token_tis")

            def steady(key, pg, fn):
                for first in (True, False):
                    del calls[:]
                    fn()
                    results[key + (("first",) if first else ())] = summarize(calls, cp_group, pg)

            def loss_call(pg, *tensors, cfg=cfg):
                lp, old_, adv_, mask_, rollout_ = tensors
                lp = lp.clone().requires_grad_(True)
                loss, _ = compute_policy_loss(lp, old_, adv_, mask_, config=cfg, rollout_log_prob=rollout_,
                                              parallel=Parallel(dp_group=pg, cp_group=cp_group),
                                              loss=PolicyLoss(aggregation=Aggregation("seq-mean-token-mean")))
                loss.backward()

            for pg_name, pg in (("dp", dp_group), ("dp_cp", dist.group.WORLD), ("none", None)):
                steady((layout, pg_name, "calls/correction"), pg, lambda: compute_rollout_correction(
                    old, rollout, mask, config=cfg, parallel=Parallel(dp_group=pg, cp_group=cp_group)))
                steady((layout, pg_name, "calls/loss"), pg, lambda: loss_call(pg, log_prob, old, adv, mask, rollout))
            steady((layout, "calls/agg"), None, lambda: agg_loss(
                log_prob * mask, mask, parallel=Parallel(cp_group=cp_group), aggregation=Aggregation("seq-mean-token-mean")))
            # The same calls on rows four times as long (the extra columns are padding): the
            # sequence group's collective must send the same number of scalars.
            extra = 3 * LENGTH
            long = [torch.cat([t, torch.full((ROWS, extra), fill)], 1)
                    for t, fill in ((old, float("nan")), (rollout, -float("inf")), (mask, 0.0), (log_prob, 0.0),
                                    (adv, 0.0))]
            steady((layout, "dp", "calls/correction_long"), dp_group, lambda: compute_rollout_correction(
                *long[:3], config=cfg, parallel=Parallel(dp_group=dp_group, cp_group=cp_group)))
            steady((layout, "dp", "calls/loss_long"), dp_group,
                   lambda: loss_call(dp_group, long[3], long[0], long[4], long[2], long[1]))
            # packed: this rank's tokens of each row, flat
            keep = (cols >= 0)
            flat = [t[:, keep] for t in (old, rollout, mask)]
            lengths = torch.full((ROWS,), int(keep.sum()))
            for _ in range(2):  # counted in the steady state: the first reduction of a layout also checks it
                del calls[:]
                res = compute_rollout_correction_packed(
                    flat[0].reshape(-1), flat[1].reshape(-1), config=config("decoupled_k3_rs_seq_tis"),
                    lengths=lengths, response_mask=flat[2].reshape(-1),
                    parallel=Parallel(dp_group=dp_group, cp_group=cp_group))
            results[(layout, "dp", "calls/packed")] = summarize(calls, cp_group, dp_group)
            results[(layout, "packed")] = (res.weights.reshape(ROWS, -1), res.response_mask.reshape(ROWS, -1),
                                           res.metrics_as_floats())
        results["errors"] = setup_errors(rank, cp, cp_group, rows)
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def setup_errors(rank, cp, cp_group, rows):
    """Messages of the setups that must be refused (each raised on every rank that calls it)."""
    cols = columns("contiguous", cp, rank % cp)
    old, rollout, mask = take(rows[0], cols, float("nan")), take(rows[1], cols, 0.0), take(rows[2], cols, 0.0)
    out = {
        "alignment": _error(lambda: compute_rollout_correction(
            old, rollout, mask, config=dict(rollout_is="token", check_alignment=True),
            parallel=Parallel(cp_group=cp_group))),
        "sum_norm": _error(lambda: agg_loss(
            old.nan_to_num(0.0), mask, parallel=Parallel(cp_group=cp_group),
            aggregation=Aggregation("seq-mean-token-sum-norm"))),
        # data-parallel rank 0 holds a NaN at a valid position (column LENGTH − 3)
        "opsm": _error(lambda: compute_policy_loss(
            old.nan_to_num(0.0), old, mask, mask, config=config("decoupled_token_is_opsm"),
            rollout_log_prob=rollout, parallel=Parallel(cp_group=cp_group))),
        "raise": _error(lambda: compute_rollout_correction(
            old, rollout, mask, config=dict(rollout_is="token", on_nonfinite="raise"),
            parallel=Parallel(cp_group=cp_group))),
    }
    partial = dist.new_group([0, 1, 3, 4]) if cp == 3 else None  # holds ranks 0, 1 of CP group {0, 1, 2}
    if rank == 0 and partial is not None:
        out["partial"] = _error(lambda: compute_rollout_correction(
            old, rollout, mask, parallel=Parallel(dp_group=partial, cp_group=cp_group)))
    return out


def summarize(calls, cp_group, pg):
    """(collective, which group, numel of the sent tensor) per call."""
    def which(g):
        if g is cp_group:
            return "sequence_group"
        if pg is not None and (g is pg or (g is None and pg is dist.group.WORLD)):
            return "process_group"
        return f"other:{g}"
    return [(name, which(group), n_in) for name, group, n_in, _ in calls]


def _close(a: dict, b: dict, context: str):
    assert set(a) == set(b), f"{context}: names differ: {set(a) ^ set(b)}"
    bad = [f"{k}: unsplit={a[k]!r} split={b[k]!r}" for k in a
           if not math.isclose(a[k], b[k], rel_tol=2e-6, abs_tol=1e-7)]
    assert not bad, f"{context}:\n  " + "\n  ".join(bad)


def _tensor_close(whole: torch.Tensor | None, got: torch.Tensor | None, cols: torch.Tensor, context: str,
                  exact: bool = False):
    if whole is None:
        assert got is None, context
        return
    expected = take(whole, cols, 0.0)
    real = cols >= 0
    if exact:
        assert torch.equal(got[:, real], expected[:, real].to(got.dtype)), context
    else:
        torch.testing.assert_close(got[:, real], expected[:, real], rtol=2e-6, atol=1e-7, msg=lambda m: f"{context}: {m}")


def run_grid(cp: int, dp: int, names: list[str], losses: list[str], tmp_path, thorough: bool = False):
    world = cp * dp
    mp.start_processes(_worker, args=(world, cp, names, losses, thorough, _free_port(), str(tmp_path)), nprocs=world,
                       join=True, start_method="fork")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    dp_rows = [make_rows(d) for d in range(dp)]
    everything = [torch.cat([r[i] for r in dp_rows]) for i in range(5)]
    n_tok = int(everything[2].sum())
    whole_all = compute_all(*everything, names, losses)  # the whole batch: what "dp" and "dp_cp" must give
    whole_dp = [compute_all(*r, names, losses) for r in dp_rows]  # one DP rank's rows: what "none" must give

    # The comparison is sensitive: one DP rank's rows alone give different metrics.
    m_all, m_one = whole_all[names[0]][2], whole_dp[0][names[0]][2]
    assert sum(not math.isclose(m_all[k], m_one[k], rel_tol=1e-3) for k in m_all) >= 5
    assert n_tok > 0

    for rank in range(world):
        dp_rank, cp_rank = divmod(rank, cp)
        lo, hi = dp_rank * ROWS, (dp_rank + 1) * ROWS
        for key, got_all in per_rank[rank].items():
            if key == "errors" or len(key) != 2 or key[1] == "packed" or key[1].startswith("calls"):
                continue
            layout, pg_name = key
            cols = columns(layout, cp, cp_rank)
            whole = whole_dp[dp_rank] if pg_name == "none" else whole_all
            rows = slice(0, ROWS) if pg_name == "none" else slice(lo, hi)
            ctx = f"CP={cp} rank {rank} {layout} process_group={pg_name}"
            for name in names + ["offpolicy"]:
                w, m, metrics = got_all[name]
                ew, em, emetrics = whole[name]
                _close(emetrics, metrics, f"{ctx} {name} metrics")
                _tensor_close(None if ew is None else ew[rows], w, cols, f"{ctx} {name} weights")
                _tensor_close(em[rows], m, cols, f"{ctx} {name} mask", exact=True)
            for mode in LOSS_AGG_MODES:
                for name in losses:
                    loss, grad, metrics = got_all[f"loss/{name}/{mode}"]
                    e_loss, e_grad, e_metrics = whole_dp[dp_rank][f"loss/{name}/{mode}"]
                    if pg_name == "none":
                        _close(e_metrics, metrics, f"{ctx} loss {name} {mode} metrics")
                    else:  # rollout_corr/* cover the whole batch, actor/* this DP rank's rows
                        _close({k: v for k, v in e_metrics.items() if k.startswith("actor/")},
                               {k: v for k, v in metrics.items() if k.startswith("actor/")}, f"{ctx} loss {name} {mode}")
                        _close({k: v for k, v in whole_all[f"loss/{name}/{mode}"][2].items()
                                if k.startswith("rollout_corr/")},
                               {k: v for k, v in metrics.items() if k.startswith("rollout_corr/")}, f"{ctx} {mode}")
                    _tensor_close(e_grad, grad, cols, f"{ctx} grad {name} {mode}")
        # Loss shares add up over the sequence group to the unsplit loss of the DP rank's rows.
    for d in range(dp):
        for key in per_rank[d * cp]:
            if key == "errors" or len(key) != 2 or key[1] == "packed" or key[1].startswith("calls"):
                continue
            for k, v in per_rank[d * cp][key].items():
                if k.startswith("loss/") or k.startswith("agg/"):
                    total = sum((per_rank[d * cp + c][key][k][0] if k.startswith("loss/")
                                 else per_rank[d * cp + c][key][k]) for c in range(cp))
                    expected = whole_dp[d][k][0] if k.startswith("loss/") else whole_dp[d][k]
                    assert total == pytest.approx(expected, rel=2e-6, abs=1e-7), f"CP={cp} dp {d} {key} {k}"
    # Refused setups: a clear message on every rank, no hang.
    for rank in range(world):
        errors = per_rank[rank]["errors"]
        assert "check_alignment" in errors["alignment"], errors
        assert "aggregation.scale_factor" in errors["sum_norm"], errors
        assert "not available in compute_policy_loss with sequence_group" in errors["opsm"], errors
        if rank // cp == 0:
            assert "non-finite" in errors["raise"] and "row 6" in errors["raise"], errors
        else:
            assert errors["raise"] is None, errors
        if rank == 0 and cp == 3:
            assert "some but not all ranks of sequence_group" in errors["partial"], errors
    # Packed entry point.
    res = compute_rollout_correction(*everything[:3], config=config("decoupled_k3_rs_seq_tis"))
    packed_whole = (res.weights, res.response_mask, res.metrics_as_floats())
    for rank in range(world):
        dp_rank, cp_rank = divmod(rank, cp)
        for layout in ("contiguous", "zigzag"):
            cols = columns(layout, cp, cp_rank)
            cols = cols[cols >= 0]
            w, m, metrics = per_rank[rank][(layout, "packed")]
            ew, em, emetrics = packed_whole
            _close(emetrics, metrics, f"packed rank {rank} {layout}")
            rows = slice(dp_rank * ROWS, (dp_rank + 1) * ROWS)
            _tensor_close(ew[rows], w, cols, f"packed weights rank {rank}")
            _tensor_close(em[rows], m, cols, f"packed mask rank {rank}", exact=True)
    # Collectives: one all_gather_into_tensor of (B, k) over the sequence group per call; the rest
    # are all_reduce over the data-parallel group.
    for rank in range(world):
        for key, calls in per_rank[rank].items():
            if isinstance(key, tuple) and key[-1] == "first":  # an agreement, if any, precedes the gather
                seq = [c for c in calls if c[1] == "sequence_group"]
                assert seq[-1][0] in ("all_gather_single", "all_gather_into_tensor"), (key, calls)
                assert all(c == ("all_reduce", "sequence_group", 2) for c in seq[:-1]) and len(seq) <= 2, (key, calls)
                continue
            if key == "errors" or not (isinstance(key, tuple) and str(key[-1]).startswith("calls")):
                continue
            counts = Counter((name, group) for name, group, _ in calls)
            gathers = counts[("all_gather_single", "sequence_group")] + counts[("all_gather_into_tensor", "sequence_group")]
            assert gathers == 1, (key, calls)
            # and, before it, the agreement of the sequence group at every call (2 int64 fingerprints)
            assert counts[("all_reduce", "sequence_group")] == 1, (key, calls)
            assert sum(v for (name, group), v in counts.items() if group == "sequence_group") == 2, (key, calls)
            for name, group, numel in calls:
                if (name, group, numel) == ("all_reduce", "sequence_group", 2):
                    continue
                if group == "sequence_group":
                    # (cp·B, k) gathered, k per-row scalars (33 with the mismatch metrics' moments)
                    assert numel % ROWS == 0 and numel // ROWS <= 128, (key, numel)
                else:
                    assert (name, group) == ("all_reduce", "process_group"), (key, calls)
            n_reduce = counts[("all_reduce", "process_group")]
            if str(key[-1]).startswith("calls/loss"):  # the loss records the outcome statistics of its
                # advantages: a layout of its own, agreed on once per process (2 int64 fingerprints)
                n_reduce -= min(1, sum(1 for name, group, numel in calls if numel == 2 and group == "process_group"))
            assert n_reduce == (0 if key[1] == "none" or key[-1] == "calls/agg" else 2), (key, calls)
        # O(B), not O(B·T): rows four times as long send exactly as many scalars over the sequence group.
        for layout in ("contiguous", "zigzag"):
            for kind in ("correction", "loss"):
                short, long = (per_rank[rank][(layout, "dp", f"calls/{kind}{suffix}")] for suffix in ("", "_long"))
                assert [c for c in short if c[1] == "sequence_group"] == [c for c in long if c[1] == "sequence_group"], \
                    (layout, kind, short, long)


def test_context_parallel_equals_unsplit(tmp_path):
    """CP = 2 × DP = 2 (4 processes), one preset per family and the hand-picked configurations."""
    run_grid(2, 2, FAMILY_PRESETS + list(EXTRA), ["decoupled_seq_is_rs", "bypass_pg_geo_rs_token_tis",
                                                  "decoupled_gspo_geo_is", "rs_valid_denominator"], tmp_path)


def test_context_parallel_three_ranks(tmp_path):
    """CP = 3 × DP = 2 (6 processes; one rank's contiguous slice is empty), a few configurations."""
    run_grid(3, 2, ["decoupled_geo_rs_token_tis", "rs_chain", "veto_legacy"], ["bypass_topr", "bypass_rollout_is"],
             tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_every_preset(cp, tmp_path):
    """CP = 2 and 3 × DP = 2 (4 and 6 processes), every preset, every loss type."""
    run_grid(cp, 2, ALL_PRESETS + list(EXTRA), LOSS_PRESETS, tmp_path, thorough=True)
