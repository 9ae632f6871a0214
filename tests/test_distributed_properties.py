"""Distributed property suite: a batch split in random layouts gives the single-process numbers.

Four gloo ranks (one thread each) are started once per test process and fed many drawn cases
(hypothesis draws in the test process, which also computes the single-process reference). A case:

* a topology: data parallel over 2 or 3 ranks (``process_group``), context parallel over 2 or 3
  ranks (``sequence_group``, whole batch in the group), or 2 × 2 data × context parallel, with
  ``process_group`` the data-parallel group without or with the context-parallel ranks;
* a configuration drawn from every option: IS level (segment included), mode, bound and batch
  normalisation; a chain of rejection options taken from the config's own registry
  (``RS_OPTIONS``, so options added there are drawn too) or a first-generation mode; both sides of
  the veto; M2PO; ``mismatch_metrics``; ``on_nonfinite``; expect-zero mode; loss type, bypass mode,
  OPSM and the aggregation mode of the policy loss; advantages passed to the correction or not;
* a layout: rows per data-parallel rank (0, 1 or more), its own width T per data-parallel rank
  (not padded to a common T), all-masked ranks, holes in the mask, segment ids on some rows only
  (ids in any order, one segment on a whole rank), a NaN / ±inf or an engine's −9999 sentinel at a
  valid position on one rank, garbage (NaN, ±inf, huge values) in the padding; the columns of each row split contiguously at
  drawn cuts (empty slices included) or zig-zag (2·CP chunks).

Asserted on every rank against one process holding the whole batch (padded to the largest width),
after checking that every effective sample size lies in [0, 1] on both:
the keep mask bit for bit; weights within rtol 1e-5 / atol 1e-6; every ``rollout_corr/*`` metric
(of ``compute_rollout_correction`` and of ``compute_policy_loss``) within rel 1e-5 / abs 1e-6;
the loss with global denominators (``global_num_tokens`` / ``global_num_seqs``: the summed rank
losses) within rel 1e-5 / abs 1e-6 and its gradient within rtol 1e-5 / atol 1e-6. ``actor/*``
metrics cover a data-parallel rank's sequences (documented): they must equal one process holding
that rank's whole rows (rel 1e-5 / abs 1e-6; with M2PO, whose mask is batch-global, they are
checked through the loss and gradient only). The tolerances are float32 rounding of partial sums
added in another order; a token kept or dropped differently moves a value by orders more.

Profiles: the default one (derandomised, about 60 s on two cores, part of CI) and ``-m nightly``
(``NIGHTLY_DRAWS`` random draws).
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import queue
import traceback
from typing import Any, Optional, get_args

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from rollout_correction import (LOSS_AGG_MODES, RolloutCorrectionConfig, compute_policy_loss,
                                compute_rollout_correction)
from rollout_correction_core._src.config import _BYPASS_ONLY_LOSSES, RS_OPTIONS, IsLevel, IsMode, LossDenominator, LossType
from rollout_correction_core._src.vocab import LEGACY_RS, ConfigError
from test_distributed import _free_port
from rollout_correction import Aggregation, ClipRange, Parallel, PolicyLoss, Segments

torch.set_num_threads(1)

WORLD = 4
FAST_DRAWS = 120
NIGHTLY_DRAWS = 600
FAST = settings(max_examples=FAST_DRAWS, deadline=None, derandomize=True, print_blob=True, database=None,
                suppress_health_check=list(HealthCheck))
NIGHTLY = settings(max_examples=NIGHTLY_DRAWS, deadline=None, print_blob=True, database=None, derandomize=False,
                   suppress_health_check=list(HealthCheck))  # random seeds (the suite's profile derandomizes)
TOL = dict(rel=1e-5, abs=1e-6)

# Topologies: (name, data-parallel size, context-parallel size). Rank = dp_rank · CP + cp_rank.
TOPOLOGIES = [("dp", 2, 1), ("dp", 3, 1), ("cp", 1, 2), ("cp", 1, 3), ("dpcp", 2, 2), ("dpcp_world", 2, 2)]
# Drawn from the configuration's own vocabularies, so that what is added there is drawn too.
IS_LEVELS, IS_MODES, LOSS_TYPES = list(get_args(IsLevel)), list(get_args(IsMode)), list(get_args(LossType))


# ----------------------------------------------------------------------------- the rank pool
def _groups() -> dict[str, Any]:
    """Every group a topology uses (each rank creates all of them, in the same order)."""
    made = {name: dist.new_group(ranks) for name, ranks in
            (("01", [0, 1]), ("012", [0, 1, 2]), ("23", [2, 3]), ("02", [0, 2]), ("13", [1, 3]))}
    made["world"] = dist.group.WORLD
    made[None] = None
    return made


def _serve(rank: int, port: int, inbox, outbox) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    groups = _groups()
    try:
        while True:
            task = inbox.get()
            if task is None:
                break
            task = pickle.loads(task)
            try:
                result = ("ok", run_shard(task, groups)) if task is not None else ("ok", None)
            except Exception as exc:  # reported to the test process, which fails the draw
                result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            outbox.put(pickle.dumps((rank, result)))
    finally:
        dist.destroy_process_group()


class Pool:
    """WORLD gloo ranks, started once; ``run`` hands each rank its task (None: sit out)."""

    def __init__(self) -> None:
        ctx = mp.get_context("fork")  # the ranks inherit the imported modules
        self.inboxes = [ctx.Queue() for _ in range(WORLD)]
        self.outbox = ctx.Queue()
        self.closed = False
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, port, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def run(self, tasks: list[Optional[dict]], timeout: float = 40.0) -> list:
        for box, task in zip(self.inboxes, tasks):
            box.put(pickle.dumps(task))
        results: list = [None] * WORLD
        for _ in range(WORLD):
            try:
                rank, result = pickle.loads(self.outbox.get(timeout=timeout))
            except queue.Empty:
                self.close()
                told = [f"rank {r}: {res[1]}" for r, res in enumerate(results) if res is not None and res[0] == "error"]
                raise RuntimeError("a rank did not answer (waiting in a collective?); " + "\n".join(told)) from None
            results[rank] = result
        errors = [f"rank {r}: {res[1]}" for r, res in enumerate(results) if res[0] == "error"]
        if errors:  # the group may be left inside a collective: the next case gets fresh ranks
            self.close()
            raise AssertionError("\n".join(errors))
        return [res[1] for res in results]

    @property
    def alive(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        self.closed = True
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


_POOL: list[Pool] = []


@pytest.fixture(scope="module")
def pool():
    def get() -> Pool:
        if not _POOL or not _POOL[0].alive:  # a failed draw may have broken the group: start anew
            if _POOL:
                _POOL.pop().close()
            _POOL.append(Pool())
        return _POOL[0]

    yield get
    if _POOL:
        _POOL.pop().close()


# ----------------------------------------------------------------------------- one shard's results
def _np(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().numpy().copy()


def _t(a) -> Optional[torch.Tensor]:
    return None if a is None else torch.from_numpy(np.asarray(a))


def _calls(arrays: dict, config: dict, loss_config: dict, loss: dict, process_group, sequence_group) -> dict:
    """The correction and the policy loss (with its gradient) for one batch or shard."""
    old, rollout, mask, log_prob, adv = (_t(arrays[k]) for k in ("old", "rollout", "mask", "log_prob", "adv"))
    ids = _t(arrays["segment_ids"])
    seg = dict(segments=None if ids is None else Segments(ids, count=arrays["max_segments"]))
    settings = PolicyLoss(ClipRange(loss["clip_ratio_low"], loss["clip_ratio_high"], loss["clip_ratio_c"]),
                          Aggregation(loss["loss_agg_mode"], loss.get("global_num_tokens"), loss.get("global_num_seqs"),
                                      scale_factor=loss.get("loss_scale_factor")))
    cfg = RolloutCorrectionConfig.from_dict(config)
    train = log_prob if cfg.bypass_mode else old  # the sides the loss's own correction compares
    res = compute_rollout_correction(
        train, rollout, mask, config=cfg, **seg, advantages=adv if arrays["with_adv"] else None,
        parallel=Parallel(dp_group=process_group, cp_group=sequence_group))
    out = {"weights": _np(res.weights), "mask": _np(res.response_mask), "metrics": res.metrics_as_floats()}
    lp = log_prob.clone().requires_grad_(True)
    value, metrics = compute_policy_loss(
        lp, old, adv, mask, config=RolloutCorrectionConfig.from_dict(loss_config), rollout_log_prob=rollout,
        loss=settings, **seg, parallel=Parallel(dp_group=process_group, cp_group=sequence_group))
    value.backward()
    out["loss"] = float(value.detach())
    out["grad"] = _np(lp.grad)
    out["loss_metrics"] = {k: float(v) for k, v in metrics.items()}
    return out


def run_shard(task: dict, groups: dict) -> dict:
    return _calls(task["arrays"], task["config"], task["loss_config"], task["loss"], groups[task["pg"]],
                  groups[task["sg"]])


# ----------------------------------------------------------------------------- drawing cases
def _option_threshold(draw, name: str):
    est = RS_OPTIONS[name][1] if isinstance(RS_OPTIONS.get(name), tuple) else None
    agg = RS_OPTIONS[name][0] if isinstance(RS_OPTIONS.get(name), tuple) else ""
    if est == "k1":
        lo = draw(st.floats(0.2, 0.97))
        hi = draw(st.floats(1.03, 4.0))
        return f"{lo:.4g}_{hi:.4g}"
    if est in ("tv",):
        return draw(st.floats(0.02, 0.5))
    if est in ("k2", "k3", "binary_kl"):
        scale = 3.0 if str(agg).endswith("_sum") else 0.6
        return draw(st.floats(0.003, scale))
    # an option this suite does not know the threshold of: a bound, a ratio band or a signed band,
    # whichever the configuration reads (the others are redrawn)
    return draw(st.one_of(st.floats(0.01, 3.0), st.tuples(st.floats(0.2, 0.97), st.floats(1.03, 4.0)).map(
        lambda b: f"{b[0]:.4g}_{b[1]:.4g}"), st.tuples(st.floats(-0.5, -0.01), st.floats(0.01, 0.5)).map(
        lambda b: f"{b[0]:.4g}_{b[1]:.4g}")))


@st.composite
def configs(draw) -> dict:
    """A configuration dictionary drawn from every option (an invalid combination is redrawn)."""
    cfg: dict[str, Any] = {}
    if draw(st.integers(0, 7)) == 0:  # expect-zero mode (warning, not raising: the rows hold real gaps)
        return dict(expect_zero_atol=draw(st.floats(0.0, 1.0)), expect_zero_action="warn",
                    mismatch_metrics=draw(st.booleans()), on_nonfinite=draw(st.sampled_from(["reject", "raise"])))
    level = draw(st.sampled_from([None] + IS_LEVELS))
    if level is not None:
        cfg["rollout_is"] = level
        band = draw(st.booleans())
        if band:
            cfg["rollout_is_threshold"] = f"{draw(st.floats(0.1, 0.9)):.4g}_{draw(st.floats(1.1, 6.0)):.4g}"
            cfg["rollout_is_mode"] = draw(st.sampled_from([m for m in IS_MODES if m != "truncate"]))
        else:
            cfg["rollout_is_threshold"] = draw(st.floats(1.05, 6.0))
            cfg["rollout_is_mode"] = draw(st.sampled_from([None] + IS_MODES))
        cfg["rollout_is_batch_normalize"] = draw(st.booleans())
    if draw(st.booleans()):
        if draw(st.integers(0, 5)) == 0:
            cfg["rollout_rs"] = draw(st.sampled_from(sorted(LEGACY_RS)))
            cfg["rollout_rs_threshold"] = draw(st.floats(1.1, 4.0))
        else:
            names = draw(st.lists(st.sampled_from(sorted(RS_OPTIONS)), min_size=1, max_size=3, unique=True))
            cfg["rollout_rs"] = ",".join(names)
            cfg["rollout_rs_threshold"] = tuple(_option_threshold(draw, n) for n in names)
    low = draw(st.one_of(st.none(), st.floats(0.02, 0.6)))
    high = draw(st.one_of(st.none(), st.floats(1.5, 30.0)))
    if low is not None:
        cfg["rollout_token_veto_threshold"] = low
    if high is not None:
        cfg["rollout_token_veto_threshold_high"] = high
    if draw(st.integers(0, 3)) == 0:
        cfg["rollout_m2po_threshold"] = draw(st.floats(0.0, 0.3))
    cfg["mismatch_metrics"] = draw(st.booleans())
    cfg["on_nonfinite"] = draw(st.sampled_from(["reject", "raise"]))
    try:
        RolloutCorrectionConfig.from_dict(cfg)
    except ConfigError:
        assume(False)
    return cfg


@st.composite
def loss_settings(draw, config: dict, split: bool) -> tuple[dict, dict]:
    """(the loss's config: ``config`` with a loss type, bypass mode and OPSM; the aggregation)."""
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    bypass = True if loss_type in _BYPASS_ONLY_LOSSES else draw(st.booleans())
    lc = dict(config, loss_type=loss_type, bypass_mode=bypass,
              loss_denominator=draw(st.sampled_from(get_args(LossDenominator))))
    if split:  # refused with a sequence group (a clear ValueError, tested in test_context_parallel)
        lc.pop("rollout_m2po_threshold", None)
        assume(lc.get("rollout_is") != "prefix_min")  # needs whole sequences (refusal: test_prefix_min)
    elif draw(st.integers(0, 3)) == 0 and "expect_zero_atol" not in config:
        lc["rollout_opsm_delta"] = draw(st.floats(-0.2, 0.5))
    agg = dict(loss_agg_mode=draw(st.sampled_from(LOSS_AGG_MODES)),
               clip_ratio_low=draw(st.sampled_from([0.2, 0.1, 0.5])),
               clip_ratio_high=draw(st.sampled_from([0.2, 0.28, 0.6])),
               clip_ratio_c=draw(st.sampled_from([3.0, 1.5, 10.0])))
    return lc, agg


GARBAGE = [math.nan, math.inf, -math.inf, 1e30, -1e30, 7.0]


@st.composite
def cases(draw) -> dict:
    name, dp, cp = draw(st.sampled_from(TOPOLOGIES))
    config = draw(configs())
    cfg = RolloutCorrectionConfig.from_dict(config)
    loss_config, agg = draw(loss_settings(config, split=cp > 1))
    rows = draw(st.lists(st.sampled_from([0, 0, 1, 1, 2, 3, 5]), min_size=dp, max_size=dp))
    assume(sum(rows) > 0)
    widths = draw(st.lists(st.integers(0, 9), min_size=dp, max_size=dp))
    all_masked = draw(st.lists(st.integers(0, 4), min_size=dp, max_size=dp))  # 0: the rank's rows are all padding
    segments = cfg.uses_segments or draw(st.booleans())
    max_segments = draw(st.integers(1, 4)) if segments else None
    one_segment_rank = draw(st.integers(-1, dp - 1)) if segments else -1
    nonfinite = draw(st.one_of(st.none(), st.tuples(st.integers(0, dp - 1),
                                                     st.sampled_from(["old", "rollout", "log_prob", "adv"]),
                                                     st.sampled_from([math.nan, math.inf, -math.inf, -9999.0]))))
    if config["on_nonfinite"] == "raise":
        nonfinite = None  # raising is refused on every rank alike only for split rows; not compared here
    layouts = [draw(st.sampled_from(["contiguous", "zigzag"])) for _ in range(dp)]
    cuts = [sorted(draw(st.lists(st.integers(0, 9), min_size=cp - 1, max_size=cp - 1))) for _ in range(dp)]
    return dict(topology=(name, dp, cp), config=config, loss_config=loss_config, agg=agg, rows=rows,
                widths=widths, all_masked=all_masked, segments=segments, max_segments=max_segments,
                one_segment_rank=one_segment_rank, nonfinite=nonfinite, layouts=layouts, cuts=cuts,
                garbage=draw(st.sampled_from(GARBAGE)), seed=draw(st.integers(0, 2 ** 31 - 1)),
                holes=draw(st.booleans()), per_token_adv=draw(st.booleans()), with_adv=draw(st.booleans()))


# ----------------------------------------------------------------------------- building a case
def data_parallel_batches(case: dict) -> list[dict]:
    """Each data-parallel rank's rows at its own width (numpy arrays)."""
    gen = torch.Generator().manual_seed(case["seed"])
    out = []
    for d, (B, T) in enumerate(zip(case["rows"], case["widths"])):
        old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3.0 - 0.02
        rollout = (old + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)
        log_prob = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0.0)
        if case["per_token_adv"]:
            adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
        else:
            adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T).clone()
        lengths = torch.randint(0, T + 1, (B,), generator=gen)
        mask = torch.arange(T)[None, :] < lengths[:, None]
        if case["holes"] and T > 2:
            mask &= torch.rand(B, T, generator=gen) > 0.25
        if case["all_masked"][d] == 0:
            mask[:] = False
        seg = None
        if case["segments"]:
            S = case["max_segments"]
            seg = torch.randint(0, S, (B, T), generator=gen)
            seg = seg.sort(-1).values if bool(torch.rand((), generator=gen) < 0.5) else seg  # turns, or any order
            without = torch.rand(B, generator=gen) < 0.4  # rows without segment ids: one segment
            seg[without] = 0
            if case["one_segment_rank"] == d:
                seg[:] = 0
            seg = seg.where(mask, torch.full_like(seg, 3 * S + 1))  # ids at masked positions are ignored
        arrays = dict(old=old, rollout=rollout, log_prob=log_prob, adv=adv)
        if case["nonfinite"] is not None and case["nonfinite"][0] == d and bool(mask.any()):
            which, value = case["nonfinite"][1:]
            pos = mask.nonzero()[int(torch.randint(0, int(mask.sum()), (1,), generator=gen))]
            arrays[which] = arrays[which].clone()
            arrays[which][pos[0], pos[1]] = value
        pad = ~mask
        g = case["garbage"]
        for k in arrays:  # garbage in the padding must not leak anywhere (not even into the gradient)
            arrays[k] = torch.where(pad, torch.full_like(arrays[k], g), arrays[k]).to(torch.float32)
        arrays["mask"] = mask.to(torch.float32)
        arrays["segment_ids"] = seg
        out.append(arrays)
    return out


