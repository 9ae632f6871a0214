"""slime adapter: the custom TIS function's contract, on slime-shaped inputs.

slime (THUDM/slime) is not published on PyPI (the PyPI name ``slime`` is an unrelated package)
and needs Megatron-LM and SGLang, so it cannot be installed here. These tests therefore check
the function against slime's documented contract instead of its code: it is loaded by dotted
path the way ``--custom-tis-function-path`` loads it, called with per-sample 1-D tensors and a
flat ``pg_loss``, and its outputs are consumed with slime's reduction rule (per-sample mean over
the original loss mask, summed over samples). The expected values come from a per-sample
reference written here from the semantics of slime's ``mis.py`` (truncate / clip / mask modes at
token / sequence / geometric level, rejection bands, veto, batch normalisation).
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from rollout_correction.integrations.slime import config_from_slime_args, tis_function

torch.set_num_threads(1)


def _load_by_path(path: str):
    """What slime's load_function does with --custom-tis-function-path: module path + attribute."""
    module, attr = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def _args(**kw):
    base = dict(use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None, tis_upper_bound=2.0,
                tis_batch_normalize=False, use_rs=False, rs_level="token", rs_lower_bound=None,
                rs_upper_bound=None, rs_veto_threshold=None)
    base.update(kw)
    return SimpleNamespace(**base)


def _samples(seed=0, lengths=(3, 5, 2, 4), scale=0.6, tool_gap=True):
    g = torch.Generator().manual_seed(seed)
    train, rollout, masks = [], [], []
    for i, n in enumerate(lengths):
        r = -torch.rand(n, generator=g) - 0.1
        train.append(r + scale * torch.randn(n, generator=g))
        rollout.append(r)
        m = torch.ones(n)
        if tool_gap and i == 1:
            m[2] = 0  # a tool-output token inside a multi-turn response
        masks.append(m)
    pg_loss = torch.randn(sum(lengths), generator=g)
    return pg_loss, train, rollout, masks


def _level_ratio(lr, m, level):
    if level == "token":
        x = lr
    elif level == "sequence":
        x = (lr * m).sum().expand_as(lr)
    else:
        x = ((lr * m).sum() / m.sum().clamp(min=1)).expand_as(lr)
    return torch.exp(x.clamp(-20, 20))


def _reference(args, train, rollout, masks):
    """Per-sample weights and masks following slime's mis.py semantics (written from its docs)."""
    lo = args.tis_lower_bound if args.tis_lower_bound is not None else 1 / args.tis_upper_bound
    rs_lo = args.rs_lower_bound if args.rs_lower_bound is not None else lo
    rs_hi = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_upper_bound
    weights, new_masks = [], []
    for t, r, m in zip(train, rollout, masks):
        lr = t - r
        w = _level_ratio(lr, m, args.tis_level)
        keep = m.clone()
        if args.tis_mode == "truncate":
            w = w.clamp(max=args.tis_upper_bound)
        elif args.tis_mode == "clip":
            w = w.clamp(lo, args.tis_upper_bound)
        else:
            keep = keep * ((w >= lo) & (w <= args.tis_upper_bound)).float()
        if args.use_rs:
            rw = _level_ratio(lr, m, args.rs_level)
            keep = keep * ((rw >= rs_lo) & (rw <= rs_hi)).float()
            if args.rs_veto_threshold is not None and ((lr < math.log(args.rs_veto_threshold)) & (m > 0)).any():
                keep = keep * 0
        weights.append(w * m)
        new_masks.append(keep)
    return weights, new_masks


def _sum_of_sample_mean(flat, lengths, masks):
    """slime's default reducer: Σ_samples (Σ_t x·mask / max(Σ mask, 1))."""
    return sum((x * m).sum() / m.sum().clamp(min=1) for x, m in zip(flat.split(lengths), masks))


CASES = [
    dict(tis_mode="truncate", tis_level="token", tis_upper_bound=1.5),
    dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=2.0),
    dict(tis_mode="clip", tis_level="token", tis_lower_bound=0.8, tis_upper_bound=1.3),
    dict(tis_mode="clip", tis_level="geometric", tis_lower_bound=0.9, tis_upper_bound=1.1),
    dict(tis_mode="mask", tis_level="token", tis_lower_bound=0.5, tis_upper_bound=2.0),
    dict(tis_mode="mask", tis_level="geometric", tis_lower_bound=0.8, tis_upper_bound=1.25),
    dict(tis_mode="truncate", tis_level="token", use_rs=True, rs_level="geometric", rs_lower_bound=0.7,
         rs_upper_bound=1.4),
    dict(tis_mode="truncate", tis_level="sequence", use_rs=True, rs_level="sequence", rs_veto_threshold=0.3),
    dict(tis_mode="mask", tis_level="token", tis_upper_bound=3.0, use_rs=True, rs_level="token",
         rs_lower_bound=0.6, rs_upper_bound=1.8),
]


@pytest.mark.parametrize("opts", CASES)
def test_tis_function_matches_slime_semantics(opts):
    fn = _load_by_path("rollout_correction.integrations.slime.tis_function")
    args = _args(**opts)
    pg_loss, train, rollout, masks = _samples()
    lengths = [len(t) for t in train]
    out_loss, out_masks, metrics = fn(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                                      loss_masks=masks, total_lengths=[n + 7 for n in lengths],
                                      response_lengths=lengths)
    ref_w, ref_m = _reference(args, train, rollout, masks)
    valid = torch.cat(masks).bool()
    torch.testing.assert_close(out_loss[valid], (pg_loss * torch.cat(ref_w))[valid], rtol=1e-5, atol=1e-6)
    assert len(out_masks) == len(masks)
    for got, want, m in zip(out_masks, ref_m, masks):
        assert got.dtype == m.dtype and torch.equal(got, want)
    # Every metric is a flat per-token tensor slime's reducer can consume.
    for name, value in metrics.items():
        assert value.shape == pg_loss.shape, name
        assert torch.isfinite(_sum_of_sample_mean(value, lengths, masks)), name
    assert {"mismatch_kl", "mismatch_k3_kl", "mismatch_training_ppl", "mis_mean_is_weight_before_clip",
            "mis_ratio_mean_after_mis", "rollout_corr/rollout_is_mean"} <= set(metrics)
    mode_metric = {"truncate": "mis_truncate_fraction", "clip": "mis_clip_fraction_low",
                   "mask": "mis_mask_fraction_low"}[args.tis_mode]
    assert mode_metric in metrics


