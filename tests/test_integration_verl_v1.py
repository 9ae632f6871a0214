"""verl's default trainer (V1, ``trainer.use_v1: true``) through this library's entry point, run for real.

The command of docs/integrations.md (``python -m rollout_correction.integrations.verl.main_ppo``
with verl's overrides) is read from the docs. Nothing here stands in for verl: a local Ray
instance, the entry point's TaskRunner actor (verl's ``TaskRunnerV1`` subclassed), verl's own
TransferQueue (``transfer_queue``, the storage the V1 trainer reads and writes its batches through),
the subclass of verl's V1 trainer class the entry point builds and its ``_compute_advantage`` — the
V1 correction step, then verl's ``compute_advantage_for_multi_trajectories``. The config is composed
by Hydra from verl 0.9.1's ``ppo_trainer.yaml`` through the entry point's config (and, once, by the
entry point's own ``hydra.main`` in a child process). Without the entry point, verl's own trainer
class runs verl's own step, unchanged.

The trainer object is made with ``object.__new__`` and given only its ``config``: its ``__init__``
builds worker groups, models and data loaders, none of which ``_compute_advantage`` reads. Ray is
started with 16 logical CPUs (Ray does not bind them to cores) because TransferQueue places one
actor per storage unit; the config asks for one storage unit.
"""

from __future__ import annotations

import os

import pytest
import torch

from verl_reference import load_verl_rollout_corr_helper, require_verl

require_verl()
ray = pytest.importorskip("ray", reason="CI installs ray==2.60.0 (see .ci/run)")
tq = pytest.importorskip("transfer_queue", reason="CI installs TransferQueue==0.1.11 (see .ci/run)")

import rollout_correction.compat.verl as compat  # noqa: E402
import rollout_correction.integrations.verl as rc_verl  # noqa: E402
from rollout_correction.advantages import group_advantages  # noqa: E402
from rollout_correction.integrations.verl import main_ppo  # noqa: E402
from rollout_correction.integrations.verl.trainer import RolloutCorrectionTrainerMixin, trainer_class  # noqa: E402

HELPER = load_verl_rollout_corr_helper()
SETTINGS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
            "algorithm.rollout_correction.rollout_rs_threshold=0.01"]
ONE_STORAGE_UNIT = "transfer_queue.backend.SimpleStorage.num_data_storage_units=1"
GROUP = 4  # actor_rollout_ref.rollout.n: GRPO group size


def _compose(overrides):
    """The entry point's config for ``overrides``, as it hands it to verl (``backend`` read and removed)."""
    config = main_ppo.compose([ONE_STORAGE_UNIT, f"actor_rollout_ref.rollout.n={GROUP}", *overrides])
    assert main_ppo.task_runner_class(config) is main_ppo.RolloutCorrectionTaskRunner
    return config


def _compose_verl(overrides):
    """verl's own entry point's config for ``overrides``."""
    import verl
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer/config"),
                               version_base=None):
        return compose(config_name="ppo_trainer",
                       overrides=[ONE_STORAGE_UNIT, f"actor_rollout_ref.rollout.n={GROUP}", *overrides])


@pytest.fixture(scope="module")
def transfer_queue():
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    tq.init(_compose_verl([]).transfer_queue)
    try:
        yield tq
    finally:
        tq.close()
        ray.shutdown()


