"""``loss_denominator``: rejected tokens and sequences leave the loss denominators ("kept", the
default) or stay counted with a zero loss ("valid"), in every aggregation mode and loss path.

By hand (``agg_loss``): per-token losses [[1, 2, 3], [4, 5, ·]], the rejection keeps tokens
(0, 0) and (0, 2) (row 1 is rejected whole), the response mask has 3 + 2 valid tokens:

    mode                     kept              valid
    token-mean               (1 + 3)/2 = 2     (1 + 3)/5 = 0.8
    token-sum                4                 4
    seq-mean-token-sum       4/1 = 4           (4 + 0)/2 = 2
    seq-mean-token-mean      (4/2)/1 = 2       (4/3 + 0/2)/2 = 2/3
    seq-mean-token-sum-norm  4/1/3             (4 + 0)/2/3

With "valid" the loss is the one OpenRLHF's ``PolicyLoss`` / ``aggregate_loss`` (every tested
release) and slime's reducer (per sample Σ ℓ·m'/``rollout_mask_sums``, over the step's samples)
compute on the same batch; with "kept" it is today's.
"""

from __future__ import annotations

import functools

import pytest
import torch

import openrlhf_reference as ref
from rollout_correction import ConfigError, RolloutCorrectionConfig, compute_policy_loss
from rollout_correction_core._src.losses import LOSS_AGG_MODES, agg_loss
from rollout_correction import Aggregation, PolicyLoss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 7.0]])
KEPT = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
VALID = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
BY_HAND = {"token-mean": (2.0, 0.8), "token-sum": (4.0, 4.0), "seq-mean-token-sum": (4.0, 2.0),
           "seq-mean-token-mean": (2.0, 2 / 3), "seq-mean-token-sum-norm": (4 / 3, 2 / 3)}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_by_hand(mode):
    kept, valid = BY_HAND[mode]
    assert agg_loss(LOSS, KEPT, aggregation=Aggregation(mode)).item() == pytest.approx(kept)
    assert agg_loss(LOSS, KEPT, count_mask=VALID, aggregation=Aggregation(mode)).item() == pytest.approx(valid)


