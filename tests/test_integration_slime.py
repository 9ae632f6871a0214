"""slime adapter: the custom TIS function under slime's call contract, with and without context parallelism.

slime (THUDM/slime) is not published on PyPI (the PyPI name ``slime`` is an unrelated package)
and needs Megatron-LM and SGLang, so it cannot be installed here. These tests follow slime's call
contract as read from its code (main branch, commit 624b824a, 2026-08-21):

* ``slime/utils/arguments.py``: ``--custom-config-path`` YAML keys are set on ``args`` with
  ``setattr``; ``slime/utils/misc.py`` ``load_function`` imports ``module.attr`` of the dotted
  ``--custom-tis-function-path``.
* ``slime/backends/megatron_utils/loss.py`` ``policy_loss_function``: the function is called with
  the keyword arguments ``args, pg_loss, train_log_probs, rollout_log_probs, loss_masks,
  total_lengths, response_lengths``; log-probs are per-sample 1-D tensors of this rank's tokens,
  ``loss_masks`` full length; it must return ``(pg_loss, modified_response_masks, metrics)``;
  metrics are reduced with ``sum_of_sample_mean`` over the original masks.
* ``slime/backends/megatron_utils/cp_utils.py``: with context parallelism each rank holds, per
  sample, the response positions whose logit position (prompt_length − 1 + j) falls in its chunks
  r and 2·CP−1−r of ⌈total_length / (2·CP)⌉ tokens (``slice_log_prob_with_cp``), and
  ``get_sum_of_sample_mean`` reads the returned full-length masks at those positions only.

The CP layout is re-implemented here independently (by chunk membership of each position rather
than slime's interval arithmetic) and checked against offsets worked out by hand from
``get_logits_and_tokens_offset_with_cp``. The expected values come from a per-sample
re-implementation of slime's ``examples/train_infer_mismatch_helper/mis.py``
(``compute_mis_weights`` and ``add_ppl_metrics``). Stand-in: Megatron's ``megatron.core.mpu``
(not installable here) is replaced, in the spawned ranks only, by a module exposing the three
functions the adapter calls, backed by real gloo groups; it touches no numbers.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import sys
import types
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from rollout_correction.integrations.slime import config_from_slime_args, cp_response_ranges, tis_function
from test_distributed import _free_port

torch.set_num_threads(1)

FUNCTION_PATH = "rollout_correction.integrations.slime.tis_function"


def load_function(path: str):
    """slime.utils.misc.load_function: ``module.attr`` via rpartition and importlib."""
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def slime_args(yaml_text: str, *cli: str) -> argparse.Namespace:
    """slime's args for the flags involved: its parser's definitions of these flags (names,
    defaults), then the ``--custom-config-path`` YAML merged with setattr, as slime does."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-tis", action="store_true", default=False)
    parser.add_argument("--get-mismatch-metrics", action="store_true", default=False)
    parser.add_argument("--tis-clip", type=float, default=2.0)
    parser.add_argument("--tis-clip-low", type=float, default=0)
    parser.add_argument("--custom-tis-function-path", type=str, default=None)
    parser.add_argument("--custom-config-path", type=str, default=None)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=None)
    args = parser.parse_args(list(cli))
    for k, v in (yaml.safe_load(yaml_text) or {}).items():
        setattr(args, k, v)
    return args


def call_like_slime(args, pg_loss, train, rollout, masks, total_lengths, response_lengths):
    """loss.py: build tis_kwargs and call the function loaded from --custom-tis-function-path."""
    tis_func = load_function(args.custom_tis_function_path)
    tis_kwargs = {
        "args": args,
        "pg_loss": pg_loss,
        "train_log_probs": train,
        "rollout_log_probs": rollout,
        "loss_masks": masks,
        "total_lengths": total_lengths,
        "response_lengths": response_lengths,
    }
    return tis_func(**tis_kwargs)


# ------------------------------------------------------------------------------ slime's rules
def sum_of_sample_mean(flat, lengths, masks, denoms=None):
    """get_sum_of_sample_mean (CP = 1): Σ_i Σ_t x·mask / max(denom_i, 1), denom_i = Σ mask_i."""
    denoms = denoms if denoms is not None else [m.sum() for m in masks]
    return sum((x * m).sum() / torch.clamp_min(d, 1) for x, m, d in zip(flat.split(lengths), masks, denoms))


def cp_positions(total_length: int, response_length: int, cp: int, rank: int) -> torch.Tensor:
    """Response positions held by ``rank``: logit position p = prompt − 1 + j lies in chunk
    r or 2·CP−1−r of ⌈total / (2·CP)⌉ positions (the last logit, total − 1, is never used)."""
    prompt = total_length - response_length
    chunk = math.ceil(total_length / (2 * cp))
    j = torch.arange(response_length)
    owner = (prompt - 1 + j) // chunk
    return j[(owner == rank) | (owner == 2 * cp - 1 - rank)]