def _rollout_batch(seed: int, rows: int = 8, length: int = 7):
    """A batch as verl's V1 rollout leaves it in TransferQueue: jagged response tensors, uid per row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    old = -torch.rand(rows, length, generator=gen) * 3.0 - 0.01
    rollout = (old + 0.12 * torch.randn(rows, length, generator=gen)).clamp(max=0.0)  # log-probs are ≤ 0
    score = torch.randint(0, 2, (rows,), generator=gen).float()
    scores = torch.zeros(rows, length).scatter(1, (lengths - 1)[:, None], score[:, None])
    uid = torch.arange(rows) // GROUP
    return lengths, mask, old * mask, rollout * mask, scores, uid


def _put(seed: int, prefix: str):
    from tensordict import TensorDict

    lengths, mask, old, rollout, scores, uid = _rollout_batch(seed)
    rows = len(lengths)
    prompt_lengths = 1 + torch.arange(rows) % 3

    def jagged(x, n=lengths):
        return torch.nested.as_nested_tensor([x[i, : n[i]] for i in range(rows)], layout=torch.jagged)

    # the fields verl's V1 agent loop (agent_loop_tq.py) writes, among them loss_mask = response_mask
    fields = TensorDict({"uid": uid, "response_mask": jagged(mask), "loss_mask": jagged(mask),
                         "prompts": jagged(torch.full((rows, 3), 7), prompt_lengths),
                         "responses": jagged(torch.full_like(mask, 9)), "rm_scores": jagged(scores),
                         "rollout_log_probs": jagged(rollout), "old_log_probs": jagged(old)}, batch_size=[rows])
    # verl's V1 keys are "{uid}_{session}_{output index}": here one session and one output per row
    keys = [f"{prefix}-{int(uid[i])}_{i}_0" for i in range(rows)]
    meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=fields)
    return keys, meta, (mask, old, rollout, scores, uid)


def _v1_correction_step(config, keys, meta, verls_own=False):
    """The V1 trainer runs its correction step (and its estimator) on the batch in TransferQueue: the
    entry point's subclass, or (``verls_own``) verl's own trainer class for the mode."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = (get_trainer_cls if verls_own else trainer_class)(config.trainer.v1.trainer_mode)
    trainer = object.__new__(cls)
    trainer.config = config
    metrics: dict = {}
    _v1_correction_step.meta = trainer._compute_advantage(meta, metrics)  # what verl hands to update_actor
    out = tq.kv_batch_get(keys=keys, partition_id="train",
                          select_fields=["response_mask", "rollout_is_weights", "advantages", "loss_mask"])
    return {k: out[k].to_padded_tensor(0.0) for k in out.keys()}, metrics


def test_the_entry_point_runs_verls_default_v1_trainer_subclassed_and_verls_step_stays_verls():
    config = _compose(SETTINGS)
    assert config.trainer.use_v1 is True and config.trainer.v1.trainer_mode == "sync"
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    cls = trainer_class(config.trainer.v1.trainer_mode)
    assert cls.__mro__[1:3] == (RolloutCorrectionTrainerMixin, PPOTrainerSync)
    assert get_trainer_cls("sync") is PPOTrainerSync  # verl's registry is untouched
    for mode in ("colocate_async", "separate_async"):
        assert issubclass(trainer_class(mode), get_trainer_cls(mode))
    # verl's module-level step is verl's function, in the helper and where trainer_base bound it
    assert trainer_base.compute_rollout_correction_and_add_to_batch is HELPER.compute_rollout_correction_and_add_to_batch
    assert trainer_base.compute_rollout_correction_and_add_to_batch.__module__ == HELPER.__name__


def test_v1_correction_step_runs_this_library_through_the_entry_point(transfer_queue):
    config = _compose(SETTINGS + ["algorithm.adv_estimator=grpo_accepted"])
    keys, meta, (mask, old, rollout, scores, uid) = _put(seed=3, prefix="on")
    got, metrics = _v1_correction_step(config, keys, meta)

    assert metrics[rc_verl.BACKEND_METRIC] == 1.0
    settings = dict(config.algorithm.rollout_correction)
    assert "backend" not in settings
    from verl.protocol import DataProto

    expected, expected_metrics = compat.compute_rollout_correction_and_add_to_batch(
        DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.clone()}),
        settings)
    kept = expected.batch["response_mask"]
    assert 0 < int((kept.sum(1) == 0).sum()) < len(kept), "the batch must have accepted and rejected rows"
    assert torch.equal(got["response_mask"], kept.to(got["response_mask"].dtype))
    # ... and the workers' loss_mask (from which every verl engine counts batch_num_tokens) with it
    assert torch.equal(got["loss_mask"], kept.to(got["loss_mask"].dtype))
    torch.testing.assert_close(got["rollout_is_weights"], expected.batch["rollout_is_weights"] * mask)
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name

    # verl's compute_advantage_for_multi_trajectories looked up grpo_accepted: group statistics over
    # the accepted rows only (computed here independently with the library's group_advantages)
    adv = group_advantages(scores.sum(1), uid, response_mask=kept, epsilon=1e-6).advantages
    torch.testing.assert_close(got["advantages"], adv[:, None] * kept, rtol=1e-5, atol=1e-6)


