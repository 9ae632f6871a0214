"""The OpenRLHF recipe of docs/integrations.md, run through OpenRLHF's own code.

Args come from OpenRLHF's CLI parser (``train_ppo_ray``'s argparse block + ``hierarchize`` and its
validation, with its defaults); the documented command is run by this library's launcher, which
executes OpenRLHF's ``train_ppo_ray`` module as ``__main__`` up to the creation of the policy actor
group (the class it hands Ray is checked); ``trainer/ray/ppo_actor.py`` is loaded from the release,
unedited, the recipe's actor is this library's subclass of its ``PolicyModelActor``
(``init_model_from_pretrained`` then ``append``), and OpenRLHF's real ``ppo_train`` runs: the
replay buffer splits and re-collates experiences, ``iter_grad_accum_global_norm`` counts
``batch_num_tokens`` / ``global_batch_size`` per optimizer step, and ``training_step`` makes the
loss call. What is stood in and why: tests/openrlhf_reference.py (heavy imports the numerics never
touch), plus here a tiny policy in place of the transformer, a CPU stand-in for the DeepSpeed
engine (:class:`CpuStrategy`), the model building inside OpenRLHF's ``init_model_from_pretrained``
(the trainer is built as that method's last statement builds it, with the tiny policy) and
``torch.cuda.current_device`` (no GPU in CI).

The gradient of every optimizer step is compared with a loss written independently here over the
accepted tokens only, on a batch where some tokens and whole sequences are rejected.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import openrlhf_reference as ref
from rollout_correction import compute_rollout_correction
from rollout_correction.integrations.openrlhf import train_ppo_ray as launcher
from rollout_correction.integrations.openrlhf.actor import RolloutCorrectionActorMixin, policy_model_actor
from rollout_correction.integrations.openrlhf import (
    ACTIVE_METRIC,
    PLACEHOLDER_METRIC,
    SUPPORTED_OPENRLHF,
    RolloutCorrectionPolicyLoss,
    check_openrlhf_version,
    config_from_openrlhf,
    config_from_openrlhf_args,
)

torch.set_num_threads(1)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"

# The recipe's actor (docs/integrations.md, OpenRLHF step 2: the launcher's subclass of OpenRLHF's
# PolicyModelActor); with a config of this library, what --rollout_correction.config gives it.
RECIPE = {"config": None}
OPENRLHF = None  # OpenRLHF's own actor and loss


def _recipe(config):
    return {"config": config}

# The recipe's command-line flags (step 3), on a GRPO command line.
CLI = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--algo.advantage.estimator", "group_norm",
       "--rollout.n_samples_per_prompt", "4", "--train.micro_batch_size", "4"]
# Per release: OpenRLHF 0.10.4 – 0.11.1 and OpenRLHF 0.11.2 name the same correction differently.
FLAGS = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "seq-mask-tis",
         "--algo.advantage.is_correction_threshold", "0.5", "5.0"]
FLAGS_0112 = ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "mask",
              "--algo.advantage.is_correction_threshold", "0.5", "5.0"]


def flags(root):
    """The recipe's flags for the release at ``root``."""
    return FLAGS_0112 if ref.gate_options(root) else FLAGS

ROOTS = ref.source_roots()
ROOT_IDS = [ref.release_of(r) if i else "installed" for i, r in enumerate(ROOTS)]

V, P, A, N = 12, 2, 6, 8  # vocabulary, prompt length, action length, samples
LENGTHS = [6, 5, 4, 6, 3, 6, 5, 2]  # valid response tokens per sample