# (total_length, response_length, CP) → per-rank ((a, b), (c, d)), worked out by hand from
# get_logits_and_tokens_offset_with_cp (chunk = ⌈total / 2CP⌉, logits ranges clipped to
# [prompt − 1, total − 1), shifted by prompt − 1; an empty range is (0, 0)).
HAND_OFFSETS = {
    (10, 6, 2): [((0, 0), (0, 0)), ((0, 3), (3, 6))],
    (13, 9, 2): [((0, 1), (0, 0)), ((1, 5), (5, 9))],
    (20, 15, 3): [((0, 0), (0, 0)), ((0, 4), (12, 15)), ((4, 8), (8, 12))],
}


def test_cp_layout_matches_slimes_offsets():
    for (total, resp, cp), per_rank in HAND_OFFSETS.items():
        for rank, ((a, b), (c, d)) in enumerate(per_rank):
            assert cp_response_ranges(total, resp, cp, rank) == ((a, b), (c, d))
            assert cp_positions(total, resp, cp, rank).tolist() == list(range(a, b)) + list(range(c, d))
    for total in range(2, 40):
        for resp in range(1, total):
            for cp in (2, 3, 4):
                held = torch.cat([cp_positions(total, resp, cp, r) for r in range(cp)])
                assert sorted(held.tolist()) == list(range(resp))  # every token on exactly one rank
                for r in range(cp):
                    (a, b), (c, d) = cp_response_ranges(total, resp, cp, r)
                    assert cp_positions(total, resp, cp, r).tolist() == list(range(a, b)) + list(range(c, d))


# ---------------------------------------------------------- slime's mis.py, re-implemented
def slime_mis(args, train, rollout, masks):
    """Per-sample (weights, modified masks, metrics) as examples/train_infer_mismatch_helper/mis.py
    computes them: metrics are per-token tensors under the names it records, prefixed ``mis_``."""
    metrics = defaultdict(list)
    for t, r, m in zip(train, rollout, masks):
        m = m.float()
        n = m.sum().clamp(min=1)
        mt, mr = (t * m).sum() / n, (r * m).sum() / n
        full = lambda v: v.expand_as(t)  # noqa: E731
        metrics["training_log_ppl"].append(full(-mt))
        metrics["training_ppl"].append(full(torch.exp(-mt)))
        metrics["rollout_log_ppl"].append(full(-mr))
        metrics["rollout_ppl"].append(full(torch.exp(-mr)))
        metrics["kl"].append(r - t)
        lr = t - r
        metrics["k3_kl"].append(torch.exp(lr) - lr - 1)
        metrics["log_ppl_diff"].append(full(mr - mt))
        metrics["log_ppl_abs_diff"].append(full((mr - mt).abs()))
        metrics["ppl_ratio"].append(full(torch.exp(mr - mt)))
        rho = torch.exp(lr.clamp(-20, 20))
        metrics["chi2_token"].append(full((rho ** 2 * m).sum() / n - 1))
        metrics["chi2_seq"].append(full(torch.exp(2 * ((lr * m).sum()).clamp(-20, 20)) - 1))
    if not args.use_tis:
        return None, masks, {f"mis_{k}": v for k, v in metrics.items()}

    lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1 / args.tis_upper_bound
    rs_lower = args.rs_lower_bound if args.rs_lower_bound is not None else lower
    rs_upper = args.rs_upper_bound if args.rs_upper_bound is not None else args.tis_upper_bound

    def level(lr, m, lvl):
        x = lr if lvl == "token" else ((lr * m).sum() if lvl == "sequence" else (lr * m).sum() / m.sum().clamp(min=1))
        return torch.exp(x.expand_as(lr).clamp(-20, 20))

    weights, new_masks = [], []
    for t, r, m in zip(train, rollout, masks):
        m = m.float()
        lr = t - r
        keep = m.clone()
        w = level(lr, m, args.tis_level)
        metrics["tis_weight_before_bound"].append(w)
        if args.tis_mode == "truncate":
            metrics["tis_truncate_fraction"].append((w > args.tis_upper_bound).int())
            w = w.clamp(0, args.tis_upper_bound) * m
        elif args.tis_mode == "clip":
            metrics["tis_clip_fraction_low"].append((w < lower).int())
            metrics["tis_clip_fraction_high"].append((w > args.tis_upper_bound).int())
            w = w.clamp(lower, args.tis_upper_bound) * m
        else:
            metrics["tis_mask_fraction_low"].append((w < lower).int())
            metrics["tis_mask_fraction_high"].append((w > args.tis_upper_bound).int())
            keep = keep * ((w >= lower) & (w <= args.tis_upper_bound)).float()
            w = w * m
        metrics["tis_weight_after_bound"].append(w)
        if args.use_rs:
            rw = level(lr, m, args.rs_level)
            metrics["rs_mask_fraction_low"].append((rw < rs_lower).int())
            metrics["rs_mask_fraction_high"].append((rw > rs_upper).int())
            keep = keep * ((rw >= rs_lower) & (rw <= rs_upper)).float()
            if args.rs_veto_threshold is not None:
                cat = (lr < math.log(args.rs_veto_threshold)) & m.bool()
                metrics["rs_catastrophic_token_fraction"].append(cat.int())
                metrics["rs_catastrophic_seq_fraction"].append(cat.any().int().expand_as(m))
                keep = keep * (~cat.any()).float()
        metrics["is_ratio_mean_after_tis_rs"].append(w)
        weights.append(w)
        new_masks.append(keep)
    if args.tis_batch_normalize:
        if args.tis_level == "token":
            mean = sum((w * m).sum() for w, m in zip(weights, masks)) / sum(m.sum() for m in masks).clamp(min=1)
        else:  # sequence: the mean over samples of each sample's mean weight
            mean = sum((w * m).sum() / m.sum().clamp(min=1) for w, m in zip(weights, masks)) / len(weights)
        factor = mean if mean > 1e-8 else torch.tensor(1.0)
        weights = [w / factor for w in weights]
        metrics["batch_norm_factor"] = [factor.expand_as(w) for w in weights]
    for w, m in zip(weights, masks):
        m = m.float()
        metrics["is_ratio_mean_final"].append(((w * m).sum() / m.sum().clamp(min=1)).expand_as(w))
        metrics["is_ratio_min_final"].append(w[m.bool()].min().expand_as(w))
        metrics["is_ratio_max_final"].append(w[m.bool()].max().expand_as(w))
    return weights, new_masks, {f"mis_{k}": v for k, v in metrics.items()}


