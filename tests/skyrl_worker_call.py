"""SkyRL 0.4.0's policy worker computing a training step's loss with the registered loss; run as a child
process by ``tests/test_compat_skyrl.py`` (``python tests/skyrl_worker_call.py OUT``).

A child process because SkyRL's worker constructor configures the process for a Ray actor: it sets
``MASTER_ADDR`` / ``RANK`` / … in the environment, replaces the root logging handlers and loguru's sinks
(``DistributedTorchRayActor.__init__`` → ``configure_ray_worker_logging``).

What runs unmodified from SkyRL's unpacked wheel: ``skyrl.train.config.TrainerConfig.from_dict_config``
(the docs' ``trainer.`` config lines), ``PolicyWorkerBase.__init__`` (resolves
``trainer.algorithm.policy_loss_type`` in ``PolicyLossRegistry``), ``PolicyWorkerBase.forward_backward``
(micro-batching, ``batch_to_experience``, ``_forward_backward_micro``: the ``self.policy_loss_fn(...)``
call, KL term, backward, metric reduction), ``TrainingInputBatch``, ``Experience``, ``MeshRank``,
``apply_loss_reduction_to_advantages_minibatch`` (the trainer's scaling of the advantages).

Stand-ins, each for SkyRL infrastructure the loss computation does not need, and why:

* ``torch.cuda.current_device`` → ``"cpu"``: ``_forward_backward_micro`` moves the micro-batch with
  ``experience.to_device(torch.cuda.current_device())`` (worker.py line 1090), which raises on a
  CPU-only torch. The autocast block after it is ``device_type="cuda"`` and is disabled without CUDA.
* ``self.model``: a tiny causal LM with ``HFModelWrapper``'s call signature and outputs (action
  log-probs of the last ``num_actions`` tokens, per-position entropy). SkyRL's wrapper
  (``workers/model_wrapper.py``) imports ``flash_attn`` at module level.
* ``self.strategy``: ``backward`` is ``loss.backward()`` as in SkyRL's ``FSDPStrategy``; ``all_reduce``
  over a single rank is the identity. SkyRL's strategies need an initialised process group.
* ``self.device_mesh``: its ``dp`` group is only handed to ``strategy.all_reduce``. SkyRL builds it with
  ``init_device_mesh("cuda", ...)`` (``init_worker_process_group``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import skyrl_reference as ref  # noqa: E402

B, PROMPT, RESPONSE, VOCAB, HIDDEN = 4, 3, 5, 11, 8


class TinyCausalLM(nn.Module):
    """Embedding → linear head; called like SkyRL's ``HFModelWrapper``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, sequences, num_actions, attention_mask=None, temperature=1.0, return_output=False,
                compute_entropy=False, entropy_requires_grad=True, pixel_values=None, image_grid_thw=None,
                sample_support=None, loss_mask=None, enable_sample_support_replay=False):
        assert pixel_values is None and image_grid_thw is None and sample_support is None
        logits = self.head(self.embed(sequences)) / temperature
        log_probs = logits.log_softmax(-1)
        # position t predicts token t + 1
        token_log_probs = log_probs[:, :-1].gather(-1, sequences[:, 1:, None]).squeeze(-1)
        with torch.set_grad_enabled(entropy_requires_grad):
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return token_log_probs[:, -num_actions:], {"entropy": entropy}


class SingleRankStrategy:
    def backward(self, loss, model, optimizer, **kwargs):
        loss.backward()

    def all_reduce(self, data, op="mean", group=None):
        return data


class SingleRankMesh:
    def get_group(self, name):
        return None


def main(out: Path) -> None:
    ref.source_root()
    ref._packages(ref.source_root())
    from skyrl.backends.skyrl_train.distributed.dispatch import MeshRank
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.utils.ppo_utils import apply_loss_reduction_to_advantages_minibatch
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from omegaconf import OmegaConf
    from skyrl.train.config import TrainerConfig

    import rollout_correction.compat.skyrl as ours

    exec(sys.argv[2], {})  # the docs' registration lines, in the entry script
    # SkyRL's TrainerConfig from the ``trainer.`` lines. SkyRLTrainConfig's __post_init__ (which imports
    # the inference-server client) copies the sampling temperature, 1.0 by default, into the algorithm.
    lines = [line.split(".", 1)[1] for line in sys.argv[3].split()]
    cfg = TrainerConfig.from_dict_config(OmegaConf.from_dotlist([*lines, "algorithm.temperature=1.0"]))

    worker = PolicyWorkerBase(cfg=cfg, world_size=1, rank=0, local_rank=0, master_addr="127.0.0.1",
                              master_port=29500, sequence_parallel_size=1)
    torch.manual_seed(0)
    worker.model = TinyCausalLM()
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.1)
    worker.scheduler = torch.optim.lr_scheduler.ConstantLR(worker.optimizer, factor=1.0)
    worker.strategy, worker.device_mesh = SingleRankStrategy(), SingleRankMesh()
    worker.mesh_rank = MeshRank(dp=0, sp=0, tp=0, pp=0, world_size=1, dp_size=1, pp_size=1)
    params = {k: v.detach().clone() for k, v in worker.model.named_parameters()}

    gen = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, VOCAB, (B, PROMPT + RESPONSE), generator=gen)
    with torch.no_grad():
        current, _ = worker.model(sequences, RESPONSE)
    rollout = (current + torch.randn(B, RESPONSE, generator=gen) * 0.3).clamp(max=0.0)  # log-probs are ≤ 0
    old = (rollout + torch.randn(B, RESPONSE, generator=gen) * 0.3).clamp(max=0.0)  # log-probs are ≤ 0
    old[0, 1] = rollout[0, 1] + 2.0  # ρ = e² > the outlier threshold 2.5: row 0 is vetoed
    base = (current + torch.randn(B, RESPONSE, generator=gen) * 0.1).clamp(max=0.0)  # log-probs are ≤ 0
    loss_mask = torch.ones(B, RESPONSE)
    loss_mask[1, :2] = 0.0
    loss_mask[3, -1] = 0.0
    raw_advantages = torch.randn(B, 1, generator=gen).expand(B, RESPONSE).clone()
    advantages = apply_loss_reduction_to_advantages_minibatch(
        raw_advantages, loss_mask, cfg.algorithm.loss_reduction, cfg.micro_train_batch_size_per_gpu, RESPONSE)
    batch = TrainingInputBatch({
        "sequences": sequences, "attention_mask": torch.ones_like(sequences), "action_log_probs": old,
        "base_action_log_probs": base, "rollout_logprobs": rollout, "advantages": advantages,
        "loss_mask": loss_mask, "response_mask": torch.ones(B, RESPONSE),
    })
    batch.metadata = {"response_length": RESPONSE}

    torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    output = worker.forward_backward(batch)
    torch.save({
        "resolved_to_ours": worker.policy_loss_fn is ours.policy_loss,
        "algorithm": {k: getattr(cfg.algorithm, k) for k in (
            "policy_loss_type", "loss_reduction", "use_kl_loss", "kl_loss_coef", "kl_estimator_type",
            "use_entropy_loss", "temperature", "eps_clip_low", "eps_clip_high", "clip_ratio_c")},
        "micro_train_batch_size_per_gpu": cfg.micro_train_batch_size_per_gpu,
        "metrics": output.metrics, "params": params,
        "grads": {k: v.grad.detach().clone() for k, v in worker.model.named_parameters()},
        "batch": {"sequences": sequences, "old": old, "rollout": rollout, "base": base,
                  "loss_mask": loss_mask, "raw_advantages": raw_advantages},
    }, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
