"""The trainer: supervised warm start, then GRPO with the rollout engine in the loop.

One GRPO step, top to bottom (``grpo_step``):

1. the engine loads the trainer's weights (its precision, quantisation and lag apply);
2. it samples G responses for each of P prompts and returns π_rollout log-probs;
3. rewards are scored exactly;
4. the trainer recomputes log π_θ in fp32 (π_old is its detached value before the update);
   engine and trainer read each prompt once for its G responses (prefix sharing);
5. for methods that reject, ``compute_rollout_correction`` on the whole batch gives the rows
   rejection sampling keeps; group advantages Âᵢ = (rᵢ − mean_g r) / (std_g r + 1e-6) come from
   the library's ``group_advantages`` with baselines over those accepted rows only;
6. ``compute_policy_loss`` builds the loss for the method's preset (IS weights, RS mask, bypass
   PPO-clip or REINFORCE) and returns the correction's metrics;
7. backward, gradient-norm clipping, Adam step.

With a mixture-of-experts model (``--model moe``) the engine also records the experts its routers
picked while sampling (``rollout_correction.moe.record_routing``); the trainer's forwards record
theirs, the step logs their routing agreement, and methods with ``replay`` (R3) run the trainer's
forwards under ``replay_routing`` with the engine's record.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from rollout_correction import METRIC_PREFIX, compute_rollout_correction, metrics_to_floats
from rollout_correction.advantages import group_advantages as library_group_advantages
from rollout_correction.demo.config import METHODS, DemoConfig, Method
from rollout_correction.demo.model import MOE_SIZES, build_model, response_log_probs
from rollout_correction.demo.task import Task
from rollout_correction.demo.engine import RolloutEngine, sample
from rollout_correction.moe import record_routing, replay_routing, routing_agreement, routing_mask_from_response
from rollout_correction_core import Aggregation, ClipRange, PolicyLoss

EVAL_SEED = 1_000_003  # every run is evaluated on the same prompts

# Diagnostics recorded every step, from the library's metric names.
DIAGNOSTICS = {
    "kl": METRIC_PREFIX + "kl",
    "k3_kl": METRIC_PREFIX + "k3_kl",
    "chi2_token": METRIC_PREFIX + "chi2_token",
    "chi2_seq": METRIC_PREFIX + "chi2_seq",
    "ess": METRIC_PREFIX + "rollout_is_eff_sample_size",
    "rejected": METRIC_PREFIX + "rollout_rs_masked_fraction",
    "clipfrac": "actor/pg_clipfrac",
}


def setup_torch(threads: int) -> None:
    """CPU settings for every process: a fixed thread count and flush-to-zero.

    Fake-quantised weights produce denormal activations; without flush-to-zero the CPU kernels
    run 10–30× slower on them.
    """
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


def group_advantages(rewards: torch.Tensor, group_size: int,
                     response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO advantages Âᵢ = (rᵢ − mean_g r) / (std_g r + 1e-6) for consecutive groups of
    ``group_size`` (population std), from the library's :func:`rollout_correction.advantages.group_advantages`:
    with ``response_mask`` (after rejection sampling) the baselines use accepted rows only and
    rejected rows get 0."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be (P·G,) with G={group_size}, got {tuple(rewards.shape)}")
    return library_group_advantages(rewards.float(), group_size, response_mask=response_mask,
                                    unbiased_std=False, epsilon=1e-6).advantages


def accepted_mask(rc_cfg, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor | None:
    """The response mask after the correction's rejection (RS options, veto, M2PO, non-finite
    rows) on the whole batch, or None for uncorrected methods (then every row enters its group's
    baseline)."""
    if rc_cfg is None:
        return None
    return compute_rollout_correction(old_log_prob, rollout_log_prob, mask, config=rc_cfg).response_mask


@torch.no_grad()
def exact_match(model: torch.nn.Module, task: Task, digits: torch.Tensor, batch: int = 512,
                by_length: bool = False) -> float | list[float]:
    """Greedy exact-match accuracy of ``model``'s answers on the given digit strings; with
    ``by_length``, the list over L = 1 … T (T = ``task.answer_len``) of the share whose first L answer
    tokens are right (its last entry is the exact match)."""
    was_training = model.training
    model.eval()
    hits = torch.zeros(task.answer_len, dtype=torch.float64)
    for i in range(0, digits.shape[0], batch):
        d = digits[i:i + batch]
        # the answer is the start of the response: its greedy tokens need no continuation
        responses, _ = sample(model, task.prompts(d), task.answer_len, greedy=True)
        right = (responses == task.answers(d)).long().cumprod(dim=1)   # (b, T): first L tokens right
        hits += right.sum(dim=0).double()
    model.train(was_training)
    shares = (hits / digits.shape[0]).tolist()
    return shares if by_length else shares[-1]


def sft(cfg: DemoConfig, seed: int, task: Task) -> tuple[dict[str, torch.Tensor], float]:
    """Supervised warm start: cross-entropy on correct responses for ``cfg.sft_steps`` steps (with a
    continuation, ``task.tail``: the answer's mean and the continuation's mean weigh the same, so the
    six answer tokens are not drowned by hundreds of others).

    Returns the state dict and the greedy exact match on the evaluation prompts.
    """
    model = build_model(cfg.model, max_len=task.seq_len + 1, seed=seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    for _ in range(cfg.sft_steps):
        d = task.sample_digits(cfg.sft_batch, gen)
        tokens = torch.cat([task.prompts(d), task.demonstrations(d, gen)], dim=1)
        log_prob = response_log_probs(model, tokens, task.prompt_len)
        n = task.answer_len
        loss = -(log_prob[:, :n].mean() + log_prob[:, n:].mean()) if task.tail else -log_prob.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    eval_digits = task.sample_digits(cfg.eval_prompts, torch.Generator().manual_seed(EVAL_SEED))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, exact_match(model, task, eval_digits)


# ---------------------------------------------------------------------------------------------
# The correction call. Every corrected method names a library preset.


def correction_config(method: Method):
    """The library config for ``method``: its preset, with its ``options`` keys set on top (``None``:
    plain PPO)."""
    from rollout_correction import RolloutCorrectionConfig

    if not method.preset:
        return None
    cfg = RolloutCorrectionConfig.from_preset(method.preset)
    return cfg.replace(**dict(method.options)) if method.options else cfg


def policy_loss(method: Method, rc_cfg, log_prob, old_log_prob, rollout_log_prob, advantages, mask,
                clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss and gap metrics for one (mini-)batch, via the library.

    Uncorrected methods (on-policy, naive) call ``compute_policy_loss`` without rollout
    log-probs — the PPO ratio is π_θ/π_old and π_rollout never enters the gradient — and measure
    the gap with ``compute_offpolicy_metrics`` for the plots only. Corrected methods pass
    ``rollout_log_prob`` and the preset decides: decoupled IS weights / RS mask, bypass PPO-clip,
    or bypass REINFORCE; the loss then also returns the correction's metrics.
    """
    from rollout_correction import compute_offpolicy_metrics, compute_policy_loss, metrics_to_floats

    loss, metrics = compute_policy_loss(
        log_prob, old_log_prob, advantages, mask, config=rc_cfg,
        rollout_log_prob=rollout_log_prob if method.preset else None,
        loss=PolicyLoss(clip=ClipRange(low=clip_eps, high=clip_eps), aggregation=Aggregation("token-mean")))
    if not method.preset:
        metrics = {**metrics, **compute_offpolicy_metrics(old_log_prob, rollout_log_prob, mask)}
    return loss, metrics_to_floats(metrics)