def _args(**kw):
    base = dict(use_tis=True, tis_mode="truncate", tis_level="token", tis_lower_bound=None, tis_upper_bound=2.0,
                tis_batch_normalize=False, use_rs=False, rs_level="token", rs_lower_bound=None,
                rs_upper_bound=None, rs_veto_threshold=None)
    base.update(kw)
    return argparse.Namespace(custom_tis_function_path=FUNCTION_PATH, **base)


def _samples(seed=0, lengths=(3, 5, 2, 4, 9), scale=0.6, tool_gap=True):
    g = torch.Generator().manual_seed(seed)
    train, rollout, masks = [], [], []
    for i, n in enumerate(lengths):
        r = -torch.rand(n, generator=g) - 0.1
        train.append((r + scale * torch.randn(n, generator=g)).clamp(max=0.0))  # log-probs are ≤ 0
        rollout.append(r)
        m = torch.ones(n)
        if tool_gap and i == 1:
            m[2] = 0  # a tool-output token inside a multi-turn response
        masks.append(m)
    pg_loss = torch.randn(sum(lengths), generator=g)
    return pg_loss, train, rollout, masks


CASES = [
    dict(tis_mode="truncate", tis_level="token", tis_upper_bound=1.5),
    dict(tis_mode="truncate", tis_level="sequence", tis_upper_bound=2.0, tis_batch_normalize=True),
    dict(tis_mode="clip", tis_level="token", tis_lower_bound=0.8, tis_upper_bound=1.3, tis_batch_normalize=True),
    dict(tis_mode="clip", tis_level="geometric", tis_lower_bound=0.9, tis_upper_bound=1.1),
    dict(tis_mode="mask", tis_level="token", tis_lower_bound=0.5, tis_upper_bound=2.0),
    dict(tis_mode="mask", tis_level="geometric", tis_lower_bound=0.8, tis_upper_bound=1.25),
    dict(tis_mode="truncate", tis_level="token", use_rs=True, rs_level="geometric", rs_lower_bound=0.7,
         rs_upper_bound=1.4),
    dict(tis_mode="truncate", tis_level="sequence", use_rs=True, rs_level="sequence", rs_veto_threshold=0.3),
    dict(tis_mode="mask", tis_level="token", tis_upper_bound=3.0, use_rs=True, rs_level="token",
         rs_lower_bound=0.6, rs_upper_bound=1.8, rs_veto_threshold=0.5, tis_batch_normalize=True),
    dict(use_tis=False),
]


