"""The policy loss and the GRPO estimator inside verl 0.9.1's own worker and driver code.

What runs is verl's, unmodified:

* the config: Hydra composes verl's ``ppo_trainer.yaml`` (through the config of this library's
  entry point, ``rollout_correction.integrations.verl.main_ppo``, which adds the ``backend`` key and
  removes it with ``task_runner_class`` before verl sees the config) with the override lines that
  docs/integrations.md documents (read from the docs by this test), ``OmegaConf.resolve`` as verl's
  TaskRunner does, and ``omega_conf_to_dataclass(config.actor_rollout_ref.actor)`` as verl's actor
  worker does (``verl/workers/engine_workers.py``) — the config object the worker really holds;
* the correction step: the method ``rollout_correction_step`` of the subclass of verl's V1 trainer
  that the entry point runs (its ``_compute_advantage`` calls it; run through TransferQueue in
  tests/test_integration_verl_v1.py);
* the worker's data: ``DataProto.to_tensordict`` + ``left_right_2_no_padding`` (verl's padded →
  packed conversion, which takes ``loss_mask`` from the corrected ``response_mask``), the micro-batches from verl's ``prepare_micro_batches``, and
  the loss from verl's ``verl.workers.utils.losses.ppo_loss``, which looks the loss up in verl's
  registry (``get_policy_loss_fn(loss_mode)``) and fills ``global_batch_info`` itself;
* the advantages: verl's ``compute_advantage`` (``verl/trainer/ppo/ray_trainer.py``) through the
  V1 trainer's ``compute_advantage_for_multi_trajectories`` (``verl/trainer/ppo/v1/utils.py``),
  which looks the estimator up in verl's registry;
* plugin loading: a fresh Python process that only runs ``import verl`` (verl's entry-point loop,
  and ``VERL_USE_EXTERNAL_MODULES`` → verl's ``import_external_libs``).

Stand-ins, for heavy things the numerics never touch:

* ``ray`` (see tests/verl_reference.py): verl's modules import it; nothing here calls it.
* The model's forward: the log-probabilities π_θ are given as the nested tensor verl's FSDP engine
  builds from the model output (``nested_tensor_from_jagged`` over the packed sequences, response
  token t at position prompt_len + t − 1).
* Two lines of the engine's ``forward_backward_batch`` that need a built FSDP engine are repeated
  here as verl writes them: ``batch_num_tokens = data["loss_mask"].sum()`` (all-reduced over the
  data-parallel group: one rank here) and ``dp_size``.
* ``ray_trainer.py`` and ``v1/utils.py`` import Ray actors, rollout servers and TransferQueue at
  module level; the two advantage functions are compiled from those installed files' own source
  (``_verl_functions``) with the names they use bound to verl's real objects.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from verl_reference import load_verl_core_algos, require_verl

require_verl()

import numpy as np  # noqa: E402
import verl  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

import rollout_correction.integrations.verl as rc_verl  # noqa: E402

CORE = load_verl_core_algos()
HERE = os.path.dirname(os.path.abspath(__file__))
VERL_DIR = os.path.dirname(verl.__file__)
DOCS = os.path.join(HERE, os.pardir, "docs", "integrations.md")
SUBSECTION = "Policy loss and GRPO estimator"
# Sizes every verl run sets (verl's validate_config refuses the YAML's nulls); not part of the recipe.
SIZES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


# ----------------------------------------------------------------------------- the documented lines


def _documented_blocks() -> list[list[str]]:
    """The override lines of each ```bash block of the docs' sub-section, in order."""
    text = open(DOCS, encoding="utf-8").read()
    start = text.index(f"### {SUBSECTION}")
    end = text.find("\n#", start + 4)
    section = text[start:] if end < 0 else text[start:end]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert blocks, f"no ```bash block in the docs' '{SUBSECTION}' sub-section"
    out = []
    for block in blocks:
        lines = []
        for raw in block.replace("\\\n", " ").split():
            if "=" in raw and not raw.startswith(("python", "--")):
                lines.append(raw.strip("'\""))
        out.append(lines)
    return out