def pad_to(arrays: dict, T: int, garbage: float) -> dict:
    """``arrays`` widened to T columns of padding (mask 0, garbage values, segment id 0)."""
    out = {}
    for k, v in arrays.items():
        if v is None:
            out[k] = None
            continue
        extra = T - v.shape[1]
        fill = 0 if k in ("mask", "segment_ids") else garbage
        out[k] = torch.cat([v, torch.full((v.shape[0], extra), fill, dtype=v.dtype)], 1)
    return out


def columns(layout: str, T: int, cp: int, cp_rank: int, cuts: list[int]) -> torch.Tensor:
    """Column indices held by ``cp_rank`` of a row of width T; -1: a padding column."""
    if cp == 1:
        return torch.arange(T)
    if layout == "contiguous":
        bounds = [0] + [min(c, T) for c in cuts] + [T]
        return torch.arange(bounds[cp_rank], bounds[cp_rank + 1])
    chunk = math.ceil(T / (2 * cp)) if T else 0
    idx = torch.arange(2 * cp * chunk)
    idx = torch.where(idx < T, idx, torch.full_like(idx, -1))
    return torch.cat([idx[cp_rank * chunk:(cp_rank + 1) * chunk],
                      idx[(2 * cp - 1 - cp_rank) * chunk:(2 * cp - cp_rank) * chunk]])