def _check_against_slime(args, pg_loss, train, rollout, masks, out_loss, out_masks, metrics):
    lengths = [len(t) for t in train]
    ref_w, ref_m, ref_metrics = slime_mis(args, train, rollout, masks)
    valid = torch.cat(masks).bool()
    if ref_w is None:
        assert torch.equal(out_loss, pg_loss) and all(torch.equal(a, b) for a, b in zip(out_masks, masks))
    else:
        torch.testing.assert_close(out_loss[valid], (pg_loss * torch.cat(ref_w))[valid], rtol=1e-5, atol=1e-6)
        for got, want, m in zip(out_masks, ref_m, masks):
            assert got.dtype == m.dtype and torch.equal(got, want)
    # Every name slime's mis.py records, with the value slime's reducer gives; and ours beside them.
    assert set(ref_metrics) == {k for k in metrics if k.startswith("mis_")}
    assert any(k.startswith("rollout_corr/") for k in metrics)
    for name, value in metrics.items():
        assert value.shape == pg_loss.shape, name
    for name, per_sample in ref_metrics.items():
        want = sum_of_sample_mean(torch.cat([v.float() for v in per_sample]), lengths, masks)
        got = sum_of_sample_mean(metrics[name], lengths, masks)
        assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6), name
    # slime's policy loss logs sum_of_sample_mean(|old − rollout|) under this name; ours is the same.
    want = sum_of_sample_mean(torch.cat([(t - r).abs() for t, r in zip(train, rollout)]), lengths, masks)
    got = sum_of_sample_mean(metrics["train_rollout_logprob_abs_diff"], lengths, masks)
    assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("opts", CASES)
def test_tis_function_matches_slime_mis(opts):
    args = _args(**opts)
    pg_loss, train, rollout, masks = _samples()
    lengths = [len(t) for t in train]
    out = call_like_slime(args, pg_loss, train, rollout, masks, [n + 7 for n in lengths], lengths)
    _check_against_slime(args, pg_loss, train, rollout, masks, *out)


def test_the_bands_really_act_in_the_cases():
    """Guard for the parametrised test: each case truncates, clips or rejects something."""
    pg_loss, train, rollout, masks = _samples()
    for opts in CASES[:-1]:
        args = _args(**opts)
        ref_w, ref_m, _ = slime_mis(args, train, rollout, masks)
        raw = [torch.exp((t - r).clamp(-20, 20)) * m for t, r, m in zip(train, rollout, masks)]
        changed = any(not torch.allclose(a, b) for a, b in zip(ref_w, raw))
        rejected = any(not torch.equal(a, m) for a, m in zip(ref_m, masks))
        assert changed or rejected, opts


def _docs_section() -> str:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    start = text.index("\n## slime")
    return text[start:text.index("\n## ", start + 1)]