def _batch(B=6, T=7, seed=0, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2 - 0.05
    old = (rollout + scale * torch.randn(B, T, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    log_prob = (old + 0.1 * torch.randn(B, T, generator=g)).clamp(max=0.0).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    mask = torch.ones(B, T)
    for i in range(B):
        mask[i, T - i % 3:] = 0
    return log_prob, old, rollout, adv, mask


def _ours(batch, denominator, mode, rs="token_k1", thr="0.6_1.6", **kw):
    lp, old, rollout, adv, mask = batch
    lp = lp.detach().clone().requires_grad_(True)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9, rollout_rs=rs,
                                  rollout_rs_threshold=thr, loss_denominator=denominator)
    loss, metrics = compute_policy_loss(
        lp, old, adv, mask, config=cfg, rollout_log_prob=rollout, loss=PolicyLoss(aggregation=Aggregation(mode, **kw)))
    loss.backward()
    return loss, lp.grad, metrics


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kept_is_todays_loss_and_valid_counts_the_response_mask(mode):
    batch = _batch()
    lp, old, rollout, adv, mask = batch
    today, g_today, _ = _ours(batch, None, mode)
    kept, g_kept, m = _ours(batch, "kept", mode)
    valid, g_valid, _ = _ours(batch, "valid", mode)
    assert torch.equal(today, kept) and torch.equal(g_today, g_kept)
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1  # the rejection really bit
    # the same per-token loss, aggregated by hand over the two count masks
    rho = (old - rollout).exp()
    keep = mask.bool() & (rho >= 0.6) & (rho <= 1.6)
    r = (lp.detach() - old).exp()
    pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg) * rho
    for count, got in ((keep, kept), (mask.bool(), valid)):
        n = count.sum(-1).double()
        num = torch.where(keep, pg, 0.0).sum(-1).double()
        expected = {"token-mean": num.sum() / n.sum(), "token-sum": num.sum(),
                    "seq-mean-token-sum": num.sum() / (n > 0).sum(),
                    "seq-mean-token-mean": (num / n.clamp_min(1)).sum() / (n > 0).sum(),
                    "seq-mean-token-sum-norm": num.sum() / (n > 0).sum() / mask.shape[1]}[mode]
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    if mode in ("token-mean", "seq-mean-token-mean"):  # (no whole sequence is rejected here)
        assert not torch.allclose(kept, valid)


@functools.lru_cache(maxsize=None)
def _openrlhf_loss_module(root):
    """The release's ``models/loss.py`` module (``PolicyLoss``, and ``aggregate_loss`` from 0.11)."""
    with ref.ppo_actor(root) as ns:
        return ns.loss


def _openrlhf_policy_loss(loss, root, lo, hi, token_level):
    if ref.gate_options(root):  # 0.11.2: level / mode / gating
        return loss.PolicyLoss(dual_clip=3.0, token_level_loss=token_level, is_correction_level="token",
                                  is_correction_mode="mask", is_correction_threshold=(lo, hi))
    return loss.PolicyLoss(dual_clip=3.0, token_level_loss=token_level, enable_vllm_is_correction=True,
                              vllm_is_truncated_threshold=[lo, hi], vllm_is_correction_type="icepop")


@pytest.mark.parametrize("root", ref.source_roots(), ids=lambda r: ref.release_of(r))
@pytest.mark.parametrize("token_level", [True, False])
def test_valid_equals_openrlhf_policy_loss(root, token_level):
    """OpenRLHF's ICEPOP gate zeroes the rejected tokens' loss and keeps them in its denominators:
    rejection by token_k1 on [0.6, 1.6] with w = ρ_t and loss_denominator="valid" is the same loss
    and gradient (token mean, or OpenRLHF's per-sequence mean)."""
    batch = _batch()
    lp, old, rollout, adv, mask = batch
    module = _openrlhf_loss_module(root)
    pl = _openrlhf_policy_loss(module, root, 0.6, 1.6, token_level)
    theirs_lp = lp.detach().clone().requires_grad_(True)
    theirs = pl(theirs_lp, old, adv, action_mask=mask, rollout_log_probs=rollout)[0]
    theirs.backward()
    aggregate = getattr(module, "aggregate_loss", None)
    mode = "token-mean" if token_level else "seq-mean-token-mean"
    valid, g_valid, _ = _ours(batch, "valid", mode)
    torch.testing.assert_close(valid, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_valid, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    kept, _, _ = _ours(batch, "kept", mode)
    assert not torch.allclose(kept, theirs)
    if aggregate is not None:  # 0.11.x: the reducer alone, with its global denominators
        n_tok, n_seq = float(mask.sum()), float((mask.sum(-1) > 0).sum())
        ours = _ours(batch, "valid", mode, global_num_tokens=n_tok, global_num_seqs=n_seq, dp_size=2)[0]
        pg = _per_token(batch)
        theirs = aggregate(pg, mask, token_level_loss=token_level, dp_size=2, batch_num_tokens=n_tok,
                           global_batch_size=n_seq)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def _per_token(batch, lo=0.6, hi=1.6):
    """ρ_t-weighted dual-clip PPO per token, 0 at the rejected tokens (OpenRLHF's ICEPOP loss)."""
    lp, old, rollout, adv, mask = batch
    rho = (old - rollout).exp()
    keep = (rho >= lo) & (rho <= hi)
    r = (lp.detach() - old).exp()
    pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg)
    return torch.where(keep, rho * pg, 0.0)


def _slime_reducer(x_flat, response_lengths, modified_masks, rollout_mask_sums):
    """slime's ``get_sum_of_sample_mean`` (slime/backends/megatron_utils/cp_utils.py, no context
    parallelism), re-derived: Σ_i Σ_t x_it·m'_it / max(rollout_mask_sums_i, 1) over the flat
    per-sample concatenation; ``loss_function`` then divides by the step's sample count."""
    return sum((x_i * m_i).sum() / torch.clamp_min(d_i, 1)
               for x_i, m_i, d_i in zip(x_flat.split(response_lengths), modified_masks, rollout_mask_sums))


@pytest.mark.parametrize("rs,thr", [("token_k1", "0.6_1.6"), ("seq_mean_k1", "0.8_1.25")])
def test_valid_equals_slimes_reducer(rs, thr):
    """slime keeps each sample's original token count (``rollout_mask_sums``, one sample per
    rollout) whatever the rejection removed: seq-mean-token-mean with "valid" and the step's
    sample count as global_num_seqs is its loss."""
    batch = _batch(seed=3)
    lp, old, rollout, adv, mask = batch
    B = mask.shape[0]
    ours, _, m = _ours(batch, "valid", "seq-mean-token-mean", rs=rs, thr=thr, global_num_seqs=B)
    assert m["rollout_corr/rollout_rs_masked_fraction"] > 0
    # slime's inputs: per-sample 1-D tensors of the valid positions
    lengths = [int(n) for n in mask.sum(-1)]
    rho = (old - rollout).exp()
    if rs == "token_k1":
        keep = (rho >= 0.6) & (rho <= 1.6)
    else:
        geo = ((old - rollout) * mask).sum(-1) / mask.sum(-1)
        keep = ((geo.exp() >= 0.8) & (geo.exp() <= 1.25)).unsqueeze(-1).expand_as(mask)
    r = (lp.detach() - old).exp()
    pg = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -3.0 * adv), pg) * rho
    valid = mask.bool()
    flat = pg[valid]
    modified = [keep[i][valid[i]].float() for i in range(B)]
    sums = torch.tensor(lengths, dtype=torch.float32)
    theirs = _slime_reducer(flat, lengths, modified, sums) / B
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # with local counts "kept" divides by fewer tokens (token_k1) or fewer sequences (seq_mean_k1)
    kept, _, _ = _ours(batch, "kept", "seq-mean-token-mean", rs=rs, thr=thr)
    valid_local, _, _ = _ours(batch, "valid", "seq-mean-token-mean", rs=rs, thr=thr)
    torch.testing.assert_close(valid_local, ours)  # no empty row: B sequences either way
    assert not torch.allclose(kept, valid_local)


