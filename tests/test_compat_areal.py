"""``rollout_correction.compat.areal.apply_rejection_sampling`` side by side with AReaL 1.0.4's own.

AReaL's package imports its whole service stack (``httpx``, ``uvloop``, hydra, ...), which CI does not
install (``pip install --no-deps areal==1.0.4``), so AReaL's own definitions are compiled from its
installed files, unmodified: ``apply_rejection_sampling``, ``_check_bounds`` and
``RejectionSamplingResult`` (``areal/utils/functional/functional.py``), ``KLEstimator``
(``areal/utils/data.py``) and ``RejectionSamplingConfig`` with its validation
(``areal/api/cli_args.py``). On random padded and packed batches, for every level, action, metric and
aggregation AReaL 1.0.4 has: equal masks, weights within float tolerance, equal filtered fractions.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
import random
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_correction import ConfigError
from rollout_correction.compat.areal import RejectionSamplingResult, apply_rejection_sampling

_DEFINITIONS = {"utils/functional/functional.py": ("RejectionSamplingResult", "_check_bounds", "apply_rejection_sampling"),
                "utils/data.py": ("KLEstimator",), "api/cli_args.py": ("RejectionSamplingConfig",)}


def _load_areal() -> dict:
    spec = importlib.util.find_spec("areal")
    if spec is None:
        pytest.skip("areal is not installed; CI runs: pip install --no-deps areal==1.0.4")
    assert version("areal") == "1.0.4", "the comparison is written against areal 1.0.4"
    root = Path(spec.submodule_search_locations[0])
    namespace: dict = {"torch": torch, "dataclass": dataclasses.dataclass, "field": dataclasses.field,
                       "Any": Any, "warnings": warnings}
    for relative, names in _DEFINITIONS.items():
        path = root / relative
        nodes = [n for n in ast.parse(path.read_text()).body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
        assert sorted(n.name for n in nodes) == sorted(names), f"{path} no longer defines {names}"
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


AREAL = _load_areal()
Config = AREAL["RejectionSamplingConfig"]


def _configs():
    for level, metric, agg, action in itertools.product(("token", "sequence"), ("ratio", "kl_k1", "kl_k2", "kl_k3"),
                                                        ("sum", "mean", "max"), ("mask", "clamp")):
        if (level == "token" and agg != "mean") or (action == "clamp" and metric != "ratio"):
            continue
        bounds = {"ratio": [(2.0, None), (1.5, 0.6)], "kl_k1": [(0.3, None), (0.4, -0.3)],
                  "kl_k2": [(0.05, None)], "kl_k3": [(0.05, None)]}[metric]
        if level == "sequence" and agg == "sum" and metric != "ratio":
            bounds = [(u * 4, None if lo is None else lo * 4) for u, lo in bounds]
        for upper, lower in bounds:
            if agg == "max" and lower is not None and metric in ("ratio", "kl_k1"):
                continue  # refused by name (test below)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield Config(level=level, metric=metric, agg=agg, action=action, upper=upper, lower=lower)


CONFIGS = list(_configs())


def _batch(seed: int, packed: bool):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    B = rng.randint(1, 6)
    lengths = [rng.randint(1, 9) for _ in range(B)]
    T = max(lengths)
    scale = rng.choice([0.05, 0.3, 1.0])
    old = -torch.rand(B, T, generator=gen) * 3
    prox = (old + torch.randn(B, T, generator=gen) * scale).clamp(max=0.0)  # log-probs are ≤ 0
    mask = (torch.rand(B, T, generator=gen) > 0.2) & (torch.arange(T) < torch.tensor(lengths)[:, None])
    if B > 1 and rng.random() < 0.3:
        mask[rng.randrange(B)] = False
    mask = mask.float() if rng.random() < 0.5 else mask
    if not packed:
        return prox, old, mask, None
    inside = torch.arange(T) < torch.tensor(lengths)[:, None]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return prox[inside], old[inside], mask[inside], cu


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.level}-{c.metric}-{c.agg}-{c.action}-{c.upper}-{c.lower}")
def test_equals_areals_apply_rejection_sampling_on_random_batches(config, packed):
    for seed in range(12):
        prox, old, mask, cu = _batch(seed, packed)
        mine = apply_rejection_sampling(prox, old, mask, cu, config)
        theirs = AREAL["apply_rejection_sampling"](prox, old, mask, cu, config)
        assert isinstance(mine, RejectionSamplingResult)
        assert mine.loss_mask.dtype == theirs.loss_mask.dtype and mine.loss_mask.shape == theirs.loss_mask.shape
        assert torch.equal(mine.loss_mask, theirs.loss_mask), seed
        torch.testing.assert_close(mine.behave_imp_weight, theirs.behave_imp_weight, rtol=2e-6, atol=1e-7)
        assert mine.filtered_fraction == pytest.approx(theirs.filtered_fraction, abs=1e-12), seed


def test_settings_areal_has_no_equivalent_for_are_refused_by_name():
    for config in (dict(level="sequence", agg="max", metric="ratio", upper=2.0, lower=0.5),
                   dict(metric="kl_k3", upper=1.0, lower=0.1), dict(action="clamp", metric="kl_k2", upper=1.0)):
        with pytest.raises(ConfigError, match="lower|clamp"):
            apply_rejection_sampling(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), None, config)


def test_nonfinite_log_probs_drop_the_sequence_instead_of_weight_one():
    prox = torch.tensor([[0.0, float("nan"), 0.1], [0.2, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    result = apply_rejection_sampling(prox, old, torch.ones(2, 3), None, {"upper": 5.0})
    assert result.loss_mask.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert torch.isfinite(result.behave_imp_weight).all() and result.behave_imp_weight[0].eq(0).all()
    assert result.filtered_fraction == pytest.approx(0.5)


def _areal_main_kpop(prox: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """AReaL main's ``metric="binary_kl"`` statistic, written out: max(KL(p‖q), KL(q‖p)) of the
    sampled token's Bernoulli, p = π_prox, q = π_behave clamped to [1e-8, 1 − 1e-8]."""
    def kl(log_a, log_b):
        a, b = log_a.exp().clamp(1e-8, 1 - 1e-8), log_b.exp().clamp(1e-8, 1 - 1e-8)
        return a * (a / b).log() + (1 - a) * ((1 - a) / (1 - b)).log()
    return torch.maximum(kl(prox, old), kl(old, prox))