def test_v1_without_the_entry_point_runs_verls_own_step_unchanged(transfer_queue):
    config = _compose_verl(SETTINGS + ["algorithm.adv_estimator=grpo"])  # verl's default gae needs a critic
    keys, meta, (mask, old, rollout, _, _) = _put(seed=3, prefix="off")
    got, metrics = _v1_correction_step(config, keys, meta, verls_own=True)

    assert rc_verl.BACKEND_METRIC not in metrics
    from verl.protocol import DataProto

    original = HELPER.compute_rollout_correction_and_add_to_batch
    ref, ref_metrics = original(
        DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.clone()}),
        config.algorithm.rollout_correction)
    assert torch.equal(got["response_mask"], ref.batch["response_mask"].to(got["response_mask"].dtype))
    assert not torch.equal(ref.batch["response_mask"], mask.to(ref.batch["response_mask"].dtype))
    # verl's own V1 step leaves the rollout-time loss_mask: its rejected tokens stay in batch_num_tokens
    assert torch.equal(got["loss_mask"], mask)
    torch.testing.assert_close(got["rollout_is_weights"], ref.batch["rollout_is_weights"] * mask)
    assert {k: metrics[k] for k in ref_metrics} == pytest.approx(ref_metrics)


def test_the_dump_option_writes_one_file_per_step_that_diagnose_reads(transfer_queue, tmp_path):
    """``trainer.rollout_correction_dump_dir`` (off by default): the entry point's correction step writes
    the batch it corrects, once per step; ``rollout-correction diagnose DIR`` reads it."""
    from rollout_correction import compute_offpolicy_metrics, metrics_to_floats
    from rollout_correction.diagnose import diagnose_file

    assert _compose(SETTINGS).trainer.rollout_correction_dump_dir is None
    dump = tmp_path / "dump"
    config = _compose(SETTINGS + ["algorithm.adv_estimator=grpo_accepted", f"trainer.rollout_correction_dump_dir={dump}"])
    keys, meta, (mask, old, rollout, _, _) = _put(seed=5, prefix="dump")
    trainer = object.__new__(trainer_class(config.trainer.v1.trainer_mode))
    trainer.config, trainer.global_steps = config, 7
    trainer._compute_advantage(meta, {})
    assert os.listdir(dump) == ["step_000007.pt"]
    diag = diagnose_file(str(dump), presets=[])
    assert diag.profile.counters.tokens == int(mask.sum())  # the mask before the correction's rejection
    assert list(diag.profile.version) == [7]
    for name, value in metrics_to_floats(compute_offpolicy_metrics(old, rollout, mask)).items():
        assert diag.profile.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


def _own_entry_point_code() -> str:
    """The python block of the verl section's "Your own entry point" route."""
    import re

    text = open(DOCS, encoding="utf-8").read()
    section = text[text.index("## verl"):text.index("\n## ", text.index("## verl") + 4)]
    start = section.index("**Your own entry point**")
    return re.search(r"```python\n(.*?)```", section[start:], flags=re.S).group(1)


def test_own_entry_point_lines_hand_verl_the_task_runner_and_reach_v1(transfer_queue, monkeypatch):
    """The docs' python block, executed as written; verl's ``run_ppo`` (which starts Ray actors that
    build models) is recorded instead of run, then the step runs as that runner's trainer runs it."""
    import verl.trainer.main_ppo as verl_main

    handed = {}
    monkeypatch.setattr(verl_main, "run_ppo", lambda config, task_runner_class: handed.update(
        config=config, runner=task_runner_class))
    config = _compose_verl(SETTINGS + ["algorithm.adv_estimator=grpo"])  # the user's own (verl) config
    exec(_own_entry_point_code(), {"config": config})
    assert handed["runner"] is main_ppo.RolloutCorrectionTaskRunner and handed["config"] is config
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == rc_verl.LOSS_NAME  # wire_trainer_config
    assert config.algorithm.adv_estimator == rc_verl.ADV_ESTIMATOR_NAME
    keys, meta, (mask, old, rollout, _, _) = _put(seed=3, prefix="wire")
    got, metrics = _v1_correction_step(config, keys, meta)
    assert metrics[rc_verl.BACKEND_METRIC] == 1.0
    assert torch.equal(got["loss_mask"], got["response_mask"]) and not torch.equal(got["loss_mask"], mask)


def _inside_the_task_runner(runner):
    """Runs in the entry point's TaskRunner actor process: what that process sees."""
    import sys

    from verl.trainer.main_ppo import TaskRunnerV1

    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from rollout_correction.integrations.verl.trainer import RolloutCorrectionTrainerMixin, trainer_class
    from verl.trainer.ppo import core_algos

    bound = trainer_base.compute_rollout_correction_and_add_to_batch
    cls = trainer_class("sync")  # what the runner's run() builds for trainer.v1.trainer_mode=sync
    return {"process": os.getpid(), "runner": type(runner).__name__,
            "is_verls_task_runner": isinstance(runner, TaskRunnerV1.__ray_actor_class__),
            "plugin_loaded": "rollout_correction.integrations.verl" in sys.modules,
            "bound": f"{bound.__module__}.{bound.__name__}",
            "trainer": [c.__name__ for c in cls.__mro__[:3]],
            "trainer_is_ours": issubclass(cls, RolloutCorrectionTrainerMixin),
            "policy_loss": "rollout_correction" in core_algos.POLICY_LOSS_REGISTRY,
            "estimator": "grpo_accepted" in core_algos.ADV_ESTIMATOR_REGISTRY}