# ---------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    method: str
    seed: int
    history: dict[str, list[float]] = field(default_factory=dict)   # per GRPO step
    evals: dict[str, list[float]] = field(default_factory=dict)     # per evaluation
    seconds: float = 0.0       # wall clock
    cpu_seconds: float = 0.0   # CPU time of this process (the machine may be shared)

    def to_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "history": self.history, "evals": self.evals,
                "seconds": self.seconds, "cpu_seconds": self.cpu_seconds}


def train(cfg: DemoConfig, method_name: str, seed: int, sft_state: dict[str, torch.Tensor],
          progress=None) -> RunResult:
    """GRPO from the SFT weights with ``method_name``; ``progress(n)`` is called once per step."""
    t0, c0 = time.perf_counter(), time.process_time()
    method = METHODS[method_name]
    task = cfg.make_task()
    torch.manual_seed(seed)
    model = build_model(cfg.model, max_len=task.seq_len + 1)
    model.load_state_dict(sft_state)
    if method.mismatched:
        engine = RolloutEngine(model, cfg.precision, cfg.quant, cfg.lag, cfg.granularity)
    else:
        engine = RolloutEngine(model, "fp32", "none", 0)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)  # one kernel for all parameters
    rc_cfg = correction_config(method)
    # Paired runs: every method of one seed starts from the same SFT weights and sees the same
    # prompts (their own generator, untouched by sampling); only the responses differ.
    prompt_gen = torch.Generator().manual_seed(20_000 + seed)
    gen = torch.Generator().manual_seed(30_000 + seed)
    eval_digits = task.sample_digits(cfg.eval_prompts, torch.Generator().manual_seed(EVAL_SEED))
    result = RunResult(method_name, seed)
    hist, evals = result.history, result.evals

    def log(store, key, value):
        store.setdefault(key, []).append(float(value))

    for step in range(cfg.steps + 1):
        engine.sync(model)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            log(evals, "step", step)
            if step == cfg.steps:  # the final result against response length (prefix exact match)
                shares = exact_match(model, task, eval_digits, by_length=True)
                evals["lengths"] = length_grid(task.answer_len)
                evals["trainer_by_length"] = [shares[L - 1] for L in evals["lengths"]]
                log(evals, "trainer", shares[-1])
            else:
                log(evals, "trainer", exact_match(model, task, eval_digits))
            log(evals, "engine", exact_match(engine.model, task, eval_digits))
        if step == cfg.steps:
            break
        stats = grpo_step(cfg, method, rc_cfg, task, model, engine, opt, gen, prompt_gen)
        for k, v in stats.items():
            log(hist, k, v)
        if progress is not None:
            progress(1)
    result.seconds = time.perf_counter() - t0
    result.cpu_seconds = time.process_time() - c0
    return result