def _doc_lines(*must_contain: str) -> list[str]:
    """The first documented block that has all the given keys."""
    for lines in _documented_blocks():
        keys = " ".join(lines)
        if all(key in keys for key in must_contain):
            return lines
    raise AssertionError(f"no documented block with {must_contain}")


def _compose(overrides: list[str]):
    """The config verl's processes get from the entry point for ``overrides``."""
    from rollout_correction.integrations.verl import main_ppo

    config = main_ppo.compose(overrides)
    main_ppo.task_runner_class(config)  # reads and removes the backend key, refuses what cannot act
    OmegaConf.resolve(config)  # verl's TaskRunner does this before building the trainer and workers
    return config


def _compose_verl(overrides: list[str]):
    """The config of verl's own entry point (``verl.trainer.main_ppo``) for ``overrides``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(VERL_DIR, "trainer/config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)
    return config


def _worker_actor_config(config):
    """What verl's ActorRolloutRefWorker builds from its config (engine_workers.py)."""
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


# ----------------------------------------------------------------------------- verl's data path


def _engine_utils():
    # verl/workers/engine/__init__.py imports every engine backend (peft, ...); the file itself only
    # needs verl.utils, so it is loaded on its own.
    spec = importlib.util.spec_from_file_location("verl_workers_engine_utils",
                                                  os.path.join(VERL_DIR, "workers/engine/utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENGINE_UTILS = _engine_utils()


class Rollout:
    """A small left/right padded rollout batch in verl's DataProto layout."""

    def __init__(self, seed: int, rows: int = 8, prompt: int = 4, width: int = 6, far=(1, 5), noise=0.04,
                 grad: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.prompt_len = torch.randint(1, prompt + 1, (rows,), generator=g)
        self.response_len = torch.randint(1, width + 1, (rows,), generator=g)
        self.response_len[0] = width
        pm = (torch.arange(prompt).unsqueeze(0) >= (prompt - self.prompt_len).unsqueeze(1)).long()
        rm = (torch.arange(width).unsqueeze(0) < self.response_len.unsqueeze(1)).long()
        attention = torch.cat([pm, rm], 1)
        prompts = torch.randint(5, 100, (rows, prompt), generator=g) * pm
        responses = torch.randint(5, 100, (rows, width), generator=g) * rm
        old = -torch.rand(rows, width, generator=g) * 2 - 0.05
        rollout = (old + torch.randn(rows, width, generator=g) * noise).clamp(max=0.0)  # log-probs are ≤ 0
        for i, sign in zip(far, (1.0, -1.0)):
            old[i] -= 1.2 if sign > 0 else 0.0  # room below 0 for the rollout's log-probs
            rollout[i] = old[i] + sign * 1.2  # far off-policy rows: rejected by seq_mean_k3 ≤ 0.01
        self.mask = rm
        self.old, self.rollout = old * rm, rollout * rm
        self.advantages = torch.randn(rows, width, generator=g) * rm
        self.log_prob = (old + torch.randn(rows, width, generator=g) * 0.15).clamp(max=0.0) * rm  # π_θ, ≤ 0
        self.log_prob.requires_grad_(grad)
        self.tensors = dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                            attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp_min(0),
                            response_mask=rm.clone(), old_log_probs=self.old.clone(),
                            rollout_log_probs=self.rollout.clone(), advantages=self.advantages.clone())

    def proto(self) -> DataProto:
        return DataProto.from_dict(tensors={k: v.clone() for k, v in self.tensors.items()})

    def model_log_probs(self, rows) -> torch.Tensor:
        """π_θ as verl's FSDP engine returns it: nested over the packed sequences of ``rows``."""
        values = []
        for i in rows:
            p, r = int(self.prompt_len[i]), int(self.response_len[i])
            full = torch.zeros(p + r)
            full[p - 1:p - 1 + r] = self.log_prob[i, :r]
            values.append(full)
        offsets = torch.tensor([0] + [len(v) for v in values]).cumsum(0)
        return torch.nested.nested_tensor_from_jagged(torch.cat(values), offsets)


def _copy(batch: DataProto) -> DataProto:
    return DataProto.from_dict(tensors={k: v.clone() for k, v in batch.batch.items()},
                               non_tensors={k: v.copy() for k, v in batch.non_tensor_batch.items()})


def _correction_step(batch: DataProto, config) -> tuple[DataProto, dict]:
    """The correction step of the V1 trainer subclass the entry point runs (its method, on the
    trainer's DataProto; the object is made without ``__init__``, which builds workers and models)."""
    from rollout_correction.integrations.verl.trainer import trainer_class

    trainer = object.__new__(trainer_class(config.trainer.v1.trainer_mode))
    trainer.config = config
    return trainer.rollout_correction_step(batch)


def _worker_update(batch: DataProto, config, actor, rollout: Rollout, dp: int = 1):
    """verl's actor update for one mini-batch split over ``dp`` data-parallel ranks (contiguous rows,
    as verl's dispatch splits); returns every rank's per-micro-batch (loss, metrics) and rank 0's data.
    With dp > 1, FSDP averages the ranks' gradients: the effective loss is the sum over ranks / dp."""
    data = left_right_2_no_padding(batch.to_tensordict())  # RayPPOTrainer._update_actor
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(data, global_batch_size=mini, mini_batch_size=mini,
                         micro_batch_size_per_gpu=config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu,
                         use_dynamic_bsz=config.actor_rollout_ref.actor.use_dynamic_bsz)
    ranks = tu.chunk_tensordict(data, dp) if dp > 1 else [data]
    # FSDPEngine.forward_backward_batch: loss_mask summed and all-reduced over the data-parallel group
    batch_num_tokens = sum(rank["loss_mask"].sum().item() for rank in ranks)
    out, start = [], 0
    for rank in ranks:
        tu.assign_non_tensor(rank, sp_size=1)
        tu.assign_non_tensor(rank, batch_num_tokens=batch_num_tokens)
        tu.assign_non_tensor(rank, dp_size=dp)
        micro_batches, _ = ENGINE_UTILS.prepare_micro_batches(data=rank, dp_group=None, same_micro_num_in_dp=True)
        for micro in micro_batches:
            rows = range(start, start + len(micro))
            start += len(micro)
            out.append(ppo_loss(actor, {"log_probs": rollout.model_log_probs(rows)}, micro))
    assert start == len(batch)
    return out, ranks[0]


def _aggregate(results, key: str) -> float:
    """A metric over the micro-batches as verl reduces it (its Metric's own aggregation)."""
    from verl.utils.metric import Metric

    metrics = [m[key] for _, m in results]
    merged = Metric(aggregation=metrics[0].aggregation)
    for metric in metrics:
        merged.extend(metric)
    return float(merged.aggregate())


# ----------------------------------------------------------------------------- hand computations


def _k3_seq_mean(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rho = log_ratio.double().exp()
    k3 = rho - 1 - log_ratio.double()
    return (k3 * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def _ppo_clip(log_prob, old, adv, low=0.2, high=0.2, c=3.0):
    ratio = (log_prob.double() - old.double()).exp()
    adv = adv.double()
    clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(clipped, -adv * c), clipped)


def _grpo_accepted_by_hand(scores, uids, accepted, eps=1e-6, norm=True):
    adv = torch.zeros(len(scores), dtype=torch.float64)
    for uid in set(uids):
        members = [i for i, u in enumerate(uids) if u == uid and accepted[i]]
        if len(members) < 2:
            continue
        values = [float(scores[i]) for i in members]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for i in members:
            adv[i] = (float(scores[i]) - mean) / (std + eps) if norm else float(scores[i]) - mean
    return adv


# ----------------------------------------------------------------------------- 1. policy loss in the worker


@pytest.mark.parametrize("dp", [1, 2])
def test_documented_decoupled_lines_run_our_loss_in_verls_worker_with_accepted_token_denominator(dp):
    lines = _doc_lines("actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction", "algorithm.adv_estimator=grpo_accepted")
    config = _compose(lines + SIZES)
    actor = _worker_actor_config(config)
    assert actor.policy_loss.loss_mode == rc_verl.LOSS_NAME
    assert CORE.get_policy_loss_fn(actor.policy_loss.loss_mode) is rc_verl.policy_loss
    block = config.algorithm.rollout_correction
    assert not block.bypass_mode and block.rollout_is == "token" and block.rollout_rs == "seq_mean_k3"

    r = Rollout(seed=3, grad=True)
    batch, metrics = _correction_step(r.proto(), config)
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0

    # Hand: rows whose mean k3(π_old/π_rollout) exceeds 0.01 are rejected; token TIS weights min(ρ, 2).
    log_ratio = r.old - r.rollout
    accepted = (_k3_seq_mean(log_ratio, r.mask) <= float(block.rollout_rs_threshold)) & (r.mask.sum(-1) > 0)
    keep = r.mask.bool() & accepted.unsqueeze(-1)
    assert 0 < int(accepted.sum()) < len(accepted) and not accepted[1] and not accepted[5]
    assert torch.equal(batch.batch["response_mask"].bool(), keep)
    weights = log_ratio.double().exp().clamp(max=float(block.rollout_is_threshold))

    results, data = _worker_update(batch, config, actor, r, dp=dp)
    # the worker's loss_mask is the corrected response_mask (on V1 the trainer subclass writes it,
    # tests/test_integration_verl_v1.py): only accepted tokens count
    assert data["batch_num_tokens"] == int(keep.sum()) < int(r.mask.sum())
    assert actor.global_batch_info["batch_num_tokens"] == int(keep.sum())  # filled by verl's ppo_loss
    assert actor.global_batch_info["dp_size"] == dp
    total = sum(loss for loss, _ in results) / dp
    expected = (_ppo_clip(r.log_prob, r.old, r.advantages) * weights * keep).sum() / keep.sum()
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-7)
    # the gradient verl's backward takes through the nested model output: only accepted tokens, / N_accepted
    (grad,) = torch.autograd.grad(total, r.log_prob)
    (grad_hand,) = torch.autograd.grad(expected, r.log_prob)
    torch.testing.assert_close(grad, grad_hand, rtol=1e-5, atol=1e-7)
    assert torch.all(grad[~keep] == 0) and torch.any(grad[keep] != 0)
    expected = expected.detach()
    if dp == 1:  # verl sums the micro-batch pg_loss metrics when global denominators are used
        assert math.isclose(_aggregate(results, "actor/pg_loss"), float(expected), rel_tol=1e-6, abs_tol=1e-7)
    assert all("actor/pg_clipfrac" in m and "actor/ppo_kl" in m for _, m in results)


def test_decoupled_loss_equals_verls_vanilla_loss_on_the_same_worker_data():
    """Without rejection, verl's own default loss and ours agree on verl's worker data."""
    lines = _doc_lines("actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction", "algorithm.adv_estimator=grpo_accepted")
    r = Rollout(seed=4, far=())
    ours = _compose(lines + SIZES)
    theirs = _compose([x for x in lines if "loss_mode" not in x] + SIZES)
    batch, _ = _correction_step(r.proto(), ours)
    assert torch.equal(batch.batch["response_mask"], r.mask)  # nothing rejected
    mine, _ = _worker_update(_copy(batch), ours, _worker_actor_config(ours), r)
    actor = _worker_actor_config(theirs)
    assert actor.policy_loss.loss_mode == "vanilla"
    verls, _ = _worker_update(batch, theirs, actor, r)
    for (a, _), (b, _) in zip(mine, verls):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert math.isclose(_aggregate(mine, key), _aggregate(verls, key), rel_tol=1e-5, abs_tol=1e-7), key


@pytest.mark.parametrize("extra", [[], ["algorithm.rollout_correction.backend=rollout_correction"]])
def test_documented_bypass_lines_reach_the_worker_and_run_the_correction_in_the_loss(extra):
    lines = _doc_lines("bypass_mode=true")
    config = _compose(lines + SIZES + extra)
    assert config.actor_rollout_ref.rollout.calculate_log_probs is True
    actor = _worker_actor_config(config)  # what the worker holds from its creation on
    assert CORE.get_policy_loss_fn(actor.policy_loss.loss_mode) is rc_verl.policy_loss
    assert actor.policy_loss.rollout_correction["bypass_mode"] is True

    r = Rollout(seed=5)
    batch = r.proto()
    # The legacy trainer's bypass step on the driver: old_log_probs := rollout_log_probs, and it rewrites
    # the *driver's* policy_loss (loss_mode="bypass_mode") after the workers got theirs (verl #4912).
    from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

    driver_policy_loss = config.actor_rollout_ref.actor.policy_loss
    apply_bypass_mode(batch=batch, rollout_corr_config=config.algorithm.rollout_correction,
                      policy_loss_config=driver_policy_loss)
    assert driver_policy_loss.loss_mode == "bypass_mode" and actor.policy_loss.loss_mode == rc_verl.LOSS_NAME
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"])

    results, data = _worker_update(batch, config, actor, r)
    # Hand: RS from π_θ vs π_rollout, PPO clip against π_rollout, no IS weights (ppo_clip);
    # verl fixed the token count before the loss ran, so the loss's rejections stay in it.
    block = config.algorithm.rollout_correction
    accepted = _k3_seq_mean(r.log_prob - r.rollout, r.mask) <= float(block.rollout_rs_threshold)
    keep = r.mask.bool() & accepted.unsqueeze(-1)
    assert 0 < int(accepted.sum()) < len(accepted)
    assert data["batch_num_tokens"] == int(r.mask.sum())
    expected = (_ppo_clip(r.log_prob, r.rollout, r.advantages) * keep).sum() / r.mask.sum()
    torch.testing.assert_close(sum(loss for loss, _ in results).double(), expected, rtol=1e-6, atol=1e-7)
    assert all("rollout_corr/rollout_rs_masked_fraction" in m for _, m in results)


def test_bypass_reinforce_with_token_is_from_the_block_in_the_worker():
    lines = _doc_lines("bypass_mode=true") + ["algorithm.rollout_correction.loss_type=reinforce",
                                             "algorithm.rollout_correction.rollout_is=token"]
    config = _compose(lines + SIZES)
    actor = _worker_actor_config(config)
    r = Rollout(seed=11)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # V1's bypass step (and the legacy one's)
    results, data = _worker_update(batch, config, actor, r)
    block = config.algorithm.rollout_correction
    log_ratio = r.log_prob - r.rollout
    accepted = _k3_seq_mean(log_ratio, r.mask) <= float(block.rollout_rs_threshold)
    keep = r.mask.bool() & accepted.unsqueeze(-1)
    assert 0 < int(accepted.sum()) < len(accepted)
    weights = log_ratio.double().exp().clamp(max=float(block.rollout_is_threshold))  # π_θ / π_rollout, TIS
    expected = (-r.advantages.double() * r.log_prob.double() * weights * keep).sum() / r.mask.sum()
    torch.testing.assert_close(sum(loss for loss, _ in results).double(), expected, rtol=1e-6, atol=1e-7)
    assert all("rollout_corr/rollout_is_mean" in m for _, m in results)


def test_bypass_without_the_actor_line_runs_plain_ppo_and_says_so_once(monkeypatch, caplog):
    """verl's V1 trainer never copies the block to the actor: without the documented line the
    worker cannot know bypass mode is on, and the loss says what to add."""
    lines = [x for x in _doc_lines("bypass_mode=true") if "policy_loss.rollout_correction" not in x]
    config = _compose(lines + SIZES)
    actor = _worker_actor_config(config)
    r = Rollout(seed=6)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]  # what V1 writes in bypass mode
    monkeypatch.setattr(rc_verl, "_said", set())
    with caplog.at_level("WARNING", logger=rc_verl.__name__):
        results, _ = _worker_update(batch, config, actor, r)
    said = [rec.getMessage() for rec in caplog.records if "no IS weights" in rec.getMessage()]
    assert len(said) == 1 and "+actor_rollout_ref.actor.policy_loss.rollout_correction=" in said[0]
    expected = (_ppo_clip(r.log_prob, r.rollout, r.advantages) * r.mask).sum() / r.mask.sum()
    torch.testing.assert_close(sum(loss for loss, _ in results).double(), expected, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- 2. GRPO estimator


def _verl_functions(relative_path: str, names: list[str], namespace: dict) -> dict:
    """Compile the named top-level functions from an installed verl file's own source."""
    path = os.path.join(VERL_DIR, relative_path)
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(n.name for n in nodes) == sorted(names), f"{relative_path} lacks one of {names}"
    for node in nodes:
        node.decorator_list = []
    exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)
    return namespace


def _v1_compute_advantage():
    from typing import Any, Optional

    from verl.trainer.config import AlgoConfig

    ns = {"DataProto": DataProto, "core_algos": CORE, "AdvantageEstimator": CORE.AdvantageEstimator,
          "AlgoConfig": AlgoConfig, "Optional": Optional, "Any": Any, "torch": torch, "np": np}
    _verl_functions("trainer/ppo/ray_trainer.py", ["compute_response_mask", "compute_advantage"], ns)
    _verl_functions("trainer/ppo/v1/utils.py", ["compute_advantage_for_multi_trajectories"], ns)
    return ns["compute_advantage_for_multi_trajectories"]


def _grpo_batch(seed: int):
    r = Rollout(seed=seed, rows=8)
    batch = r.proto()
    g = torch.Generator().manual_seed(seed + 100)
    scores = torch.randint(0, 2, (8,), generator=g).float() + torch.rand(8, generator=g)
    last = (r.response_len - 1).clamp_min(0)
    rewards = torch.zeros_like(r.old)
    rewards[torch.arange(8), last] = scores
    batch.batch["token_level_scores"] = rewards.clone()
    batch.batch["token_level_rewards"] = rewards.clone()
    uids = ["a", "a", "a", "b", "b", "b", "c", "c"]
    batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
    keys = [f"{u}_{i}_0" for i, u in enumerate(uids)]  # the V1 TransferQueue key format {uid}_{session}_{index}
    return r, batch, scores, uids, keys


def test_documented_estimator_line_gives_accepted_only_baselines_through_verls_compute_advantage():
    lines = _doc_lines("algorithm.adv_estimator=grpo_accepted")
    config = _compose(lines + SIZES)
    assert config.algorithm.adv_estimator == rc_verl.ADV_ESTIMATOR_NAME
    # verl's own config checks on its default path accept the name (a plain str, no Enum check)
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    assert isinstance(omega_conf_to_dataclass(config.algorithm), AlgoConfig)

    r, batch, scores, uids, keys = _grpo_batch(seed=7)
    batch, _ = _correction_step(batch, config)  # rows 1 and 5 rejected, response_mask zeroed
    accepted = batch.batch["response_mask"].sum(-1) > 0
    assert not accepted[1] and not accepted[5] and int(accepted.sum()) >= 5
    compute = _v1_compute_advantage()
    # the call PPOTrainer._compute_advantage (V1) makes
    out = compute(batch, batch_keys=keys, adv_estimator=config.algorithm.adv_estimator,
                  gamma=config.algorithm.gamma, lam=config.algorithm.lam, num_repeat=config.actor_rollout_ref.rollout.n,
                  norm_adv_by_std_in_grpo=config.algorithm.get("norm_adv_by_std_in_grpo", True),
                  config=config.algorithm)
    expected = _grpo_accepted_by_hand(scores, uids, accepted.tolist())
    mask = batch.batch["response_mask"].double()
    ours = out.batch["advantages"].clone()
    torch.testing.assert_close(ours.double(), expected.unsqueeze(-1) * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.batch["returns"], ours)
    # verl's own GRPO on the same batch keeps the rejected rows in the group baselines (verl #6375)
    verls = compute(out, batch_keys=keys, adv_estimator="grpo", config=config.algorithm).batch["advantages"]
    assert not torch.allclose(verls[0], ours[0], rtol=1e-3)


def test_estimator_reads_norm_adv_by_std_from_verls_algorithm_config():
    config = _compose(_doc_lines("algorithm.adv_estimator=grpo_accepted") + SIZES
                      + ["algorithm.norm_adv_by_std_in_grpo=false"])
    r, batch, scores, uids, keys = _grpo_batch(seed=8)
    batch, _ = _correction_step(batch, config)
    accepted = (batch.batch["response_mask"].sum(-1) > 0).tolist()
    out = _v1_compute_advantage()(batch, batch_keys=keys, adv_estimator=config.algorithm.adv_estimator,
                                  config=config.algorithm)
    expected = _grpo_accepted_by_hand(scores, uids, accepted, norm=False)
    mask = batch.batch["response_mask"].double()
    torch.testing.assert_close(out.batch["advantages"].double(), expected.unsqueeze(-1) * mask, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ 3. every process, defaults untouched


_REGISTRY_PROBE = """
import json, sys
from verl_reference import ray_or_stand_in
ray_or_stand_in()
import verl  # what every verl process does first
from verl.trainer.ppo import core_algos
print(json.dumps({
    "imported": sorted(m for m in sys.modules if m.startswith("rollout_correction")),
    "losses": {k: f"{v.__module__}.{v.__qualname__}" for k, v in core_algos.POLICY_LOSS_REGISTRY.items()},
    "estimators": {k: f"{v.__module__}.{v.__qualname__}" for k, v in core_algos.ADV_ESTIMATOR_REGISTRY.items()},
}))
"""


def _probe(**env) -> dict:
    names = ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")
    environ = {k: v for k, v in os.environ.items() if k not in names}
    environ.update(env, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    done = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], cwd=HERE, env=environ, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_registers_both_names_through_verls_plugin_loading_only():
    loaded = _probe()  # verl's default: every verl.plugins entry point
    none = _probe(VERL_USE_EXTERNAL_PLUGINS="none")
    modules = _probe(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES=rc_verl.__name__)
    ours = {"losses": {rc_verl.LOSS_NAME: f"{rc_verl.__name__}.policy_loss"},
            "estimators": {rc_verl.ADV_ESTIMATOR_NAME: f"{rc_verl.__name__}.grpo_accepted_advantage"}}
    assert none["imported"] == [] and rc_verl.LOSS_NAME not in none["losses"]
    for probe in (loaded, modules):
        assert "rollout_correction.integrations.verl" in probe["imported"]
        for kind in ("losses", "estimators"):
            # exactly two new names; every name verl has maps to the same verl function as without us
            assert probe[kind] == {**none[kind], **ours[kind]}
    assert all(v.startswith("verl.") for v in none["losses"].values())


def test_installing_alone_leaves_verls_default_loss_and_estimator_in_place():
    config = _compose_verl(SIZES)  # verl's own entry point's config, verl's defaults: nothing of ours
    actor = _worker_actor_config(config)
    assert actor.policy_loss.loss_mode == "vanilla" and config.algorithm.adv_estimator == "gae"
    assert CORE.get_policy_loss_fn("vanilla") is CORE.compute_policy_loss_vanilla
    assert CORE.get_adv_estimator_fn("grpo") is CORE.compute_grpo_outcome_advantage
    # verl's worker loss on the default config is verl's vanilla PPO: hand-computed over all valid tokens
    r = Rollout(seed=9)
    results, data = _worker_update(r.proto(), config, actor, r)
    assert data["batch_num_tokens"] == int(r.mask.sum())
    expected = (_ppo_clip(r.log_prob, r.old, r.advantages) * r.mask).sum() / r.mask.sum()
    torch.testing.assert_close(sum(loss for loss, _ in results).double(), expected, rtol=1e-6, atol=1e-7)
    assert not any(k.startswith("rollout_corr/") for _, m in results for k in m)


def test_the_loss_refuses_a_misspelt_key_of_the_actor_block():
    lines = _doc_lines("bypass_mode=true") + ["+algorithm.rollout_correction.rollout_iss=token"]
    with pytest.raises(ValueError, match="rollout_iss"):  # the entry point: on the driver, before any worker
        _compose(lines + SIZES)
    config = _compose_verl(lines + SIZES)  # verl's own entry point: the loss refuses it in the worker
    r = Rollout(seed=10)
    batch = r.proto()
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    with pytest.raises(ValueError, match="rollout_iss"):
        _worker_update(batch, config, _worker_actor_config(config), r)

