"""One pass over the rows: everything the report needs, accumulated chunk by chunk.

:class:`MismatchProfile` feeds each chunk to

* the core's ``OffPolicyAccumulator`` — the off-policy metric set, identical to
  ``compute_offpolicy_metrics`` on the whole file;
* one core ``CorrectionAccumulator`` per preset — the what-if table;
* fixed-bin histograms and keyed sums of its own (log-ratio distributions, mismatch by position,
  by response length, by policy version and by token id, raw importance-weight moments).

Notation (per valid token t of row i): log ρₜ = old − rollout; ρₜ = exp(clamp(log ρₜ, ±20)).
Sequence log-weight Sᵢ = Σₜ log ρₜ, geometric log-weight Gᵢ = Sᵢ / Lᵢ with Lᵢ the number of
valid tokens; rows with Lᵢ = 0 enter no sequence statistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout_correction import (METRIC_PREFIX, SAFETY_BOUND, CorrectionAccumulator, OffPolicyAccumulator, RolloutCorrectionConfig,
                                metrics_to_floats)
from rollout_correction.primitives import AlignmentReport, alignment_report, alignment_statistics, log_ratio_batch

from .histograms import AdaptiveLinearHistogram, Histogram, KeyedSums, symlog_edges
from .readers import Chunk
from .sentinels import DEFAULT_LOG_PROB_FLOOR, SentinelScan

LOG_CLAMP = SAFETY_BOUND  # the core's safety bound on log-ratios before every exp
VETO_THRESHOLD = 1e-4  # a token with ρ below this is "catastrophic" (seed 001's veto default)
HEALTHY_BAND = (0.5, 2.0)  # the seeds' band for a single ratio / the mean weight
LEVELS = ("token", "sequence", "geometric")
LOG_RATIO_EDGES = symlog_edges(1e-6, 1e3, per_decade=16)


@dataclass
class LevelMoments:
    """Raw (untruncated, safety-bounded) importance weights at one level.

    Over n units (tokens for ``token``, rows for ``sequence``/``geometric``) with weights wᵤ:
    mean = Σw/n, std = sqrt(Σw²/n − mean²), Kish ESS = (Σw)² / (n·Σw²) ∈ (0, 1],
    outside = fraction of units with w ∉ [0.5, 2]; log_mean / log_std: moments of log w
    (unclamped).
    """

    n: int = 0
    sum_w: float = 0.0
    sum_w2: float = 0.0
    outside: int = 0
    sum_log_w: float = 0.0
    sum_log_w2: float = 0.0
    min_log_w: float = math.inf
    max_log_w: float = -math.inf

    def update(self, log_w: torch.Tensor) -> None:
        if log_w.numel() == 0:
            return
        w = torch.exp(log_w.clamp(-LOG_CLAMP, LOG_CLAMP))
        self.n += int(log_w.numel())
        self.sum_w += float(w.sum())
        self.sum_w2 += float((w * w).sum())
        lo, hi = math.log(HEALTHY_BAND[0]), math.log(HEALTHY_BAND[1])
        self.outside += int(((log_w < lo) | (log_w > hi)).sum())
        self.sum_log_w += float(log_w.sum())
        self.sum_log_w2 += float((log_w * log_w).sum())
        self.min_log_w = min(self.min_log_w, float(log_w.min()))
        self.max_log_w = max(self.max_log_w, float(log_w.max()))

    def as_dict(self) -> dict[str, float]:
        if self.n == 0:
            return {"n": 0, "mean": 1.0, "std": 0.0, "ess": 1.0, "fraction_outside": 0.0,
                    "log_mean": 0.0, "log_std": 0.0, "min_log_w": 0.0, "max_log_w": 0.0}
        mean = self.sum_w / self.n
        var = max(self.sum_w2 / self.n - mean * mean, 0.0)
        return {
            "n": self.n,
            "mean": mean,
            "std": math.sqrt(var),
            "ess": (self.sum_w * self.sum_w) / (self.n * self.sum_w2) if self.sum_w2 > 0 else 1.0,
            "fraction_outside": self.outside / self.n,
            "log_mean": self.sum_log_w / self.n,
            "log_std": math.sqrt(max(self.sum_log_w2 / self.n - (self.sum_log_w / self.n) ** 2, 0.0)),
            "min_log_w": self.min_log_w,
            "max_log_w": self.max_log_w,
        }


@dataclass
class Counters:
    rows: int = 0  # rows read from the file
    rows_used: int = 0  # rows with at least one valid token and finite log-probs
    rows_empty: int = 0  # rows with no valid token
    rows_nonfinite: int = 0  # rows excluded: NaN / ±inf log-prob at a valid position
    tokens: int = 0  # valid tokens in the rows used
    tokens_positive_log_prob: int = 0  # valid input tokens with a log-prob > 0 (not a log-probability)
    tokens_identical: int = 0  # log ρ exactly 0
    tokens_rollout_higher: int = 0  # log π_rollout > log π_train (log ρ < 0)
    rows_vetoed: int = 0  # rows with a token ρ < VETO_THRESHOLD (unclamped)
    tokens_catastrophic: int = 0
    max_length: int = 0
    # reward vs. sequence log-weight (Pearson correlation from sums)
    reward_rows: int = 0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    sum_s: float = 0.0
    sum_s2: float = 0.0
    sum_rs: float = 0.0


@dataclass
class ProfileResult:
    """Everything measured, as plain Python / numpy values."""

    metrics: dict[str, float]  # the core's off-policy metric set, 'rollout_corr/...'
    what_if: list[dict]  # one entry per preset
    levels: dict[str, dict[str, float]]  # LevelMoments.as_dict() per level
    histograms: dict[str, Histogram]  # log-weights per level, symmetric-log bins (tails)
    linear: dict[str, AdaptiveLinearHistogram]  # log-weights per level, linear bins (bulk)
    alignment: AlignmentReport  # the core's one-token shift detector
    position: KeyedSums  # keyed by token position
    length: KeyedSums  # keyed by response length (rows)
    version: dict[int, dict[str, float]]
    token: KeyedSums | None  # keyed by token id
    counters: Counters
    extras: dict[str, float] = field(default_factory=dict)
    sentinels: dict = field(default_factory=dict)  # SentinelScan.as_dict(): engine sentinels per side


class FinalWeightMoments:
    """Moments of the final weights, fed by a ``CorrectionAccumulator``'s ``on_batch`` hook.

    final weight per valid token = IS weight (1 when the config has none) × 1[kept by rejection];
    ESS_final = (Σw)² / (n·Σw²) over the n valid tokens, 0 when everything is rejected.
    """

    def __init__(self) -> None:
        self.n = self.sum_w = self.sum_w2 = 0.0

    def __call__(self, batch, weights, keep) -> None:
        valid = batch.valid
        w = weights if weights is not None else valid.to(torch.float32)
        wf = torch.where((keep != 0) & valid, w, 0.0)
        self.n += float(batch.n_row.sum(dtype=torch.float64))
        self.sum_w += float(wf.sum(dtype=torch.float64))
        self.sum_w2 += float(wf.square().sum(dtype=torch.float64))

    def ess(self) -> float:
        return (self.sum_w * self.sum_w) / (self.n * self.sum_w2) if self.sum_w2 > 0 and self.n > 0 else 0.0


def _what_if_entry(name: str, m: dict[str, float], ess_final: float) -> dict:
    """The what-if row of one preset from the core's correction metrics.

    truncated: fraction of valid tokens (sequences for sequence-level IS) whose weight the
    threshold changes (TIS: raw ratio above the cap; IcePop: raw ratio outside the band);
    rejected: fraction of valid tokens / rows removed by rejection sampling (and veto);
    ess: Kish ESS of the final weights (IS weight × kept), see :class:`FinalWeightMoments`;
    is_ess: the core's ``rollout_is_eff_sample_size`` (IS weights only, before rejection).
    """
    p = METRIC_PREFIX
    has_is = f"{p}rollout_is_mean" in m
    if not has_is:
        truncated = 0.0
    elif f"{p}rollout_is_oob_ratio" in m:
        truncated = m[f"{p}rollout_is_oob_ratio"]
    else:
        truncated = m[f"{p}rollout_is_ratio_fraction_high"]
    rejected = m.get(f"{p}rollout_rs_masked_fraction", 0.0)
    rejected_seq = m.get(f"{p}rollout_rs_seq_masked_fraction", 0.0)
    veto = m.get(f"{p}rollout_is_veto_fraction")
    if veto is not None:
        rejected_seq = max(rejected_seq, veto)
    return {
        "preset": name,
        "is_weights": has_is,
        "truncated_fraction": float(truncated),
        "rejected_token_fraction": float(rejected),
        "rejected_seq_fraction": float(rejected_seq),
        "ess": float(ess_final),
        "is_ess": float(m[f"{p}rollout_is_eff_sample_size"]) if has_is else None,
        "mean_weight": float(m.get(f"{p}rollout_is_mean", 1.0)),
        "metrics": {k: float(v) for k, v in m.items()},
    }


class MismatchProfile:
    """Accumulates a :class:`ProfileResult` over chunks of rows.

    presets: names for the what-if table (default: every preset of the core); ``[]`` skips it.
    track_tokens: keep per-token-id sums when the file has token ids.
    max_block_elements: largest (rows × width) block processed at once (bounds memory).
    log_prob_floor: log-probs at or below it at valid positions are counted as engine sentinels
      (:mod:`.sentinels`; None: not counted).
    """

    def __init__(self, presets: list[str] | None = None, track_tokens: bool = True,
                 max_block_elements: int = 4_000_000, log_prob_floor: float | None = DEFAULT_LOG_PROB_FLOOR):
        self._offpolicy = OffPolicyAccumulator(mismatch_metrics=True, metrics=("default", "ratio_bands"))
        names = list(RolloutCorrectionConfig.preset_names()) if presets is None else list(presets)
        # Presets that differ only in the loss (bypass vs decoupled, PPO vs REINFORCE) have the same
        # weights and masks: compute each distinct correction once.
        self._preset_key: dict[str, tuple] = {}
        self._what_if: dict[tuple, tuple[CorrectionAccumulator, FinalWeightMoments]] = {}
        for n in names:
            cfg = RolloutCorrectionConfig.from_preset(n)
            key = (cfg.is_spec, cfg.rs_options, cfg.rollout_token_veto_threshold)
            self._preset_key[n] = key
            if key not in self._what_if:
                final = FinalWeightMoments()
                self._what_if[key] = (CorrectionAccumulator(cfg, on_batch=final), final)
        self.levels = {lvl: LevelMoments() for lvl in LEVELS}
        self.histograms = {lvl: Histogram(LOG_RATIO_EDGES) for lvl in LEVELS}
        self.position = KeyedSums(("log_ratio", "abs_log_ratio", "k3"))
        self.length = KeyedSums(("k3_mean", "seq_log_ratio", "abs_seq_log_ratio", "seq_outside"))
        self.version: dict[int, dict[str, float]] = {}
        self.token = KeyedSums(("log_ratio", "abs_log_ratio", "k3")) if track_tokens else None
        self.counters = Counters()
        self.sentinels = SentinelScan(log_prob_floor)
        self.max_block_elements = max_block_elements
        self.alignment = torch.zeros(4, dtype=torch.float64)
        self.linear = {lvl: AdaptiveLinearHistogram() for lvl in LEVELS}

    # ------------------------------------------------------------------ per chunk
    def _feed_core(self, old: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor):
        """Every core accumulator's ``update`` on one chunk, sharing a single ``LogRatioBatch``.

        Equivalent to calling ``acc.update(old, roll, mask)`` on each accumulator (the tests check
        the result against the public functions); building the log-ratio once instead of once per
        preset is what keeps a 10M-token file under a minute. Returns the batch, whose log-ratio,
        k3 and row sums the profile's own statistics reuse.
        """
        batch = log_ratio_batch(old, roll, mask)
        for acc in (self._offpolicy, *(acc for acc, _ in self._what_if.values())):
            acc.update_batch(batch)
        return batch

    def update(self, chunk: Chunk) -> None:
        """Adds one chunk (whole rows), in blocks.

        When padding wastes more than 30 % of the chunk, its rows are sorted by length and cut into
        four groups, so a few long rows do not pad the short ones; any group larger than
        ``max_block_elements`` (rows × width) is cut further, which bounds the memory of the
        intermediate (rows, width) tensors. No statistic depends on the order or grouping of rows.
        """
        self.sentinels.update(chunk, self.counters.rows)  # before the rows are counted: the chunk's first row
        lengths = chunk.response_mask.sum(axis=1)
        n = chunk.num_rows
        width = chunk.response_mask.shape[1]
        wasteful = n >= 64 and width > 0 and lengths.sum() < 0.7 * n * width
        if not wasteful and n * width <= self.max_block_elements:
            self._update_block(chunk)
            return
        order = np.argsort(lengths, kind="stable") if wasteful else np.arange(n)
        for part in np.array_split(order, 4 if wasteful else 1):
            if part.size == 0:
                continue
            top = max(int(lengths[part].max()) if wasteful else width, 1)
            step = max(1, self.max_block_elements // top)
            for s in range(0, part.size, step):
                self._update_block(chunk.take(part[s:s + step], top))

    def _update_block(self, chunk: Chunk) -> None:
        c = self.counters
        f64 = torch.float64
        mask_in = torch.from_numpy(chunk.response_mask)
        old32 = torch.from_numpy(chunk.old_log_probs)
        roll32 = torch.from_numpy(chunk.rollout_log_probs)
        c.rows += chunk.num_rows
        # The core's statistics see the rows exactly as read; it drops (and counts) rows with a
        # non-finite log-prob at a valid position, and so do our own statistics below.
        batch = self._feed_core(old32, roll32, mask_in)
        bad_row = batch.bad_rows
        c.rows_nonfinite += int(bad_row.sum())
        mask = batch.valid
        lr = batch.log_ratio  # float32, 0 where not valid
        k3 = batch.k3
        lengths = batch.n_row
        has = batch.row_valid
        c.rows_empty += int((~has & ~bad_row).sum())
        # a log-prob > 0 is no probability: the core drops its row (counted above); counted here on the input
        c.tokens_positive_log_prob += int((((old32 > 0) | (roll32 > 0)) & (mask_in != 0)).sum())
        valid_lr = lr[mask]
        n_tok = int(valid_lr.numel())
        if n_tok == 0:
            return
        c.tokens += n_tok
        c.max_length = max(c.max_length, int(lengths.max()))
        c.tokens_identical += int((valid_lr == 0).sum())
        c.tokens_rollout_higher += int((valid_lr < 0).sum())
        catastrophic = mask & (lr < math.log(VETO_THRESHOLD))
        c.tokens_catastrophic += int(catastrophic.sum())
        c.rows_vetoed += int(catastrophic.any(dim=1).sum())

        # token level
        valid_lr64 = valid_lr.to(f64)
        self.levels["token"].update(valid_lr64)
        self.histograms["token"].update(valid_lr.clamp(LOG_RATIO_EDGES[0], LOG_RATIO_EDGES[-1]))
        self.linear["token"].update(valid_lr)
        # sequence / geometric level (rows with ≥ 1 valid token)
        L = lengths[has].to(f64)
        s = lr.sum(dim=1, dtype=f64)[has]
        g = s / L
        c.rows_used += int(has.sum())
        self.levels["sequence"].update(s)
        self.levels["geometric"].update(g)
        self.histograms["sequence"].update(s.clamp(LOG_RATIO_EDGES[0], LOG_RATIO_EDGES[-1]))
        self.histograms["geometric"].update(g.clamp(LOG_RATIO_EDGES[0], LOG_RATIO_EDGES[-1]))
        self.linear["sequence"].update(s)
        self.linear["geometric"].update(g)

        # by token position
        self.position.add_dense(
            mask.sum(dim=0, dtype=f64).numpy(),
            log_ratio=lr.sum(dim=0, dtype=f64).numpy(),
            abs_log_ratio=lr.abs().sum(dim=0, dtype=f64).numpy(),
            k3=k3.sum(dim=0, dtype=f64).numpy(),
        )
        # by response length (one entry per row)
        k3_row = k3.sum(dim=1, dtype=f64)[has]
        lo, hi = math.log(HEALTHY_BAND[0]), math.log(HEALTHY_BAND[1])
        self.length.update(
            L.to(torch.int64).numpy(),
            k3_mean=(k3_row / L).numpy(),
            seq_log_ratio=s.numpy(),
            abs_seq_log_ratio=s.abs().numpy(),
            seq_outside=((s < lo) | (s > hi)).to(f64).numpy(),
        )
        # one-position shift check (the core's detector; four sums)
        self.alignment += alignment_statistics(old32, roll32, mask)

        kept = has.numpy()
        if chunk.policy_version is not None:
            ver = chunk.policy_version[kept]
            for v in np.unique(ver):
                sel = torch.from_numpy(ver == v)
                e = self.version.setdefault(int(v), {"rows": 0.0, "tokens": 0.0, "log_ratio": 0.0, "k3": 0.0})
                e["rows"] += float(sel.sum())
                e["tokens"] += float(L[sel].sum())
                e["log_ratio"] += float(s[sel].sum())
                e["k3"] += float(k3_row[sel].sum())
        if chunk.rewards is not None:
            r = torch.from_numpy(chunk.rewards[kept]).to(f64)
            ok = torch.isfinite(r)
            r, sv = r[ok], s[ok]
            c.reward_rows += int(r.numel())
            c.sum_r += float(r.sum())
            c.sum_r2 += float((r * r).sum())
            c.sum_s += float(sv.sum())
            c.sum_s2 += float((sv * sv).sum())
            c.sum_rs += float((r * sv).sum())
        if self.token is not None and chunk.token_ids is not None:
            ids = torch.from_numpy(chunk.token_ids)[mask]
            if ids.numel() and int(ids.min()) < 0:
                raise ValueError("token ids must be non-negative")
            self.token.update(ids.numpy(), log_ratio=valid_lr64.numpy(), abs_log_ratio=valid_lr64.abs().numpy(),
                              k3=k3[mask].to(f64).numpy())

    # ------------------------------------------------------------------ at the end
    def result(self) -> ProfileResult:
        metrics = metrics_to_floats(self._offpolicy.compute())
        computed = {key: (metrics_to_floats(acc.compute()), final.ess()) for key, (acc, final) in self._what_if.items()}
        what_if, first = [], {}
        for n, key in self._preset_key.items():
            entry = _what_if_entry(n, *computed[key])
            entry["same_as"] = first.get(key)  # an earlier preset with the same weights and masks
            first.setdefault(key, n)
            what_if.append(entry)
        c = self.counters
        extras: dict[str, float] = {}
        if c.reward_rows >= 2:
            n = c.reward_rows
            cov = c.sum_rs / n - (c.sum_r / n) * (c.sum_s / n)
            vr = c.sum_r2 / n - (c.sum_r / n) ** 2
            vs = c.sum_s2 / n - (c.sum_s / n) ** 2
            if vr > 1e-12 and vs > 1e-12:
                extras["reward_seq_log_ratio_corr"] = cov / math.sqrt(vr * vs)
        return ProfileResult(
            metrics=metrics,
            what_if=what_if,
            levels={k: v.as_dict() for k, v in self.levels.items()},
            histograms=self.histograms,
            linear={k: v.finish() for k, v in self.linear.items()},
            alignment=alignment_report(self.alignment),
            position=self.position,
            length=self.length,
            version=self.version,
            token=self.token if (self.token is not None and self.token.count.size) else None,
            counters=c,
            extras=extras,
            sentinels=self.sentinels.as_dict(),
        )