def grpo_step(cfg: DemoConfig, method: Method, rc_cfg, task: Task, model, engine: RolloutEngine, opt,
              gen: torch.Generator, prompt_gen: torch.Generator | None = None) -> dict[str, float]:
    """One GRPO update (engine already synced); returns the step's statistics. Prompts come from
    ``prompt_gen`` (default ``gen``), samples from ``gen``."""
    digits = task.sample_digits(cfg.prompts, prompt_gen if prompt_gen is not None else gen).repeat_interleave(cfg.samples, dim=0)
    prompts = task.prompts(digits)
    routing = Routing(cfg, method, model, task.prompt_len)
    with routing.engine(engine):
        responses, rollout_log_prob = engine.generate(prompts, task.response_len, generator=gen,
                                                      group_size=cfg.samples)
    return update_policy(cfg, method, rc_cfg, task, model, opt, digits, responses, rollout_log_prob,
                         routing=routing)


def update_policy(cfg: DemoConfig, method: Method, rc_cfg, task: Task, model, opt, digits: torch.Tensor,
                  responses: torch.Tensor, rollout_log_prob: torch.Tensor, loss_fn=None,
                  routing: "Routing | None" = None) -> dict[str, float]:
    """Steps 3–7 of a GRPO step on a sampled batch: rewards, log π_θ, advantages, loss, Adam.

    ``loss_fn(log_prob, old_log_prob, rollout_log_prob, advantages, mask, rows)`` replaces
    :func:`policy_loss` when given (``rows``: the mini-batch's slice of the batch). ``routing``
    carries the engine's expert record of this batch (MoE models; none for dense ones).
    """
    if routing is None:
        routing = Routing(cfg, method, model, task.prompt_len)
    prompts = task.prompts(digits)
    rewards = task.reward(responses, digits)
    tokens = torch.cat([prompts, responses], dim=1)
    mask = torch.ones_like(rollout_log_prob)

    n = tokens.shape[0]
    mb = n // cfg.minibatches
    # Rows come in groups of ``samples`` sharing a prompt: the forwards read each prompt once.
    mb_group = cfg.samples if mb % cfg.samples == 0 else 1
    if cfg.minibatches > 1:
        with torch.no_grad(), routing.trainer(slice(None), measure=True):
            old_all = response_log_probs(model, tokens, task.prompt_len, cfg.samples)
    else:  # one update per batch: π_old is π_θ before the step, its detached value
        with routing.trainer(slice(None), measure=True):
            log_prob_all = response_log_probs(model, tokens, task.prompt_len, cfg.samples)
        old_all = log_prob_all.detach()
    kept = accepted_mask(rc_cfg, old_all, rollout_log_prob, mask)
    advantages = group_advantages(rewards, cfg.samples, kept).unsqueeze(1).expand_as(rollout_log_prob)
    metrics: dict[str, list[float]] = {}
    grad_norms = []
    for i in range(0, n, mb):
        sl = slice(i, i + mb)
        if cfg.minibatches > 1:
            with routing.trainer(sl):
                log_prob = response_log_probs(model, tokens[sl], task.prompt_len, mb_group)
        else:
            log_prob = log_prob_all
        old_log_prob = old_all[sl]
        if loss_fn is None:
            loss, m = policy_loss(method, rc_cfg, log_prob, old_log_prob, rollout_log_prob[sl], advantages[sl],
                                  mask[sl], cfg.clip_eps)
        else:
            loss, m = loss_fn(log_prob, old_log_prob, rollout_log_prob[sl], advantages[sl], mask[sl], sl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        grad_norms.append(float(gn))
        for key, name in DIAGNOSTICS.items():
            if name in m:
                metrics.setdefault(key, []).append(m[name])
        for name, value in m.items():  # every rollout_corr/* metric, for the health monitor
            if name.startswith(METRIC_PREFIX):
                metrics.setdefault(name, []).append(value)
    stats = {k: sum(v) / len(v) for k, v in metrics.items()}
    stats.update(routing.agreement(mask))
    if routing.moe:
        stats.update(other_corrections(old_all, rollout_log_prob, mask))
    stats.update(weight_ess_by_length(old_all, rollout_log_prob))
    stats["reward"] = rewards.mean().item()
    stats["grad_norm"] = sum(grad_norms) / len(grad_norms)
    stats["loss"] = float(loss.detach())
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in stats.items()}