class TinyPolicy(torch.nn.Module):
    """Stands in for ``openrlhf.models.Actor``: log π(y_j | y_{j−1}) from a V×V logit table."""

    def __init__(self, seed=0):
        super().__init__()
        self.W = torch.nn.Parameter(0.7 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed)))
        self.seen: list[list[int]] = []

    def token_log_probs(self, sequences, n_actions):
        logp = torch.log_softmax(self.W[sequences[:, :-1]], -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        return logp[:, -n_actions:]

    def forward(self, sequences, action_mask, return_output=False, **kwargs):
        self.seen.append([int(s) - 1 for s in sequences[:, 0]])  # token 0 of sample i is i + 1
        out = self.token_log_probs(sequences, action_mask.shape[1]) * action_mask.float()
        return (out, SimpleNamespace(aux_loss=None, entropy=None)) if return_output else out


class CpuStrategy:
    """Stands in for OpenRLHF's DeepSpeed strategy: DeepSpeed divides each micro-batch loss by gas
    and steps once per gas micro-batches; here the step records the accumulated gradient."""

    def __init__(self, args, gas):
        self.args, self.accumulated_gradient, self.ring_attn_group = args, gas, None
        self.calls, self.step_grads = 0, []

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model"):
        self.calls += 1
        if self.calls % self.accumulated_gradient == 0:
            self.step_grads.append(model.W.grad.clone())
            model.W.grad = None

    def all_reduce(self, data):  # DeepspeedStrategy.all_reduce(op="mean") over the ranks, as floats
        if not torch.distributed.is_initialized():
            return data
        world = torch.distributed.get_world_size()
        out = {}
        for k, v in data.items():
            t = torch.tensor([float(v)], dtype=torch.float32) / world
            torch.distributed.all_reduce(t)
            out[k] = t.item()
        return out

    def is_rank_0(self):
        return True

    def get_grad_norm(self, model):
        return 0.0


def _batch(seed=0):
    """Sequences, masks, π_old and π_rollout log-probs and advantages for N samples.

    π_rollout differs from π_old by small noise, except: every token of sample 2 (ρ = e³ ≈ 20) and
    sample 5 (ρ = e⁻³) lies far outside the band, and tokens (0, 1), (3, 0), (6, 2) have ρ = e^±1.5.
    """
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, V, (N, P + A), generator=g)
    seq[:, 0] = torch.arange(1, N + 1)
    attn = torch.ones(N, P + A, dtype=torch.long)
    mask = torch.zeros(N, A, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = True
        attn[i, P + n:] = 0
        seq[i, P + n:] = 0
    with torch.no_grad():
        old = ((TinyPolicy().token_log_probs(seq, A) + 0.1 * torch.randn(N, A, generator=g))).clamp(max=0.0) * mask
    rollout = (old + 0.15 * torch.randn(N, A, generator=g)).clamp(max=0.0)  # log-probs are ≤ 0
    rollout[2] -= 3.0
    old[5] -= 3.0  # ρ = e⁻³ with both log-probs ≤ 0
    rollout[0, 1] -= 1.5
    old[3, 0] -= 1.5
    rollout[6, 2] -= 1.5
    rollout, old = rollout * mask, old * mask
    adv = (torch.randn(N, 1, generator=g) * mask).float()
    return seq, attn, mask, old, rollout, adv


def _experiences(ns, batch, per=4):
    seq, attn, mask, old, rollout, adv = batch
    out = []
    for s in range(0, N, per):
        sl = slice(s, s + per)
        out.append(ns.experience.Experience(
            sequences=seq[sl].clone(), attention_mask=attn[sl].clone(), action_mask=mask[sl].clone(),
            action_log_probs=old[sl].clone(), rollout_log_probs=rollout[sl].clone(),
            advantages=adv[sl].expand(-1, A).clone() * mask[sl], returns=adv[sl].expand(-1, A).clone() * mask[sl],
            rewards=adv[sl, 0].clone(), index=list(range(s, s + per)), info={},
        ))
    return out


def _train(root, recipe, args, batch, monkeypatch, gas=1, part=None):
    """OpenRLHF's actor (``recipe`` None) or the recipe's (``recipe``: ``{"config": ...}``): build the
    trainer through ``init_model_from_pretrained``, append the experiences through the actor's
    ``append``, run ``ppo_train``. Returns (trainer, status, per-step gradients, the samples of each
    optimizer step)."""
    with ref.ppo_actor(root) as ns:
        return _train_in(ns, recipe, args, batch, monkeypatch, gas, part)


def _actor_class(ns, policy, optim, sched):
    """OpenRLHF's PolicyModelActor with its model building stood in: ``init_model_from_pretrained``
    builds the trainer as OpenRLHF's method does in its last statement, on the tiny policy (the rest
    of that method loads a transformer with DeepSpeed)."""
    # with Ray installed, @ray.remote made PolicyModelActor an actor handle class; its original
    # class (whose append the test calls) is __ray_actor_class__
    openrlhf_actor = getattr(ns.ppo_actor.PolicyModelActor, "__ray_actor_class__", ns.ppo_actor.PolicyModelActor)
    trainer_cls = ns.ppo_actor.ActorPPOTrainer

    class Built(openrlhf_actor):
        def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
            args = strategy.args
            self.trainer = trainer_cls(strategy, policy, None, optim, sched,
                                       micro_train_batch_size=args.train.micro_batch_size, dataloader_pin_memory=False)

    return Built


def _train_in(ns, recipe, args, batch, monkeypatch, gas, part):
    policy = TinyPolicy()
    optim = torch.optim.SGD(policy.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    strategy = CpuStrategy(args, gas)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the replay buffer names a CUDA device
    openrlhf_actor = _actor_class(ns, policy, optim, sched)
    actor_cls = openrlhf_actor if recipe is None else policy_model_actor(openrlhf_actor, recipe["config"])
    actor = object.__new__(actor_cls)
    actor.init_model_from_pretrained(strategy, "tiny-policy")
    trainer = actor.trainer
    if recipe is not None:
        assert isinstance(trainer.actor_loss_fn, RolloutCorrectionPolicyLoss)
    experiences = _experiences(ns, batch)
    for exp in experiences if part is None else experiences[part:part + 1]:  # part: this DP rank's share
        actor.append(exp)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.manual_seed(0)  # OpenRLHF's DataLoader shuffles: the same micro-batches in every run
    status = trainer.ppo_train(kl_ctl=0.0)
    windows = [sum(policy.seen[i:i + gas], []) for i in range(0, len(policy.seen), gas)]
    return trainer, status, strategy.step_grads, windows


def _expected_grads(batch, windows, keep, weight, clip=0.2, seq_mean=False):
    """∇ of the PPO-clip loss Σ w·ℓ over accepted tokens / (accepted tokens) per optimizer step, or
    with ``seq_mean`` the mean over accepted sequences of each one's mean over its accepted tokens."""
    seq, attn, mask, old, rollout, adv = batch
    grads = []
    for rows in windows:
        policy = TinyPolicy()
        rows = torch.tensor(rows)
        k = keep[rows].float()
        a = adv[rows].expand(-1, A) * weight[rows]
        ratio = torch.exp(policy.token_log_probs(seq[rows], A) - old[rows])
        per_token = -torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        if seq_mean:
            n = k.sum(-1)
            losses = [(per_token[i] * k[i]).sum() / n[i] for i in range(len(rows)) if n[i] > 0]
            loss = sum(losses) / len(losses)
        else:
            loss = (per_token * k).sum() / k.sum()
        loss.backward()
        grads.append(policy.W.grad)
    return grads


def _seq_mask_tis(batch, lo=0.5, hi=5.0):
    """Independently: accepted = valid tokens of rows whose exp(mean log ρ) ∈ [lo, hi]; w = clamp(ρ)."""
    _, _, mask, old, rollout, _ = batch
    log_rho = (old - rollout) * mask
    geo = torch.exp(log_rho.sum(-1) / mask.sum(-1))
    keep = mask & ((geo >= lo) & (geo <= hi)).unsqueeze(-1)
    return keep, torch.exp(log_rho).clamp(lo, hi) * mask


@pytest.fixture(params=range(len(ROOTS)), ids=ROOT_IDS)
def root(request):
    return ROOTS[request.param]


def _documented_command():
    """The module and the arguments of the OpenRLHF section's step-2 command, read from the docs."""
    import re

    text = DOCS.read_text()
    section = text[text.index("## OpenRLHF"):]
    section = section[: section.index("\n## ", 1)]
    start = section.index("**2. Start training through this library's launcher.**")
    block = re.search(r"```bash\n(.*?)```", section[start:], flags=re.S).group(1)
    words = block.replace("\\\n", " ").split()
    assert words[:2] == ["python", "-m"], words[:3]
    return words[2], words[3:]


def test_the_documented_flags_and_install_line():
    text = DOCS.read_text()
    section = text[text.index("## OpenRLHF"):]
    section = section[: section.index("\n## ", 1)]
    for snippet in (" ".join(FLAGS), " ".join(FLAGS_0112), "pip install 'rollout-correction[openrlhf]'", ACTIVE_METRIC,
                    launcher.CONFIG_OPTION):
        assert snippet in section, snippet
    module, argv = _documented_command()
    assert module == launcher.__name__ and "..." in argv and " ".join(FLAGS) in " ".join(argv)


class _ActorGroupCreated(Exception):
    """Raised by the stand-in RayActorGroup: OpenRLHF's train() got as far as creating the actors."""


def _launcher_stand_ins(monkeypatch, seen):
    """What OpenRLHF's train_ppo_ray imports besides ppo_actor, up to the first RayActorGroup (the
    policy actors): no Ray cluster is started, the actor group records its class and stops."""
    import sys
    import types

    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # OpenRLHF's train() then skips ray.init

    def actor_group(num_nodes, num_gpus_per_node, ray_actor_type, **kwargs):
        seen["actor_type"] = ray_actor_type
        raise _ActorGroupCreated

    def get_strategy(args):
        seen["args"] = args
        return SimpleNamespace(print=lambda *a: None)

    launcher_module = sys.modules["openrlhf.trainer.ray.launcher"]
    monkeypatch.setattr(launcher_module, "RayActorGroup", actor_group, raising=False)
    monkeypatch.setattr(launcher_module, "ReferenceModelActor", object, raising=False)
    monkeypatch.setattr(launcher_module, "RewardModelActor", object, raising=False)
    monkeypatch.setattr(sys.modules["openrlhf.trainer.ray"], "create_vllm_engines", None, raising=False)
    monkeypatch.setattr(sys.modules["openrlhf.utils"], "get_strategy", get_strategy, raising=False)
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.ppo_critic",
                        types.ModuleType("openrlhf.trainer.ray.ppo_critic"))
    sys.modules["openrlhf.trainer.ray.ppo_critic"].CriticModelActor = object


def test_the_documented_command_runs_openrlhfs_launcher_with_the_actor_subclass(root):
    """The docs' command, with this release's correction flags and ``...`` filled in: the launcher
    runs OpenRLHF's own ``train_ppo_ray`` module as ``__main__`` (its parser, its validation, its
    ``train``), which hands Ray the subclass of this release's PolicyModelActor; OpenRLHF's name is
    restored afterwards and no file is read other than OpenRLHF's own."""
    module, argv = _documented_command()
    argv = " ".join(argv).replace(" ".join(FLAGS), " ".join(flags(root))).split()
    argv = [x for a in argv for x in (CLI if a == "..." else [a])]
    seen = {}
    with ref.ppo_actor(root) as ns, pytest.MonkeyPatch.context() as mp:
        openrlhf_actor = ns.ppo_actor.PolicyModelActor
        _launcher_stand_ins(mp, seen)
        with pytest.raises(_ActorGroupCreated):
            launcher.main(argv)
        assert ns.ppo_actor.PolicyModelActor is openrlhf_actor  # restored
        plain = getattr(openrlhf_actor, "__ray_actor_class__", openrlhf_actor)
    handed = seen["actor_type"]
    cls = getattr(handed, "__ray_actor_class__", handed)  # a Ray actor class, as OpenRLHF's own
    assert issubclass(cls, RolloutCorrectionActorMixin) and issubclass(cls, plain)
    assert cls.rollout_correction_config is None
    args = seen["args"]  # what OpenRLHF's parser and validation produced
    assert args.train.micro_batch_size == 4 and args.rollout.n_samples_per_prompt == 4
    assert RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=ref.policy_loss_class(root)).config == \
        config_from_openrlhf("seq-mask-tis", [0.5, 5.0])
    # the launcher's own option reaches the subclass, and OpenRLHF never sees it
    seen.clear()
    with ref.ppo_actor(root), pytest.MonkeyPatch.context() as mp:
        _launcher_stand_ins(mp, seen)
        with pytest.raises(_ActorGroupCreated):
            launcher.main([launcher.CONFIG_OPTION, "decoupled_geo_rs_token_tis", launcher.DUMP_OPTION, "dumps", *argv])
    assert seen["actor_type"].__ray_actor_class__.rollout_correction_config == "decoupled_geo_rs_token_tis"
    assert seen["actor_type"].__ray_actor_class__.rollout_correction_dump_dir == "dumps"
    assert cls.rollout_correction_dump_dir is None  # off by default