@pytest.mark.parametrize("level,agg", [("token", "mean"), ("sequence", "sum"), ("sequence", "mean"), ("sequence", "max")])
def test_binary_kl_keeps_what_areal_mains_kpop_keeps(level, agg):
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        old = -0.02 - torch.rand(5, 8, generator=gen) * 3  # probabilities inside both clamps
        prox = (old + torch.randn(5, 8, generator=gen) * 0.3).clamp(max=-0.02)
        mask = torch.rand(5, 8, generator=gen) > 0.2
        upper = 0.02
        stat = torch.where(mask, _areal_main_kpop(prox, old), 0.0)
        if level == "token":
            keep = stat <= upper
        else:
            n = mask.sum(-1, keepdim=True).clamp(min=1)
            row = {"sum": stat.sum(-1, keepdim=True), "mean": stat.sum(-1, keepdim=True) / n,
                   "max": stat.amax(-1, keepdim=True)}[agg]
            keep = (row <= upper).expand_as(mask)
        result = apply_rejection_sampling(prox, old, mask, None, dict(metric="binary_kl", level=level, agg=agg,
                                                                       upper=upper))
        assert torch.equal(result.loss_mask, mask & keep), seed
        torch.testing.assert_close(result.behave_imp_weight, torch.where(mask & keep, (prox - old).exp(), 0.0))


def _actor_loss_fn(rejection_sampling_fn):
    """AReaL 1.0.4's ``ppo_actor_loss_fn`` compiled from its file, calling ``rejection_sampling_fn`` where
    its module calls ``apply_rejection_sampling`` (what the drop-in in place of AReaL's module gives)."""
    root = Path(importlib.util.find_spec("areal").submodule_search_locations[0])
    path = root / "utils/functional/functional.py"
    nodes = [n for n in ast.parse(path.read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name in ("ppo_actor_loss_fn", "_compute_sequence_level_ratio_and_advantages")]
    namespace = dict(AREAL, apply_rejection_sampling=rejection_sampling_fn)
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["ppo_actor_loss_fn"]


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.upper in (1.5, 0.4, 0.05) or c.action == "clamp"][:10],
                         ids=lambda c: f"{c.level}-{c.metric}-{c.agg}-{c.action}")
def test_areals_actor_loss_on_the_drop_in_equals_its_own(config):
    """AReaL's PPO loss (``ppo_actor_loss_fn``, called by its actor's ``grpo_loss_fn``) with the drop-in:
    the same loss and gradient as with AReaL's function; rejected tokens stay in its denominator."""
    mine, theirs = _actor_loss_fn(apply_rejection_sampling), _actor_loss_fn(AREAL["apply_rejection_sampling"])
    for seed in range(4):
        prox, old, mask, _ = _batch(seed, packed=False)
        mask = mask.bool()
        logprobs = (prox + 0.1 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(seed))).clamp(max=0.0).requires_grad_()
        adv = torch.randn(prox.shape, generator=torch.Generator().manual_seed(seed + 1))
        losses = []
        for fn in (mine, theirs):
            loss, stat = fn(logprobs=logprobs, proximal_logprobs=prox, old_logprobs=old, advantages=adv, eps_clip=0.2,
                            loss_mask=mask, rejection_sampling=config)
            losses.append((loss, torch.autograd.grad(loss, logprobs)[0], stat["behave_mask"]))
        (l_m, g_m, b_m), (l_t, g_t, b_t) = losses
        torch.testing.assert_close(l_m, l_t, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(g_m, g_t, rtol=1e-5, atol=1e-7)
        assert torch.equal(b_m, b_t)


def test_areals_actor_loss_keeps_rejected_tokens_in_its_denominator():
    loss_fn = _actor_loss_fn(apply_rejection_sampling)
    prox = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # token 1: ρ = e² > 2, rejected
    old = torch.zeros(1, 4)
    logprobs = prox.clone()  # π_θ = π_prox: r = 1, no clipping
    adv = torch.tensor([[1.0, 1.0, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    loss, stat = loss_fn(logprobs=logprobs, proximal_logprobs=prox, old_logprobs=old, advantages=adv, eps_clip=0.2,
                         loss_mask=mask, rejection_sampling={"upper": 2.0})
    assert stat["behave_mask"].tolist() == [[True, False, True, False]]
    assert float(loss) == pytest.approx(-(1.0 + 2.0) / 3)  # Σ over kept tokens of −A·r·w, over the 3 original