def test_the_bands_really_act_in_the_cases():
    """Guard for the parametrised test: each case truncates, clips or rejects something."""
    pg_loss, train, rollout, masks = _samples()
    for opts in CASES:
        args = _args(**opts)
        ref_w, ref_m = _reference(args, train, rollout, masks)
        raw = [_level_ratio(t - r, m, args.tis_level) * m for t, r, m in zip(train, rollout, masks)]
        changed = any(not torch.allclose(a, b) for a, b in zip(ref_w, raw))
        rejected = any(not torch.equal(a, m) for a, m in zip(ref_m, masks))
        assert changed or rejected, opts


def test_mismatch_metrics_only_without_use_tis():
    pg_loss, train, rollout, masks = _samples()
    lengths = [len(t) for t in train]
    out_loss, out_masks, metrics = tis_function(_args(use_tis=False, use_rs=True), pg_loss=pg_loss,
                                                train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks)
    assert torch.equal(out_loss, pg_loss) and all(torch.equal(a, b) for a, b in zip(out_masks, masks))
    assert set(metrics) == {"mismatch_training_log_ppl", "mismatch_training_ppl", "mismatch_rollout_log_ppl",
                            "mismatch_rollout_ppl", "mismatch_kl", "mismatch_k3_kl", "mismatch_log_ppl_diff",
                            "mismatch_log_ppl_abs_diff", "mismatch_ppl_ratio"}
    valid = torch.cat(masks).bool()
    torch.testing.assert_close(metrics["mismatch_kl"][valid], (torch.cat(rollout) - torch.cat(train))[valid])
    # Sequence-level metric: the sample's value on each of its tokens, so slime's reducer gives
    # the sum of per-sample values.
    per_sample = [-(t * m).sum() / m.sum() for t, m in zip(train, masks)]
    torch.testing.assert_close(_sum_of_sample_mean(metrics["mismatch_training_log_ppl"], lengths, masks),
                               sum(per_sample))


def test_veto_metrics_and_batch_normalisation():
    pg_loss, train, rollout, masks = _samples(scale=0.3)
    train[2] = train[2].clone()
    train[2][0] = rollout[2][0] + math.log(1e-3)  # one catastrophic token
    args = _args(use_rs=True, rs_level="token", rs_lower_bound=1e-6, rs_upper_bound=1e6, rs_veto_threshold=1e-2,
                 tis_batch_normalize=True, tis_upper_bound=5.0)
    out_loss, out_masks, metrics = tis_function(args, pg_loss=torch.ones_like(pg_loss), train_log_probs=train,
                                                rollout_log_probs=rollout, loss_masks=masks)
    assert out_masks[2].sum() == 0 and all(out_masks[i].sum() > 0 for i in (0, 1, 3))
    lengths = [len(t) for t in train]
    seq_frac = metrics["mis_catastrophic_seq_fraction"].split(lengths)
    assert [float(s[0]) for s in seq_frac] == [0.0, 0.0, 1.0, 0.0]
    # Token-level batch normalisation, as slime: the weights' mean over the valid tokens of the
    # original loss masks (rejection not applied) is 1 (pg_loss was ones, so out_loss = weights).
    valid = torch.cat(masks).bool()
    assert out_loss[valid].mean().item() == pytest.approx(1.0, abs=1e-5)
    factor = metrics["mis_batch_norm_factor"]
    assert torch.all(factor == factor[0]) and factor[0].item() > 0


def test_legacy_mis_names_and_errors():
    legacy = SimpleNamespace(use_tis=True, mis_mode="clip", mis_level="geometric", mis_lower_bound=0.5,
                             mis_upper_bound=2.0, mis_veto_threshold=None)
    new = _args(tis_mode="clip", tis_level="geometric", tis_lower_bound=0.5, tis_upper_bound=2.0)
    assert config_from_slime_args(legacy) == config_from_slime_args(new)
    pg_loss, train, rollout, masks = _samples()
    with pytest.raises(ValueError, match="tis_mode"):
        tis_function(_args(tis_mode="trunc"), pg_loss=pg_loss, train_log_probs=train,
                     rollout_log_probs=rollout, loss_masks=masks)
    with pytest.raises(ValueError, match="context-parallel"):
        tis_function(_args(), pg_loss=pg_loss[:-1], train_log_probs=train, rollout_log_probs=rollout,
                     loss_masks=masks)
    with pytest.raises(ValueError, match="sample 1"):
        tis_function(_args(), pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                     loss_masks=[masks[0], masks[1][:-1], masks[2], masks[3]])


def test_nonfinite_rollout_log_prob_rejects_the_sample_without_nan():
    pg_loss, train, rollout, masks = _samples()
    rollout[3] = rollout[3].clone()
    rollout[3][1] = float("nan")
    out_loss, out_masks, metrics = tis_function(_args(), pg_loss=pg_loss, train_log_probs=train,
                                                rollout_log_probs=rollout, loss_masks=masks)
    assert out_masks[3].sum() == 0
    assert torch.isfinite(out_loss).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())