def test_the_dump_option_writes_one_file_per_step_that_diagnose_reads(tmp_path, monkeypatch):
    """``--rollout_correction.dump_dir``: ``append`` keeps the experiences' log-probs and masks (before the
    rejection), OpenRLHF's ``fit`` (its ``ppo_train``) runs after one write of them; diagnose reads it."""
    from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
    from rollout_correction.diagnose import diagnose_file

    root = ROOTS[0]
    args = ref.parse_cli(CLI + flags(root), root)
    batch = _batch()
    seq, attn, mask, old, rollout, adv = batch
    dump = tmp_path / "dump"
    with ref.ppo_actor(root) as ns:
        policy = TinyPolicy()
        optim = torch.optim.SGD(policy.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        actor = object.__new__(policy_model_actor(_actor_class(ns, policy, optim, sched), None, str(dump)))
        actor.init_model_from_pretrained(CpuStrategy(args, 1), "tiny-policy")
        for exp in _experiences(ns, batch):
            actor.append(exp)
        assert not dump.exists()  # nothing per micro-batch: the write comes with the step
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        for name in ("empty_cache", "synchronize"):  # fit's CUDA housekeeping; no GPU here
            monkeypatch.setattr(torch.cuda, name, lambda: None)
        actor.actor = policy
        torch.manual_seed(0)
        actor.fit(kl_ctl=0.0)
    assert os.listdir(dump) == ["step_000000.pt"]
    diag = diagnose_file(str(dump), presets=[])
    assert diag.profile.counters.tokens == int(mask.sum()) == sum(LENGTHS) and list(diag.profile.version) == [0]
    for name, value in metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask)).items():
        assert diag.profile.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def test_documented_statement_on_args_from_openrlhf_cli(root):
    args = ref.parse_cli(CLI + flags(root), root)
    policy_loss_cls = ref.policy_loss_class(root)
    ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls)
    assert isinstance(ours.policy_loss, policy_loss_cls)
    gate = ref.gate_options(root)
    if gate:  # 0.11.2: the wrapped PolicyLoss has its correction level off
        assert ours.policy_loss.is_correction_level == "off"
    else:
        assert not ours.policy_loss.enable_vllm_is_correction
    # OpenRLHF's defaults: eps_clip 0.2 both sides (filled in by its validation), no dual clip, ppo.
    assert (ours.policy_loss.clip_eps_low, ours.policy_loss.clip_eps_high) == (0.2, 0.2)
    assert ours.policy_loss.dual_clip is None and ours.policy_loss.token_level_loss
    assert ours.config == config_from_openrlhf("seq-mask-tis", [0.5, 5.0]) and ours.filter_level == "seq"
    # The correction switched on with the CLI's defaults otherwise: up to 0.11.1 type tis; in
    # 0.11.2 mode mask (IcePop) and gating ratio; threshold 0.5 5.0.
    args = ref.parse_cli(CLI + ref.enable_flags(root), root)
    assert RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls).config == \
        config_from_openrlhf("icepop" if gate else "tis", [0.5, 5.0])
    # With the correction off OpenRLHF asks vLLM for no log-probs: refused with the flag to add.
    args = ref.parse_cli(CLI, root)
    flag = "--algo.advantage.is_correction_level" if gate else "--algo.advantage.is_correction_enable"
    with pytest.raises(ValueError, match=flag):
        RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls)