def test_inside_the_entry_points_task_runner_actor(transfer_queue):
    """verl's run_ppo creates the class the entry point hands it as a Ray actor: a fresh process,
    where the trainer is the subclass and verl's own step stays verl's."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probe travels by value
    runner = main_ppo.task_runner_class(main_ppo.compose(SETTINGS)).remote()
    try:
        # A fresh actor imports verl and torch: minutes on a loaded 2-core machine.
        seen = ray.get(runner.__ray_call__.remote(_inside_the_task_runner), timeout=600)
    finally:
        ray.kill(runner)
    assert seen["process"] != os.getpid() and seen["runner"] == "RolloutCorrectionTaskRunnerV1"
    assert seen["is_verls_task_runner"] and seen["plugin_loaded"]
    assert seen["bound"] == "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_add_to_batch"
    assert seen["trainer"] == ["RolloutCorrectionPPOTrainerSync", "RolloutCorrectionTrainerMixin", "PPOTrainerSync"]
    assert seen["trainer_is_ours"] and seen["policy_loss"] and seen["estimator"]


# ----------------------------------------------------------------------------- the docs' headline lines, end to end

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "integrations.md")
# test-only sizes every verl run sets (verl's validate_config refuses the YAML's nulls); not part of the recipe
SIZES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


def headline_command() -> tuple[str, list[str]]:
    """The module and the override lines of the verl section's headline ```bash block (this
    library's correction step), read from the docs."""
    import re

    text = open(DOCS, encoding="utf-8").read()
    section = text[text.index("## verl"):text.index("\n## ", text.index("## verl") + 4)]
    start = section.index("**This library's correction step")
    block = re.search(r"```bash\n(.*?)```", section[start:], flags=re.S).group(1)
    words = block.replace("\\\n", " ").split()
    assert words[:2] == ["python", "-m"], words[:3]
    return words[2], [raw.strip("'\"") for raw in words[3:] if "=" in raw and not raw.startswith("--")]


def headline_lines() -> list[str]:
    return headline_command()[1]


def test_the_documented_command_is_the_entry_points_own_hydra_main():
    """The docs' command, run as written in a child process up to Hydra's composition (``--cfg job``
    prints the composed config and exits before the entry point's main body), and the module's
    ``main`` is a Hydra entry point over the same config as :func:`main_ppo.compose`."""
    import subprocess
    import sys

    import yaml

    module, lines = headline_command()
    assert module == main_ppo.__name__
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", module, *lines, *SIZES, "--cfg", "job"], cwd=here, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = yaml.safe_load(done.stdout)
    block = printed["algorithm"]["rollout_correction"]
    assert block["backend"] == rc_verl.BACKEND_NAME and block["rollout_rs"] == "seq_mean_k3"
    assert printed["algorithm"]["adv_estimator"] == rc_verl.ADV_ESTIMATOR_NAME
    assert printed["trainer"]["use_v1"] is True
    expected = main_ppo.compose([*lines, *SIZES])
    assert block == dict(expected.algorithm.rollout_correction)


def _worker_data(meta):
    """What verl's tqbridge hands the actor worker's update_actor for this KVBatchMeta (all its fields)."""
    from verl.utils import transferqueue_utils as tqu

    tqu.TQ_INITIALIZED = True  # this process's TransferQueue client is already up (the fixture)
    return tqu._meta_to_realdata(tqu.kv_batch_meta2batch_meta(meta))