def test_bad_value_is_refused():
    with pytest.raises(ConfigError, match="loss_denominator"):
        RolloutCorrectionConfig(loss_denominator="all")


@pytest.mark.parametrize("root", ref.source_roots(), ids=lambda r: ref.release_of(r))
@pytest.mark.parametrize("token_level", [True, False])
def test_openrlhf_adapter_honours_both(root, token_level):
    """The OpenRLHF adapter with loss_denominator="valid" leaves the action mask whole and zeroes
    the rejected tokens' weights: OpenRLHF's own ICEPOP loss. With "kept" (its default) the forward
    call's mask holds the accepted tokens only, so OpenRLHF's local means count those."""
    from rollout_correction.integrations.openrlhf import RolloutCorrectionPolicyLoss

    batch = _batch(seed=5)
    lp, old, rollout, adv, mask = batch
    module = _openrlhf_loss_module(root)
    theirs_lp = lp.detach().clone().requires_grad_(True)
    theirs = _openrlhf_policy_loss(module, root, 0.6, 1.6, token_level)(
        theirs_lp, old, adv, action_mask=mask, rollout_log_probs=rollout)[0]
    theirs.backward()
    results = {}
    for denominator in ("valid", "kept"):
        cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1e9, rollout_rs="token_k1",
                                      rollout_rs_threshold="0.6_1.6", loss_denominator=denominator)
        ours = RolloutCorrectionPolicyLoss(module.PolicyLoss(dual_clip=3.0, token_level_loss=token_level), cfg)
        ours_lp = lp.detach().clone().requires_grad_(True)
        loss = ours(ours_lp, old, adv, action_mask=mask, rollout_log_probs=rollout)[0]
        loss.backward()
        results[denominator] = (loss, ours_lp.grad)
    torch.testing.assert_close(results["valid"][0], theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results["valid"][1], theirs_lp.grad, rtol=1e-5, atol=1e-7)
    mode = "token-mean" if token_level else "seq-mean-token-mean"
    torch.testing.assert_close(results["kept"][0], _ours(batch, "kept", mode)[0], rtol=1e-5, atol=1e-7)


def test_openrlhf_adapter_refuses_valid_with_the_core_losses():
    from rollout_correction.integrations.openrlhf import RolloutCorrectionPolicyLoss

    module = _openrlhf_loss_module(ref.installed_root())
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6", loss_type="cispo",
                                  loss_denominator="valid")
    with pytest.raises(ValueError, match="loss_denominator='valid' with loss_type='cispo'"):
        RolloutCorrectionPolicyLoss(module.PolicyLoss(), cfg)