@pytest.mark.parametrize("kind", ["tis", "icepop"])
@pytest.mark.parametrize("extra", [[], ["--actor.dual_clip", "3.0"], ["--actor.eps_clip_low_high", "0.2", "0.28"]])
def test_token_types_equal_openrlhf_loss_call(root, kind, extra):
    """tis / icepop reject nothing: the recipe's actor trains exactly as OpenRLHF's own correction."""
    args = ref.parse_cli(CLI + extra + ref.correction_flags(root, kind, ("0.8", "1.25")), root)
    batch = _batch(seed=1)
    grads, status = {}, {}
    for name, recipe in (("openrlhf", OPENRLHF), ("ours", RECIPE)):
        with pytest.MonkeyPatch.context() as mp:
            _, status[name], grads[name], _ = _train(root, recipe, args, batch, mp)
    assert len(grads["ours"]) == 2
    for ours, theirs in zip(grads["ours"], grads["openrlhf"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        assert ours.abs().sum() > 0
    assert status["ours"][ACTIVE_METRIC] == 0.0  # nothing rejected, and the key shows the correction ran
    assert status["ours"]["vllm_kl"] == pytest.approx(status["openrlhf"]["vllm_kl"], rel=1e-5, abs=1e-7)
    if ref.gate_options(root):  # 0.11.2 logs the fifth value: the share of tokens outside the band
        _, _, mask, old, rollout, _ = batch
        rho = torch.exp(old - rollout)[mask]
        share = float(((rho < 0.8) | (rho > 1.25)).float().mean())
        assert 0 < share < 1
        theirs = status["openrlhf"]["is_filter_ratio"]
        assert status["ours"]["is_filter_ratio"] == pytest.approx(theirs, rel=1e-5)
        assert status["ours"]["is_filter_ratio"] == pytest.approx(share, rel=1e-5)


def test_seq_mask_tis_rejected_sequences_leave_batch_num_tokens(root, monkeypatch):
    args = ref.parse_cli(CLI + flags(root), root)
    batch = _batch()
    keep, weight = _seq_mask_tis(batch)
    assert keep.any(-1).tolist() == [i not in (2, 5) for i in range(N)]  # rows 2 and 5 rejected
    trainer, status, grads, windows = _train(root, RECIPE, args, batch, monkeypatch)
    assert len(grads) == 2 and sorted(sum(windows, [])) == list(range(N))
    for got, want in zip(grads, _expected_grads(batch, windows, keep, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # What OpenRLHF logs: the per-sample rejected fraction (2 of 8 samples fully rejected).
    assert status[ACTIVE_METRIC] == pytest.approx(2 / N)
    assert status["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / N)
    # The replay buffer holds the accepted masks, which is what loss_utils counted.
    assert sum(int(item.action_mask.sum()) for item in trainer.replay_buffer.items) == int(keep.sum())
    if ref.gate_options(root):  # 0.11.2's fifth value at seq level: the share of sequences rejected
        assert status["is_filter_ratio"] == pytest.approx(2 / N)


def test_openrlhf_own_seq_mask_tis_counts_rejected_tokens(root, monkeypatch):
    """Contrast: OpenRLHF's own loss divides by all tokens of the step, rejected ones included."""
    args = ref.parse_cli(CLI + flags(root), root)
    batch = _batch()
    keep, _ = _seq_mask_tis(batch)
    _, _, mask, old, rollout, _ = batch
    weight = torch.exp(old - rollout) * mask  # OpenRLHF's seq-mask-tis: the unclamped token ratio
    _, _, grads, windows = _train(root, OPENRLHF, args, batch, monkeypatch)
    for got, want, rows in zip(grads, _expected_grads(batch, windows, keep, weight), windows):
        rows = torch.tensor(rows)
        scale = keep[rows].sum() / mask[rows].sum()
        torch.testing.assert_close(got, want * scale, rtol=1e-5, atol=1e-7)
    assert any(keep[torch.tensor(r)].sum() < mask[torch.tensor(r)].sum() for r in windows)


TOKEN_RS = {"rollout_is": "token", "rollout_is_mode": "clip", "rollout_is_threshold": 2.0,
            "rollout_is_threshold_lower": 0.5, "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}


def test_token_rejection_leaves_token_and_sequence_counts(root, monkeypatch):
    """A config of this library with a token-level rejection (``from_args(self.args, config)``):
    three single tokens and two whole rows are rejected; ppo divides by accepted tokens
    (batch_num_tokens). GSPO (``loss_type: gspo`` with ``--actor.policy_loss_type gspo``, averaged over
    accepted sequences, global_batch_size) is tested in tests/test_integration_openrlhf_methods.py."""
    loss_type = "ppo"
    args = ref.parse_cli(CLI + ["--actor.policy_loss_type", loss_type] + ref.enable_flags(root), root)
    # the launcher's own option, as a user writes it; OpenRLHF gets the rest of the command line
    config, rest = launcher.parse_config_option([launcher.CONFIG_OPTION, json.dumps(TOKEN_RS), *CLI])
    assert rest == CLI and config == TOKEN_RS
    batch = _batch()
    _, _, mask, old, rollout, _ = batch
    rho = torch.exp(old - rollout)
    keep = mask & (rho >= 0.5) & (rho <= 2.0)
    weight = rho.clamp(0.5, 2.0) * mask
    assert sorted(map(tuple, (mask & ~keep).nonzero().tolist())) == sorted(
        [(0, 1), (3, 0), (6, 2)] + [(2, t) for t in range(LENGTHS[2])] + [(5, t) for t in range(LENGTHS[5])])
    _, status, grads, windows = _train(root, _recipe(config), args, batch, monkeypatch)
    for got, want in zip(grads, _expected_grads(batch, windows, keep, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    per_sample = [(LENGTHS[i] - int(keep[i].sum())) / LENGTHS[i] for i in range(N)]
    assert status[ACTIVE_METRIC] == pytest.approx(sum(per_sample) / N)


def _dp_worker(rank, root, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        args = ref.parse_cli(CLI + ["--train.micro_batch_size", "2"] + flags(Path(root)), Path(root))
        with pytest.MonkeyPatch.context() as mp:
            _, _, grads, windows = _train(Path(root), RECIPE, args, _batch(), mp, gas=2, part=rank)
        torch.save({"grads": grads, "windows": windows}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_seq_mask_tis_two_data_parallel_ranks(root, tmp_path):
    """Two gloo ranks, four samples each (rank 0 holds rejected row 2, rank 1 rejected row 5), two
    micro-batches of two per optimizer step: ``loss_utils`` all-reduces the accepted counts, and the
    ranks' mean gradient (what DeepSpeed applies) equals the loss over both ranks' accepted tokens."""
    import torch.multiprocessing as tmp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp.spawn(_dp_worker, args=(str(root), port, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    batch = _batch()
    keep, weight = _seq_mask_tis(batch)
    windows = [w0 + w1 for w0, w1 in zip(ranks[0]["windows"], ranks[1]["windows"])]
    assert len(windows) == 1 and sorted(sum(windows, [])) == list(range(N))
    for k, want in enumerate(_expected_grads(batch, windows, keep, weight)):
        torch.testing.assert_close((ranks[0]["grads"][k] + ranks[1]["grads"][k]) / 2, want, rtol=1e-5, atol=1e-7)


def test_default_micro_batch_of_one_keeps_placeholders(root, monkeypatch):
    """OpenRLHF's default ``--train.micro_batch_size 1``: a fully rejected sequence alone in a
    micro-batch would leave it without tokens (OpenRLHF's ppo_train then divides by zero). Each
    fully rejected row keeps its first token with advantage 0: training runs, the loss over the
    accepted tokens is unchanged, and each such row counts one token instead of its length."""
    args = ref.parse_cli(CLI + flags(root) + ["--train.micro_batch_size", "1"], root)
    assert args.train.micro_batch_size == 1
    batch = _batch()
    keep, weight = _seq_mask_tis(batch)
    keep, weight = keep.clone(), weight.clone()
    for row in (2, 5):
        keep[row, 0], weight[row, 0] = True, 0.0  # the placeholder: counted, zero loss
    trainer, status, grads, windows = _train(root, RECIPE, args, batch, monkeypatch, gas=2)
    assert len(grads) == 4
    for got, want in zip(grads, _expected_grads(batch, windows, keep, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert status[PLACEHOLDER_METRIC] == pytest.approx(2 / N)
    assert status[ACTIVE_METRIC] == pytest.approx(2 / N)  # still reported as fully rejected
    assert sum(int(item.action_mask.sum()) for item in trainer.replay_buffer.items) == int(keep.sum())


def test_unprepared_experience_is_reported(root, caplog):
    """The loss used without ``prepare_experience`` (a trainer of one's own): it still corrects, and
    warns once that the rejected tokens remain in OpenRLHF's denominators."""
    args = ref.parse_cli(CLI + flags(root), root)
    loss = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=ref.policy_loss_class(root))
    seq, attn, mask, old, rollout, adv = _batch()
    lp = old.clone().requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="rollout_correction.integrations.openrlhf"):
        for _ in range(2):
            out = loss(lp, old, adv.expand(-1, A), action_mask=mask, rollout_log_probs=rollout)
    assert len(out) == (5 if ref.gate_options(root) else 4) and torch.isfinite(out[0])
    assert sum("prepare_experience" in r.getMessage() for r in caplog.records) == 1


def test_version_check_names_the_supported_range():
    for good in ("0.10.4", "0.11.0", "0.11.1", "0.11.2"):
        check_openrlhf_version(good)
    import tomllib

    pyproject = tomllib.loads((DOCS.parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["openrlhf"] == [f"openrlhf{SUPPORTED_OPENRLHF}"]
    assert f"`openrlhf{SUPPORTED_OPENRLHF}`" in DOCS.read_text()
    for bad in ("0.10.3", "0.11.3", "0.12.0", "0.9.1"):  # 0.11.3: not tested yet
        with pytest.raises(RuntimeError, match=re.escape("openrlhf>=0.10.4,<0.11.3") + ".*" + re.escape(bad)):
            check_openrlhf_version(bad)


GATE_ROOTS = [r for r in ROOTS if ref.gate_options(r)]
GATE_IDS = [ref.release_of(r) if r != ROOTS[0] else "installed" for r in GATE_ROOTS]


@pytest.fixture(params=range(len(GATE_ROOTS)), ids=GATE_IDS)
def gate_root(request):
    """A release with 0.11.2's ``is_correction_level`` / ``_mode`` / ``_gating`` options."""
    return GATE_ROOTS[request.param]


def _gate_argv(level, mode, gating, threshold):
    return CLI + ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode,
                  "--algo.advantage.is_correction_gating", gating, "--algo.advantage.is_correction_threshold",
                  *threshold]


@pytest.mark.parametrize("threshold", [("0.5", "5.0"), ("2.0",)])
@pytest.mark.parametrize("gating", ["ratio", "binary_kl", "tv"])
@pytest.mark.parametrize("mode", ["mask", "clip"])
@pytest.mark.parametrize("level", ["off", "token", "seq"])
def test_every_gate_combination_of_the_cli_is_mapped_or_refused(gate_root, level, mode, gating, threshold):
    """Every (level, mode, gating) that 0.11.2's parser accepts: mapped as docs/integrations.md's
    table says, or refused with an error naming the option (and, for a threshold OpenRLHF's own
    PolicyLoss accepts, only where this library has no equivalent)."""
    args = ref.parse_cli(_gate_argv(level, mode, gating, threshold), gate_root)
    band = [0.0, 2.0] if len(threshold) == 1 else [0.5, 5.0]  # a single HIGH: LOW = 0 (OpenRLHF's parser)
    assert list(args.algo.advantage.is_correction_threshold) == band
    policy_loss_cls = ref.policy_loss_class(gate_root)
    kind = {("token", "clip", "ratio"): "tis", ("token", "mask", "ratio"): "icepop",
            ("seq", "mask", "ratio"): "seq-mask-tis"}.get((level, mode, gating))
    if kind is not None:
        ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls)
        assert ours.config == config_from_openrlhf(kind, band)
        assert ours.filter_level == level
        return
    if level != "off" and mode == "mask" and gating != "ratio" and band[0] == 0.0:
        ours = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls)
        option = f"{'token' if level == 'token' else 'seq_mean'}_{gating}"
        assert ours.config.rollout_rs == option and ours.config.rollout_rs_threshold == band[1]
        assert ours.config.is_spec.level == "token" and ours.config.is_spec.upper == pytest.approx(math.exp(20))
        return
    # off: no log-probs; clip with a divergence, or seq + clip: not a correction; a divergence
    # with LOW > 0 (OpenRLHF's PolicyLoss refuses it as well).
    name = ("is_correction_level" if level == "off" or gating == "ratio" else
            "is_correction_threshold" if mode == "mask" else "is_correction_gating")
    with pytest.raises(ValueError, match=f"--algo.advantage.{name}"):
        RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls)


def _divergence_batch(seed: int):
    """Sampled-token probabilities spread over (0, 1), a trainer gap of ~0.6 in log space, rows of
    1 to 12 valid tokens."""
    g = torch.Generator().manual_seed(seed)
    B, T = 24, 12
    rollout = torch.rand(B, T, generator=g).clamp_min(1e-3).log()
    old = (rollout + 0.6 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    return old, rollout, mask


def _unit_statistic(old, rollout, mask, gating, level):
    """The gated statistic per unit, computed here in float64: p = π_rollout, q = π_old, clamped."""
    p = rollout.double().exp().clamp(1e-6, 1 - 1e-6)
    q = old.double().exp().clamp(1e-6, 1 - 1e-6)
    d = (p - q).abs() if gating == "tv" else p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
    if level == "token":
        return d[mask > 0]
    return (d * mask).sum(-1) / mask.sum(-1)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
@pytest.mark.parametrize("level", ["token", "seq"])
def test_divergence_gates_drop_the_same_units_as_openrlhf(gate_root, level, gating, seed):
    """OpenRLHF 0.11.2's own PolicyLoss (mask mode) and the mapped config, on a batch whose units fall
    on both sides of HIGH: the same tokens / sequences are dropped. OpenRLHF's drops are read off its
    gradient (a dropped unit's loss coefficient is 0; a kept one's is its ratio ρ_t > 0)."""
    old, rollout, mask = _divergence_batch(seed)
    stat = _unit_statistic(old, rollout, mask, gating, level).sort().values
    k = len(stat) // 2
    high = float((stat[k - 1] + stat[k]) / 2)  # half the units above, half below, none at the bound
    args = ref.parse_cli(_gate_argv(level, "mask", gating, (repr(high),)), gate_root)
    policy_loss_cls = ref.policy_loss_class(gate_root)
    adv = args.algo.advantage
    theirs = policy_loss_cls(is_correction_level=adv.is_correction_level, is_correction_mode=adv.is_correction_mode,
                             is_correction_gating=adv.is_correction_gating,
                             is_correction_threshold=adv.is_correction_threshold)
    log_probs = old.clone().requires_grad_(True)  # π_θ = π_old: PPO ratio 1, inside the clip range
    out = theirs(log_probs, old, torch.ones_like(old), action_mask=mask, rollout_log_probs=rollout)
    out[0].backward()
    their_keep = (log_probs.grad != 0) & (mask > 0)
    config = RolloutCorrectionPolicyLoss.from_args(args, policy_loss_cls=policy_loss_cls).config
    our_keep = compute_rollout_correction(old, rollout, mask, config=config).response_mask > 0
    assert torch.equal(our_keep, their_keep)
    assert their_keep.any() and (~their_keep & (mask > 0)).any()  # both sides of the bound
    if level == "seq":  # whole rows: a sequence is kept or dropped entirely
        assert torch.equal(our_keep.any(-1), our_keep.sum(-1) == mask.sum(-1))
        assert float(out[4]) == pytest.approx(float((~our_keep.any(-1)).float().mean()))
    else:
        assert float(out[4]) == pytest.approx(float((~our_keep & (mask > 0)).sum() / mask.sum()))


def test_upper_bound_only_threshold_trains_as_openrlhf(gate_root, monkeypatch):
    """0.11.2's single HIGH (LOW = 0) on token clip: w = min(ρ, HIGH); the recipe's actor trains
    exactly as OpenRLHF's own correction, and the seq-level band has no lower bound."""
    args = ref.parse_cli(_gate_argv("token", "clip", "ratio", ("1.25",)), gate_root)
    batch = _batch(seed=1)
    grads = {}
    for name, recipe in (("openrlhf", OPENRLHF), ("ours", RECIPE)):
        with pytest.MonkeyPatch.context() as mp:
            _, _, grads[name], _ = _train(gate_root, recipe, args, batch, mp)
    for ours, theirs in zip(grads["ours"], grads["openrlhf"]):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    # seq, mask, HIGH 5: row 2 (geometric mean e³ > 5) is rejected, row 5 (e⁻³) is not.
    args = ref.parse_cli(_gate_argv("seq", "mask", "ratio", ("5.0",)), gate_root)
    keep, weight = _seq_mask_tis(batch := _batch(), lo=0.0, hi=5.0)
    assert keep.any(-1).tolist() == [i != 2 for i in range(N)]
    _, status, grads, windows = _train(gate_root, RECIPE, args, batch, monkeypatch)
    for got, want in zip(grads, _expected_grads(batch, windows, keep, weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert status["is_filter_ratio"] == pytest.approx(1 / N)


def test_seq_mean_token_mean_aggregation_counts_accepted_sequences(gate_root, monkeypatch):
    """0.11.2's ``--actor.loss_agg_mode seq-mean-token-mean``: ``from_args`` builds the PolicyLoss
    with ``token_level_loss=False`` as ppo_actor does; each sequence's token mean over its accepted
    tokens, averaged over accepted sequences (global_batch_size counts them)."""
    args = ref.parse_cli(CLI + ["--actor.loss_agg_mode", "seq-mean-token-mean"] + FLAGS_0112, gate_root)
    assert not RolloutCorrectionPolicyLoss.from_args(
        args, policy_loss_cls=ref.policy_loss_class(gate_root)).policy_loss.token_level_loss
    batch = _batch()
    keep, weight = _seq_mask_tis(batch)
    _, _, grads, windows = _train(gate_root, RECIPE, args, batch, monkeypatch)
    assert len(grads) == 2
    for got, want in zip(grads, _expected_grads(batch, windows, keep, weight, seq_mean=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_metrics_option_reaches_the_actors_correction(root):
    """``--rollout_correction.metrics default,raw``: the launcher removes it before OpenRLHF parses the
    command line and the actor subclass holds it; the loss the actor builds from OpenRLHF's args (its
    mapped correction) then computes those families: each experience's ``rollout_corr/...`` entries
    hold the raw means and no self-normalised χ²; an unknown family fails before Ray starts."""
    module, argv = _documented_command()
    argv = " ".join(argv).replace(" ".join(FLAGS), " ".join(flags(root))).split()
    argv = [x for a in argv for x in (CLI if a == "..." else [a])]
    seen = {}
    with ref.ppo_actor(root), pytest.MonkeyPatch.context() as mp:
        _launcher_stand_ins(mp, seen)
        with pytest.raises(_ActorGroupCreated):
            launcher.main([launcher.METRICS_OPTION, "default,raw", *argv])
    cls = seen["actor_type"].__ray_actor_class__
    assert cls.rollout_correction_metrics == ("default", "raw")
    assert "--rollout_correction.metrics" not in " ".join(map(str, vars(seen["args"]).values()))
    with pytest.raises(ValueError, match="unknown family 'rw'"):
        launcher.parse_metrics_option([launcher.METRICS_OPTION, "default,rw", *CLI])
    args = ref.parse_cli(CLI + flags(root), root)
    with ref.ppo_actor(root) as ns, pytest.MonkeyPatch.context() as mp:
        policy = TinyPolicy()
        optim = torch.optim.SGD(policy.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        actor = object.__new__(policy_model_actor(_actor_class(ns, policy, optim, sched), None, None,
                                                  cls.rollout_correction_metrics))
        actor.init_model_from_pretrained(CpuStrategy(args, 1), "tiny-policy")
        loss_fn = actor.trainer.actor_loss_fn
        assert loss_fn.config == config_from_openrlhf_args(args).replace(metrics=["default", "raw"])
        experience = _experiences(ns, _batch())[0]
        actor.append(experience)
    assert "rollout_corr/rollout_is_raw_mean" in experience.info and "rollout_corr/kl" in experience.info
    assert not any(k.endswith("_sn") for k in experience.info)