def test_docs_headline_lines_on_verls_default_trainer(transfer_queue, monkeypatch, caplog):
    """The docs' headline block, Hydra-composed on verl's default (V1) trainer: three V1 correction
    steps through TransferQueue, then the actor worker's data as verl's tqbridge fetches it, the
    engine's batch_num_tokens line and verl's ppo_loss with the loss the config names. The loss equals
    one written here over accepted tokens only, divided by the number of accepted tokens; the log says
    once per route that this library runs; every step and the loss carry the backend metric."""
    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.py_functional import rename_dict
    from verl.workers.utils.losses import ppo_loss

    from test_integration_verl_worker import ENGINE_UTILS, _aggregate, _k3_seq_mean, _ppo_clip

    lines = headline_lines()
    assert "algorithm.adv_estimator=grpo_accepted" in lines and not any("backend" in x for x in lines)
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=rollout_correction" in lines
    assert not any("use_v1" in x for x in lines)  # verl's default trainer
    config = _compose(lines + SIZES)
    OmegaConf.resolve(config)  # verl's TaskRunner does this before building the trainer
    assert config.trainer.use_v1 is True
    block = config.algorithm.rollout_correction
    monkeypatch.setattr(rc_verl, "_said", set())
    with caplog.at_level("WARNING", logger=rc_verl.__name__):
        for step, seed in enumerate((3, 4, 5)):
            keys, meta, (mask, old, rollout, scores, uid) = _put(seed=seed, prefix=f"docs{step}")
            got, metrics = _v1_correction_step(config, keys, meta)
            assert metrics[rc_verl.BACKEND_METRIC] == 1.0
            if step == 0:
                first = (_v1_correction_step.meta, mask, old, rollout, got)
        meta, mask, old, rollout, got = first

        # the actor worker: its config object, its data from TransferQueue, the engine's token count
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        data = _worker_data(meta)
        assert torch.equal(data["old_log_probs"].to_padded_tensor(0.0), old)  # rows in key order
        tu.assign_non_tensor(data, global_batch_size=len(data), mini_batch_size=len(data), use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=actor.ppo_micro_batch_size_per_gpu)
        batch_num_tokens = data["loss_mask"].sum()  # FSDPEngine.forward_backward_batch (one data-parallel rank)
        tu.assign_non_tensor(data, sp_size=1, batch_num_tokens=batch_num_tokens.item(), dp_size=1)
        micro_batches, _ = ENGINE_UTILS.prepare_micro_batches(data=data, dp_group=None, same_micro_num_in_dp=True)

        gen = torch.Generator().manual_seed(0)
        log_prob = ((old + 0.1 * torch.randn(old.shape, generator=gen)) * mask).clamp(max=0.0).requires_grad_(True)  # π_θ
        results, start = [], 0
        for micro in micro_batches:
            rows = range(start, start + len(micro))
            start += len(micro)
            full = []  # π_θ as the engine's model output: nested over [prompt; response], shifted by one
            for i in rows:
                p, r = int(micro["prompts"].offsets().diff()[i - rows.start]), int(mask[i].sum())
                full.append(torch.cat([torch.zeros(p - 1), log_prob[i, :r], torch.zeros(1)]))
            offsets = torch.tensor([0] + [len(v) for v in full]).cumsum(0)
            model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(full), offsets)}
            results.append(ppo_loss(actor, model_output, micro))
        assert start == len(data)

    # independently: seq_mean_k3 rejection, token TIS weights, PPO clip; over accepted tokens only
    accepted = (_k3_seq_mean(old - rollout, mask) <= float(block.rollout_rs_threshold)) & (mask.sum(-1) > 0)
    keep = mask.bool() & accepted[:, None]
    assert 0 < int(accepted.sum()) < len(accepted)
    assert int(batch_num_tokens) == int(keep.sum()) < int(mask.sum())  # verl alone would count int(mask.sum())
    weights = (old - rollout).double().exp().clamp(max=float(block.rollout_is_threshold))
    per_token = _ppo_clip(log_prob, old, got["advantages"], actor.clip_ratio_low, actor.clip_ratio_high,
                          actor.clip_ratio_c) * weights
    expected = (per_token * keep).sum() / keep.sum()
    total = sum(loss for loss, _ in results)
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-7)
    (grad,) = torch.autograd.grad(total, log_prob)
    (grad_hand,) = torch.autograd.grad(expected, log_prob)
    torch.testing.assert_close(grad, grad_hand.float(), rtol=1e-5, atol=1e-7)
    assert torch.all(grad[~keep] == 0)

    # the keys a dashboard gets: the step's metric, and the loss's as verl's worker logs it ("actor/" prefix)
    logged = rename_dict({k: _aggregate(results, k) for k in results[0][1]}, "actor/")
    assert logged["actor/" + rc_verl.BACKEND_METRIC] == 1.0
    said = [r.getMessage() for r in caplog.records if "runs this library" in r.getMessage()]
    assert len(said) == 2, said  # once for the correction step, once for the loss, over three steps
    assert "rollout-correction step" in said[0] and "policy loss" in said[1]