def _recipe():
    """The flags (step 2) and the YAML (step 3) of docs/integrations.md's slime section, as written."""
    import re
    import shlex

    section = _docs_section()
    install, flags = re.findall(r"```bash\n(.*?)```", section, re.S)
    (yaml_text,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert install.strip() == "pip install rollout-correction"
    return shlex.split(flags.replace("\\\n", " ")), yaml_text


def test_recipe_flags_and_yaml_reach_the_function():
    """The documented lines, read from docs/integrations.md: slime's flags, the YAML merged into
    args, the dotted path loaded by slime's rule, the call loss.py makes; the config is ours and
    the rollout_corr/ keys show it is active."""
    flags, yaml_text = _recipe()
    assert flags == ["--use-tis", "--custom-config-path", "mis.yaml", "--custom-tis-function-path", FUNCTION_PATH]
    args = slime_args(yaml_text, *flags)
    cfg = config_from_slime_args(args)
    assert cfg.rollout_is == "token" and cfg.rollout_is_threshold == 2.0 and cfg.rollout_is_batch_normalize
    assert cfg.rollout_rs == "seq_mean_k1" and cfg.rollout_token_veto_threshold == 1e-4
    pg_loss, train, rollout, masks = _samples(scale=0.05)
    lengths = [len(t) for t in train]
    out = call_like_slime(args, pg_loss, train, rollout, masks, [n + 7 for n in lengths], lengths)
    _check_against_slime(args, pg_loss, train, rollout, masks, *out)
    # What slime logs: reported_loss[key] = sum_of_sample_mean(value) for every returned key.
    logged = {k: float(sum_of_sample_mean(v, lengths, masks)) / len(lengths) for k, v in out[2].items()}
    assert logged["rollout_corr/rollout_is_mean"] > 0 and "rollout_corr/rollout_rs_masked_fraction" in logged
    # slime's --tis-clip / --tis-clip-low belong to its vanilla function: not read.
    other = slime_args(yaml_text, *flags, "--tis-clip", "7.0", "--tis-clip-low", "0.3")
    assert config_from_slime_args(other) == cfg


def test_the_dump_option_writes_one_file_per_step_that_diagnose_reads(tmp_path):
    """``rollout_correction_dump_dir`` in the YAML: micro-batches are kept and written once per optimizer
    step (global_batch_size samples, one data-parallel rank); diagnose reads the files."""
    from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
    from rollout_correction.diagnose import diagnose_file

    flags, yaml_text = _recipe()
    dump = tmp_path / "dump"
    args = slime_args(yaml_text + f"\nrollout_correction_dump_dir: {dump}\n", *flags, "--global-batch-size", "5")
    pg_loss, train, rollout, masks = _samples(scale=0.05)
    for part in (slice(0, 2), slice(2, 5)):  # two micro-batches of one step
        assert not dump.exists()
        lengths = [len(t) for t in train[part]]
        call_like_slime(args, pg_loss[sum(len(t) for t in train[:part.start]):][:sum(lengths)], train[part],
                        rollout[part], masks[part], [n + 7 for n in lengths], lengths)
    assert os.listdir(dump) == ["step_000000.pt"]
    diag = diagnose_file(str(dump), presets=[])
    padded = [torch.nn.utils.rnn.pad_sequence(x, batch_first=True) for x in (train, rollout, masks)]
    assert diag.profile.counters.tokens == int(sum(m.sum() for m in masks)) and list(diag.profile.version) == [0]
    for name, value in metrics_to_floats(compute_offpolicy_metrics(*padded)).items():
        assert diag.profile.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    with pytest.raises(ValueError, match="context-parallel-size 2"):
        tis_function(slime_args(yaml_text + f"\nrollout_correction_dump_dir: {dump}\n", *flags,
                                "--global-batch-size", "5", "--context-parallel-size", "2"),
                     pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks,
                     total_lengths=[len(t) + 7 for t in train], response_lengths=[len(t) for t in train])


def test_geometric_batch_normalisation_skips_empty_samples():
    """Documented limit: at sequence/geometric level the batch-normalisation mean runs over the
    samples with a valid token (slime's mis.py counts empty samples, and raises for geometric)."""
    pg_loss, train, rollout, masks = _samples(scale=0.3)
    masks[2] = torch.zeros_like(masks[2])  # a sample with no valid token (e.g. all tool output)
    args = _args(tis_mode="truncate", tis_level="geometric", tis_upper_bound=1.2, tis_batch_normalize=True)
    out_loss, out_masks, metrics = tis_function(args, pg_loss=pg_loss, train_log_probs=train,
                                                rollout_log_probs=rollout, loss_masks=masks)
    # Independently: w_i = min(exp(mean of log ρ over the sample's valid tokens), 1.2); the
    # factor is the mean of w_i over the four non-empty samples.
    w = [torch.exp(((t - r) * m).sum() / m.sum()).clamp(max=1.2) if m.sum() else None
         for t, r, m in zip(train, rollout, masks)]
    factor = sum(x for x in w if x is not None) / 4
    for p, got, x, m in zip(pg_loss.split([len(t) for t in train]), out_loss.split([len(t) for t in train]), w, masks):
        if x is not None:
            torch.testing.assert_close(got[m.bool()], (p * x / factor)[m.bool()], rtol=1e-5, atol=1e-6)
    assert float(metrics["mis_batch_norm_factor"][0]) == pytest.approx(float(factor), rel=1e-5)
    assert float(out_masks[2].sum()) == 0 and torch.isfinite(out_loss).all()


def test_veto_and_nonfinite():
    pg_loss, train, rollout, masks = _samples(scale=0.3)
    train[2] = train[2].clone()
    train[2][0] = rollout[2][0] + math.log(1e-3)  # one catastrophic token
    rollout[3] = rollout[3].clone()
    rollout[3][1] = float("nan")  # a non-finite log-prob: the sample is dropped, nothing becomes NaN
    args = _args(use_rs=True, rs_level="token", rs_lower_bound=1e-6, rs_upper_bound=1e6, rs_veto_threshold=1e-2,
                 tis_upper_bound=5.0)
    out_loss, out_masks, metrics = tis_function(args, pg_loss=pg_loss, train_log_probs=train,
                                                rollout_log_probs=rollout, loss_masks=masks)
    assert [float(m.sum()) for m in out_masks] == [3.0, 4.0, 0.0, 0.0, 9.0]
    lengths = [len(t) for t in train]
    assert [float(s[0]) for s in metrics["mis_rs_catastrophic_seq_fraction"].split(lengths)] == [0, 0, 1, 0, 0]
    assert torch.isfinite(out_loss).all() and all(torch.isfinite(v).all() for v in metrics.values())


def test_legacy_names_and_errors():
    legacy = argparse.Namespace(use_tis=True, mis_mode="clip", mis_level="geometric", mis_lower_bound=0.5,
                                mis_upper_bound=2.0, mis_veto_threshold=None)
    new = _args(tis_mode="clip", tis_level="geometric", tis_lower_bound=0.5, tis_upper_bound=2.0)
    assert config_from_slime_args(legacy) == config_from_slime_args(new)
    pg_loss, train, rollout, masks = _samples()
    with pytest.raises(ValueError, match="tis_mode"):
        tis_function(_args(tis_mode="trunc"), pg_loss=pg_loss, train_log_probs=train,
                     rollout_log_probs=rollout, loss_masks=masks)
    with pytest.raises(ValueError, match="flat concatenation"):
        tis_function(_args(), pg_loss=pg_loss[:-1], train_log_probs=train, rollout_log_probs=rollout,
                     loss_masks=masks)
    with pytest.raises(ValueError, match="sample 1"):
        tis_function(_args(), pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=rollout,
                     loss_masks=[masks[0], masks[1][:-1], *masks[2:]])
    with pytest.raises(RuntimeError, match="megatron.core.mpu"):  # CP > 1 outside a Megatron process
        tis_function(_args(context_parallel_size=2), pg_loss=pg_loss, train_log_probs=train,
                     rollout_log_probs=rollout, loss_masks=masks)


# ------------------------------------------------------------------- context parallelism
def _install_mpu_stand_in(cp_group, cp_rank, cp_size):
    """megatron.core.mpu with the three functions the adapter calls (see the module docstring)."""
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_group = lambda: cp_group
    mpu.get_context_parallel_rank = lambda: cp_rank
    mpu.get_context_parallel_world_size = lambda: cp_size
    core = types.ModuleType("megatron.core")
    core.mpu = mpu
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.core": core, "megatron.core.mpu": mpu})


def _cp_batch():
    """Samples of varied prompt and response lengths (one has no token on some ranks)."""
    g = torch.Generator().manual_seed(7)
    total_lengths = [10, 13, 20, 31, 8, 44]
    response_lengths = [6, 9, 15, 12, 1, 30]
    train, rollout, masks = [], [], []
    for i, n in enumerate(response_lengths):
        r = -torch.rand(n, generator=g) - 0.1
        train.append((r + 0.5 * torch.randn(n, generator=g)).clamp(max=0.0))  # log-probs are ≤ 0
        rollout.append(r)
        m = torch.ones(n)
        if n > 8:
            m[3:5] = 0  # tool output
        masks.append(m)
    pg_loss = [torch.randn(n, generator=g) for n in response_lengths]
    return pg_loss, train, rollout, masks, total_lengths, response_lengths


def _cp_worker(rank, cp, port, result_dir, cases):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp,
                            timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.new_group(list(range(cp)))
        _install_mpu_stand_in(group, rank, cp)
        calls = []
        for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast"):
            fn = getattr(dist, name)
            setattr(dist, name, lambda *a, _fn=fn, _n=name, **k: (calls.append((_n, k.get("group"), a[1].numel()
                                                                                 if len(a) > 1 else None)), _fn(*a, **k))[1])
        pg_loss, train, rollout, masks, totals, resps = _cp_batch()
        idx = [cp_positions(t, n, cp, rank) for t, n in zip(totals, resps)]
        results = []
        for opts in cases:
            args = _args(context_parallel_size=cp, **opts)
            seen = []  # the first call (the ranks agree once on a new exchange), then the same call again
            for _ in range(2):
                del calls[:]
                out = call_like_slime(args, torch.cat([p[i] for p, i in zip(pg_loss, idx)]),
                                      [t[i] for t, i in zip(train, idx)], [r[i] for r, i in zip(rollout, idx)],
                                      masks, totals, resps)
                seen.append([(n, g is group, numel) for n, g, numel in calls])
            results.append((out, seen))
        torch.save(results, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_equals_whole_responses(cp, tmp_path):
    """Each CP rank gets its slices (slime's layout); results on its tokens equal the unsplit
    call's, slime's CP reduction of the metrics equals the unsplit one, one all-gather per call (and, at
    the first call of a new exchange, the all-reduce by which the ranks agree on it)."""
    cases = CASES if cp == 2 else CASES[1::3]
    mp.start_processes(_cp_worker, args=(cp, _free_port(), str(tmp_path), cases), nprocs=cp, join=True,
                       start_method="fork")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(cp)]
    pg_loss, train, rollout, masks, totals, resps = _cp_batch()
    # slime's per-sample denominators, batch["rollout_mask_sums"]: the original mask total of the
    # rollout each sample belongs to (samples 0-2 and 3-5 here), whatever the function rejects.
    rollout_ids = [0, 0, 0, 1, 1, 1]
    totals_by_rollout = defaultdict(float)
    for rid, m in zip(rollout_ids, masks):
        totals_by_rollout[rid] += float(m.sum())
    denoms = [torch.tensor(totals_by_rollout[rid]) for rid in rollout_ids]
    rejecting = 0
    for c, opts in enumerate(cases):
        args = _args(**opts)
        whole_loss, whole_masks, whole_metrics = call_like_slime(args, torch.cat(pg_loss), train, rollout, masks,
                                                                 totals, resps)
        # The policy loss slime trains on, written independently: Σ over accepted tokens of w·pg
        # divided by the sample's rollout_mask_sums (weights and acceptance from slime's mis.py rules).
        ref_w, ref_m, _ = slime_mis(args, train, rollout, masks)
        ref_w = ref_w if ref_w is not None else [torch.ones_like(m) for m in masks]
        independent = sum(float((p * w * a).sum()) / max(float(d), 1.0)
                          for p, w, a, d in zip(pg_loss, ref_w, ref_m, denoms))
        reduced_pg = 0.0
        _check_against_slime(args, torch.cat(pg_loss), train, rollout, masks, whole_loss, whole_masks, whole_metrics)
        whole_loss = whole_loss.split(resps)
        whole_metrics = {k: v.split(resps) for k, v in whole_metrics.items()}
        reduced = defaultdict(float)
        for rank in range(cp):
            (loss, new_masks, metrics), (first_calls, calls) = per_rank[rank][c]
            idx = [cp_positions(t, n, cp, rank) for t, n in zip(totals, resps)]
            local_n = [len(i) for i in idx]
            torch.testing.assert_close(loss, torch.cat([w[i] for w, i in zip(whole_loss, idx)]), rtol=1e-5, atol=1e-6)
            for got, want, i, m in zip(new_masks, whole_masks, idx, masks):
                assert got.shape == m.shape and got.dtype == m.dtype
                assert torch.equal(got[i], want[i]), (opts, rank)  # the positions slime reads on this rank
            # loss.py rebuilds its reducer from the returned masks (this rank's positions) and
            # rollout_mask_sums; the CP ranks' shares add up (Megatron sums the CP gradients).
            reduced_pg += float(sum_of_sample_mean(loss, local_n, [nm[i] for nm, i in zip(new_masks, idx)], denoms))
            assert set(metrics) == set(whole_metrics), opts
            for k, v in metrics.items():
                torch.testing.assert_close(v, torch.cat([w[i] for w, i in zip(whole_metrics[k], idx)]),
                                           rtol=1e-5, atol=1e-6, msg=lambda s: f"{opts} rank {rank} {k}: {s}")
                # slime's CP reducer: Σ_i Σ_{local t} x·mask / (full mask total of sample i)
                local_masks = [m[i] for m, i in zip(masks, idx)]
                reduced[k] += float(sum_of_sample_mean(v, local_n, local_masks, [m.sum() for m in masks]))
            # two collectives: the all-reduce by which the CP ranks agree on the exchange (at every call:
            # the row count is data), and an all-gather over the CP group of (B, k) per-sample scalars
            assert [c[0] for c in calls][:1] == ["all_reduce"] and len(calls) == 2, calls
            assert calls[1][0] in ("all_gather_single", "all_gather_into_tensor"), calls
            assert first_calls == calls, first_calls
            assert calls[1][1] and calls[1][2] % len(resps) == 0 and calls[1][2] // len(resps) <= 64, calls
        for k, v in whole_metrics.items():
            want = float(sum_of_sample_mean(torch.cat(v), resps, masks))
            assert reduced[k] == pytest.approx(want, rel=1e-5, abs=1e-6), (opts, k)
        assert reduced_pg == pytest.approx(independent, rel=1e-5, abs=1e-7), opts
        if any(not torch.equal(a, m) for a, m in zip(ref_m, masks)):  # the check sees the rejections
            everything = sum(float((p * w * m).sum()) / max(float(d), 1.0)
                             for p, w, m, d in zip(pg_loss, ref_w, masks, denoms))
            assert abs(everything - independent) > 1e-4, opts
            rejecting += 1
    assert rejecting >= 2


def test_example_script_runs(capsys):
    """examples/integration_slime.py, as the docs say to run it: the veto drops sample 3 and the
    printed metrics include slime's names and this library's."""
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "integration_slime.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "kept tokens per sample: [5, 6, 3, 0] of [5, 6, 3, 6]" in out
    assert "mis_rs_catastrophic_seq_fraction" in out and "rollout_corr/rollout_is_mean" in out


@pytest.mark.parametrize("denominator", [None, "valid", "kept"])
def test_loss_denominator_through_slimes_reducer(denominator):
    """slime divides each sample by its given token count (``rollout_mask_sums``, one sample per
    rollout): by default (``valid``) rejected tokens stay counted, as in slime; ``loss_denominator:
    kept`` in the YAML makes slime's loss the mean over each sample's kept tokens."""
    yaml_text = "use_tis: true\ntis_mode: mask\ntis_level: token\ntis_lower_bound: 0.7\ntis_upper_bound: 1.4\n"
    if denominator is not None:
        yaml_text += f"loss_denominator: {denominator}\n"
    args = slime_args(yaml_text, "--use-tis", "--custom-tis-function-path", FUNCTION_PATH)
    pg_loss, train, rollout, masks = _samples(seed=4)
    lengths = [len(t) for t in train]
    new_pg, modified, _ = call_like_slime(args, pg_loss, train, rollout, masks, [n + 5 for n in lengths], lengths)
    got = sum_of_sample_mean(new_pg, lengths, modified, [m.sum() for m in masks])
    expected, rejected = 0.0, 0
    for x, t, r, m in zip(pg_loss.split(lengths), train, rollout, masks):
        rho = (t - r).exp()
        keep = (m > 0) & (rho >= 0.7) & (rho <= 1.4)
        rejected += int(((m > 0) & ~keep).sum())
        den = keep.sum() if denominator == "kept" else m.sum()
        expected += float(torch.where(keep, x * rho, 0.0).sum() / den.clamp_min(1))
    assert rejected > 0
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_bad_loss_denominator_is_refused():
    args = slime_args("use_tis: true\nloss_denominator: all\n", "--use-tis")
    with pytest.raises(ValueError, match="loss_denominator"):
        config_from_slime_args(args)


def test_expect_zero_mode_through_slimes_arguments():
    """slime's true on-policy mode: ``--expect-zero-atol`` on slime's arguments switches the
    correction off (loss unchanged) and turns a disagreement into a MismatchError."""
    from rollout_correction import MismatchError

    pg_loss, train, _, masks = _samples(scale=0.3)
    args = argparse.Namespace(use_tis=False, expect_zero_atol=1e-6)
    assert config_from_slime_args(args).expect_zero_atol == 1e-6
    same = [t.clone() for t in train]
    out_loss, out_masks, metrics = tis_function(args, pg_loss=pg_loss, train_log_probs=train,
                                                rollout_log_probs=same, loss_masks=masks)
    torch.testing.assert_close(out_loss, pg_loss)
    assert all(torch.equal(a, b) for a, b in zip(out_masks, masks))
    assert "rollout_corr/max_abs_log_ratio" in metrics
    same[1] = same[1] + 4.5e-4  # slime#830's regression, on every token of sample 1
    with pytest.raises(MismatchError, match="row 1, column"):
        tis_function(args, pg_loss=pg_loss, train_log_probs=train, rollout_log_probs=same, loss_masks=masks)
    floor = _args(log_prob_floor=-50.0, expect_zero_atol=None)
    assert config_from_slime_args(floor).log_prob_floor == -50.0


def test_the_metric_families_pass_through_slimes_arguments():
    """``rollout_correction_metrics`` in the ``--custom-config-path`` YAML (slime merges it into its
    args): the call's ``rollout_corr/...`` metrics are those families, slime's own ``mis_*`` metrics
    stay; batch normalisation without the default family (its factor feeds ``mis_*_final``) and an
    unknown family are refused, naming them."""
    pg_loss, train, rollout, masks = _samples(scale=0.3)
    lengths = [len(t) for t in train]
    yaml_text = "use_tis: true\ntis_upper_bound: 1.5\nrollout_correction_metrics: [default, raw]\n"
    args = slime_args(yaml_text, "--use-tis", "--custom-tis-function-path", FUNCTION_PATH)
    assert config_from_slime_args(args).metrics == ("default", "raw")
    _, _, metrics = call_like_slime(args, pg_loss, train, rollout, masks, [n + 7 for n in lengths], lengths)
    assert "rollout_corr/rollout_is_raw_mean" in metrics and "rollout_corr/rollout_is_mean" in metrics
    assert "rollout_corr/chi2_token_sn" not in metrics and "mis_tis_weight_after_bound" in metrics
    args = slime_args("use_tis: true\nrollout_correction_metrics: [chi2]\n", "--use-tis",
                      "--custom-tis-function-path", FUNCTION_PATH)
    _, _, metrics = call_like_slime(args, pg_loss, train, rollout, masks, [n + 7 for n in lengths], lengths)
    assert {k for k in metrics if k.startswith("rollout_corr/")} == {
        "rollout_corr/chi2_token_sn", "rollout_corr/chi2_seq_sn", "rollout_corr/nonfinite_seq_fraction"}
    with pytest.raises(ValueError, match="without 'default' under tis_batch_normalize"):
        config_from_slime_args(slime_args("use_tis: true\ntis_batch_normalize: true\n"
                                          "rollout_correction_metrics: [raw]\n", "--use-tis"))
    with pytest.raises(ValueError, match="unknown family 'rw'"):
        config_from_slime_args(slime_args("rollout_correction_metrics: [rw]\n"))