def take(arrays: dict, cols: torch.Tensor, garbage: float) -> dict:
    out = {}
    for k, v in arrays.items():
        if v is None:
            out[k] = None
            continue
        part = v[:, cols.clamp_min(0)]
        fill = 0 if k in ("mask", "segment_ids") else garbage
        out[k] = torch.where(cols >= 0, part, torch.full_like(part, fill))
    return out


def to_numpy(arrays: dict, max_segments, with_adv: bool = False) -> dict:
    out = {k: (None if v is None else v.numpy()) for k, v in arrays.items()}
    out["max_segments"], out["with_adv"] = max_segments, with_adv  # the correction gets the advantages too
    return out


GROUPS = {  # topology -> (process_group name, sequence_group name) per rank
    "dp": lambda rank, world: ("01" if world == 2 else "012", None),
    "cp": lambda rank, world: (None, "01" if world == 2 else "012"),
    "dpcp": lambda rank, world: (("02", "13")[rank % 2], ("01", "23")[rank // 2]),
    "dpcp_world": lambda rank, world: ("world", ("01", "23")[rank // 2]),
}


def run_case(get_pool, case: dict) -> None:
    name, dp, cp = case["topology"]
    world = dp * cp
    shards = data_parallel_batches(case)
    widths = [s["old"].shape[1] for s in shards]
    T = max(widths)
    garbage = case["garbage"]
    whole = {k: (None if shards[0][k] is None else torch.cat([pad_to(s, T, garbage)[k] for s in shards]))
             for k in shards[0]}
    mask = whole["mask"] > 0
    loss = dict(case["agg"], global_num_tokens=int(mask.sum()), global_num_seqs=int(mask.any(-1).sum()),
                loss_scale_factor=float(max(T, 1)))
    tasks: list[Optional[dict]] = [None] * WORLD
    placement = {}
    starts = np.cumsum([0] + case["rows"])
    for rank in range(world):
        d, c = divmod(rank, cp)
        cols = columns(case["layouts"][d], widths[d], cp, c, case["cuts"][d])
        placement[rank] = (slice(int(starts[d]), int(starts[d + 1])), cols)
        pg, sg = GROUPS[name](rank, world)
        tasks[rank] = dict(arrays=to_numpy(take(shards[d], cols, garbage), case["max_segments"], case["with_adv"]),
                           config=case["config"], loss_config=case["loss_config"], loss=loss, pg=pg, sg=sg)
    results = get_pool().run(tasks)
    expected = _calls(to_numpy(whole, case["max_segments"], case["with_adv"]), case["config"], case["loss_config"],
                      loss, None, None)
    per_rank_actor = [_calls(to_numpy(s, case["max_segments"], case["with_adv"]), case["config"], case["loss_config"],
                             loss, None,
                             None)["loss_metrics"] for s in shards]
    m2po = "rollout_m2po_threshold" in case["loss_config"]
    total = 0.0
    for rank in range(world):
        got, (rows, cols) = results[rank], placement[rank]
        ctx = f"rank {rank} ({name}, rows {rows.start}:{rows.stop}, columns {cols.tolist()})"
        real = cols >= 0
        cols_real = cols[real]

        def part(x):
            return x[rows][:, cols_real]

        assert np.array_equal(got["mask"][:, real.numpy()], part(torch.from_numpy(expected["mask"])).numpy()), ctx
        if expected["weights"] is None:
            assert got["weights"] is None, ctx
        else:
            torch.testing.assert_close(torch.from_numpy(got["weights"])[:, real], part(torch.from_numpy(expected["weights"])),
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{ctx} weights: {m}")
        for metrics in (expected["metrics"], expected["loss_metrics"], got["metrics"], got["loss_metrics"]):
            _ess_within_one(metrics, ctx)
        _same(expected["metrics"], got["metrics"], f"{ctx} correction metrics")
        _same({k: v for k, v in expected["loss_metrics"].items() if not k.startswith("actor/")},
              {k: v for k, v in got["loss_metrics"].items() if not k.startswith("actor/")}, f"{ctx} loss metrics")
        actor_expected = {k: v for k, v in per_rank_actor[rank // cp].items() if k.startswith("actor/")}
        actor_got = {k: v for k, v in got["loss_metrics"].items() if k.startswith("actor/")}
        if m2po:
            assert actor_got.keys() == actor_expected.keys(), ctx
            _same({"actor/nonfinite_seq_fraction": actor_expected["actor/nonfinite_seq_fraction"]},
                  {"actor/nonfinite_seq_fraction": actor_got["actor/nonfinite_seq_fraction"]}, ctx)
        else:
            _same(actor_expected, actor_got, f"{ctx} actor metrics")
        torch.testing.assert_close(torch.from_numpy(got["grad"])[:, real], part(torch.from_numpy(expected["grad"])),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{ctx} gradient: {m}")
        total += got["loss"]
    assert total == pytest.approx(expected["loss"], **TOL), (total, expected["loss"])


#: Effective sample sizes, fractions of the sample: in [0, 1] in every layout (miles #3230 logged 1.25
#: from per-sample sums divided by a rollout count).
ESS_METRICS = ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_is_seq_raw_ess")


def _ess_within_one(metrics: dict, context: str) -> None:
    for k in ESS_METRICS:
        assert k not in metrics or 0.0 <= metrics[k] <= 1.0, f"{context}: {k} = {metrics[k]!r} outside [0, 1]"


def _same(expected: dict, got: dict, context: str) -> None:
    assert expected.keys() == got.keys(), f"{context}: names differ: {set(expected) ^ set(got)}"
    bad = [f"{k}: single process {expected[k]!r}, split {got[k]!r}" for k in expected
           if not math.isclose(got[k], expected[k], rel_tol=TOL["rel"], abs_tol=TOL["abs"])]
    assert not bad, f"{context}:\n  " + "\n  ".join(bad)


# ----------------------------------------------------------------------------- the tests
#: The layout that broke the segment level: 3 ranks, rows (0, 0), (0, 9), (9, 20) of a (20, 60)
#: batch, rollout_is="segment", max_segments=3 (rank 0 holds no rows); and the same with a rank
#: whose rows all have one segment.
ISSUE_LAYOUT = dict(topology=("dp", 3, 1), config=dict(rollout_is="segment", rollout_is_threshold=2.0,
                                                        on_nonfinite="reject"),
                    loss_config=dict(rollout_is="segment", rollout_is_threshold=2.0, loss_type="ppo_clip",
                                     bypass_mode=False, on_nonfinite="reject"),
                    agg=dict(loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0),
                    rows=[0, 9, 11], widths=[60, 60, 60], all_masked=[1, 1, 1], segments=True, max_segments=3,
                    one_segment_rank=-1, nonfinite=None, layouts=["contiguous"] * 3, cuts=[[], [], []],
                    garbage=math.nan, seed=5, holes=False, per_token_adv=False, with_adv=True)


#: Expect-zero mode with a row split over two ranks and a NaN in the part one rank holds: the row is
#: dropped, and its largest gap (1e30) must be the group's on every rank, not the rank's own.
EXPECT_ZERO_SPLIT = dict(
    ISSUE_LAYOUT, topology=("cp", 1, 2),
    config=dict(expect_zero_atol=0.5, expect_zero_action="warn", mismatch_metrics=False, on_nonfinite="reject"),
    loss_config=dict(expect_zero_atol=0.5, expect_zero_action="warn", mismatch_metrics=False, on_nonfinite="reject",
                     loss_type="ppo_clip", bypass_mode=False, loss_denominator="kept"),
    rows=[3], widths=[8], all_masked=[1], segments=False, max_segments=None, nonfinite=(0, "old", math.nan),
    layouts=["contiguous"], cuts=[[4]], seed=11, with_adv=False)


@FAST
@example(case=EXPECT_ZERO_SPLIT)
@example(case=dict(EXPECT_ZERO_SPLIT, nonfinite=(0, "rollout", -math.inf), layouts=["zigzag"], seed=3))
@example(case=ISSUE_LAYOUT)
@example(case=dict(ISSUE_LAYOUT, one_segment_rank=1))
@example(case=dict(ISSUE_LAYOUT, config=dict(ISSUE_LAYOUT["config"], rollout_is_batch_normalize=True,
                                             rollout_rs="segment_max_tv,segment_mean_k3",
                                             rollout_rs_threshold=(0.4, 0.3))))
@given(case=cases())
def test_split_batch_equals_single_process(pool, case):
    run_case(pool, case)


@pytest.mark.nightly
@NIGHTLY
@given(case=cases())
def test_split_batch_equals_single_process_nightly(pool, case):
    run_case(pool, case)


def test_context_parallel_group_without_rows(pool):
    """A data-parallel rank whose context-parallel group holds no rows (B = 0) alongside one that
    holds rows: the exchange of per-row values has nothing to send (it failed reshaping (0,) to
    (-1, 0), and the other data-parallel rank then waited in its all-reduce)."""
    config = dict(rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
                  rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold=(0.3, "0.3_3"), on_nonfinite="reject")
    case = dict(ISSUE_LAYOUT, topology=("dpcp", 2, 2), config=config,
                loss_config=dict(config, loss_type="gspo", bypass_mode=True),
                agg=dict(ISSUE_LAYOUT["agg"], loss_agg_mode="seq-mean-token-mean"), rows=[0, 3], widths=[5, 6],
                all_masked=[1, 1], segments=False, max_segments=None, layouts=["contiguous", "zigzag"],
                cuts=[[2], [4]], holes=True)
    run_case(pool, case)
    run_case(pool, dict(case, topology=("dpcp_world", 2, 2), rows=[2, 0]))