def ess_fraction(log_w: torch.Tensor) -> torch.Tensor:
    """ESS / N = (Σᵢ wᵢ)² / (N Σᵢ wᵢ²) of the weights wᵢ = exp(log_w[i]) along dim 0, from the log
    weights (exp(2·lse(log w) − lse(2·log w) − log N): no overflow however long the product)."""
    n = log_w.shape[0]
    return torch.exp(2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0) - math.log(n))


def length_grid(T: int) -> list[int]:
    """The response lengths L at which the by-length figures are kept: every L up to 16, then every
    T // 32-th and T itself (at most about 50 lengths however long the answer)."""
    every = max(1, T // 32)
    return sorted({*range(1, min(T, 16) + 1), *range(every, T + 1, every), T})


def weight_ess_by_length(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> dict[str, float]:
    """The untruncated sequence weights of the batch's first L response tokens, for every L of
    :func:`length_grid`: ``ess_seq@L`` is the ESS / N of ∏_{t≤L} ρₜ, ``ess_geo@L`` of the geometric
    mean exp(mean_{t≤L} log ρₜ), ρₜ = π_old/π_rollout. They show how the sequence weight degenerates
    with length while the geometric one does not."""
    log_rho = (old_log_prob - rollout_log_prob).detach().double()
    prefix = log_rho.cumsum(dim=1)                                 # (B, T): log ∏_{t≤L} ρₜ
    lengths = torch.arange(1, log_rho.shape[1] + 1, dtype=prefix.dtype)
    seq, geo = ess_fraction(prefix), ess_fraction(prefix / lengths)
    grid = length_grid(log_rho.shape[1])
    out = {f"ess_seq@{L}": float(seq[L - 1]) for L in grid}
    out.update({f"ess_geo@{L}": float(geo[L - 1]) for L in grid})
    return out


# ---------------------------------------------------------------------------------------------
# Mixture of experts: record the engine's routing, replay it in the trainer (R3), measure agreement.


class Routing:
    """The routing side of one GRPO step. For a dense model every context is a no-op.

    ``engine(engine)`` records the experts of the engine's KV-cache sampling (positions
    0 … P + T − 2, the tokens it fed); ``trainer(rows, measure)`` wraps a trainer forward over
    those rows: it replays the engine's record for R3 methods, and with ``measure`` records the
    trainer routers' own choice (under replay: what they would pick given the replayed layers
    below). ``agreement(mask)`` gives the step's ``rollout_corr/routing_*`` metrics over the
    positions that produced response tokens, plus ``routing_match`` / ``routing_token_differs``.
    """

    def __init__(self, cfg: DemoConfig, method: Method, model, prompt_len: int):
        self.moe = cfg.model in MOE_SIZES
        self.replay = method.replay
        self.model, self.prompt_len = model, prompt_len
        self.engine_record = self.trainer_record = None

    @contextlib.contextmanager
    def engine(self, engine: RolloutEngine):
        if not self.moe:
            yield
            return
        with record_routing(engine.model) as rec:
            yield
        self.engine_record = rec.record

    @contextlib.contextmanager
    def trainer(self, rows: slice, measure: bool = False):
        with contextlib.ExitStack() as stack:
            own = stack.enter_context(record_routing(self.model)) if self.moe and measure else None
            if self.moe and self.replay:
                stack.enter_context(replay_routing(self.model, self.engine_record[rows]))
            yield
        if own is not None:
            self.trainer_record = own.record

    def agreement(self, response_mask: torch.Tensor) -> dict[str, float]:
        if self.engine_record is None or self.trainer_record is None:
            return {}
        where = routing_mask_from_response(response_mask, self.prompt_len, self.engine_record.positions)
        m = metrics_to_floats(routing_agreement(self.engine_record, self.trainer_record, where))
        return {**m, "routing_match": m[METRIC_PREFIX + "routing_match"],
                "routing_token_differs": m[METRIC_PREFIX + "routing_token_differs"]}


# What the other corrections would do with this step's gap (π_old from the trainer's forward —
# replayed for R3 methods — against π_rollout): their IS-weight spread and rejection rates, so that
# R3's effect on them is read off the runs with and without replay. Diagnostics only.
OTHER_CORRECTIONS = {  # history key -> (preset, metric)
    "other_token_is_clipped": ("decoupled_token_is", "rollout_is_ratio_fraction_high"),
    "other_token_is_std": ("decoupled_token_is", "rollout_is_std"),
    "other_token_is_ess": ("decoupled_token_is", "rollout_is_eff_sample_size"),
    "other_seq_is_rs_rejected": ("decoupled_seq_is_rs", "rollout_rs_seq_masked_fraction"),
    "other_geo_rs_rejected": ("decoupled_geo_rs", "rollout_rs_seq_masked_fraction"),
}


def other_corrections(old_log_prob, rollout_log_prob, mask) -> dict[str, float]:
    from rollout_correction import RolloutCorrectionConfig

    out, metrics = {}, {}
    for key, (preset, name) in OTHER_CORRECTIONS.items():
        if preset not in metrics:
            cfg = RolloutCorrectionConfig.from_preset(preset)
            metrics[preset] = compute_rollout_correction(old_log_prob, rollout_log_prob, mask, config=cfg).metrics
        out[key] = float(metrics[preset][METRIC_PREFIX + name])
    return out
