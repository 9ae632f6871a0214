"""Demo settings: the methods compared, the scenarios offered, and one config for a run.

A *method* is a rollout engine choice plus a loss; every corrected method names a
``RolloutCorrectionConfig`` preset of the library, with config keys set on top of it where the
criterion has no preset of its own (``options``). A *scenario* is a named set of defaults
(task, engine numerics, budget); every field can be overridden by a command-line flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rollout_correction.demo.model import MODEL_SIZES, MOE_SIZES
from rollout_correction.demo.task import REWARDS, TASKS, Task
from rollout_correction.demo.engine import GRANULARITIES, PRECISIONS, QUANTS


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    preset: str | None      # library preset, or None for the uncorrected PPO loss
    mismatched: bool        # sample from the mismatched engine (False: engine = trainer)
    description: str
    replay: bool = False    # R3: the trainer replays the engine's expert routing (MoE models only)
    options: tuple = ()     # (config key, value) pairs set on the preset's config

    @property
    def setting(self) -> str | None:
        """The preset, with its extra config keys: what a results table names the correction by."""
        if self.preset is None:
            return None
        return self.preset + "".join(f", {k}={v}" for k, v in self.options)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("on_policy", "on-policy reference", None, False,
           "engine = trainer (fp32, current weights): the target every correction aims at"),
    Method("naive", "naive PPO", None, True,
           "π_old recomputed by the trainer and treated as the behaviour policy; no correction"),
    Method("bypass_ppo", "bypass PPO-clip", "bypass_ppo_clip", True,
           "π_old := π_rollout; PPO ratio π_θ/π_rollout clipped to [1-ε, 1+ε]"),
    Method("token_tis", "decoupled token TIS", "decoupled_token_is", True,
           "ρₜ = min(π_old/π_rollout, 2) per token times the PPO-clip term"),
    Method("seq_is_rs", "decoupled seq IS + RS", "decoupled_seq_is_rs", True,
           "sequence ratio ∏ρₜ truncated at 2, sequences outside the RS band rejected"),
    Method("geo_rs", "geometric RS", "decoupled_geo_rs", True,
           "reject sequences whose geometric-mean ratio leaves the band (plus veto); no IS weights"),
    Method("pure_is", "pure IS (REINFORCE)", "bypass_pg_is", True,
           "−sg(w)·A·log π_θ with sequence-level w = π_θ/π_rollout, no clipping"),
    # The methods below run with ``--methods all`` (or by name).
    Method("seq_is", "decoupled seq TIS", "decoupled_seq_is", True,
           "sequence ratio ∏ρₜ truncated at 2 times the PPO-clip term; no rejection"),
    Method("icepop", "decoupled token IcePop", "decoupled_token_icepop", True,
           "ρₜ kept where it lies in [0.5, 5] and set to 0 outside, times the PPO-clip term"),
    Method("k3_rs", "k3 RS + token TIS", "decoupled_k3_rs_token_tis", True,
           "token TIS; sequences whose mean k3 = mean(ρₜ − 1 − log ρₜ) exceeds 0.01 rejected"),
    Method("geo_is", "decoupled geometric TIS", "decoupled_geo_is", True,
           "length-normalised sequence weight min(exp(mean log ρₜ), 2) times the PPO-clip term"),
    Method("opsm", "token TIS + OPSM", "decoupled_token_is_opsm", True,
           "token TIS; sequences with A < 0 and mean log(π_rollout/π_θ) > 0.05 leave the loss"),
    Method("m2po", "token TIS + M2PO", "decoupled_token_is_m2po", True,
           "token TIS; the tokens with the largest (log ρₜ)² are masked until their batch mean ≤ 0.04"),
    Method("topr", "TOPR", "bypass_topr", True,
           "REINFORCE against π_rollout: weight 1 for A ≥ 0, min(∏π_θ/π_rollout, 1) for A < 0"),
    Method("gspo", "GSPO × geometric TIS", "decoupled_gspo_geo_is", True,
           "PPO clip on the sequence ratio exp(mean log π_θ/π_old), geometric TIS weights"),
    Method("cispo", "CISPO × token TIS", "decoupled_cispo_token_is", True,
           "−sg(clip(π_θ/π_old))·A·log π_θ times token TIS weights"),
    Method("dppo_tv", "DPPO-TV × token TIS", "decoupled_dppo_tv_token_is", True,
           "truncated-ratio REINFORCE masked where |π_θ − π_old| of the token leaves ε, token TIS weights"),
    Method("dppo_kl", "DPPO-KL × token TIS", "decoupled_dppo_kl_token_is", True,
           "truncated-ratio REINFORCE masked where the token's binary KL leaves ε, token TIS weights"),
    # Probability-space gates and the two-sided veto.
    Method("tv_rs", "TV RS + token TIS", "decoupled_tv_rs_token_tis", True,
           "token TIS; tokens with |π_old − π_rollout| > 0.1 rejected"),
    Method("binary_kl_rs", "binary-KL RS + token TIS", "decoupled_binary_kl_rs_token_tis", True,
           "token TIS; sequences whose mean binary KL of the sampled token exceeds 0.02 rejected"),
    Method("veto2", "two-sided veto + token TIS", "decoupled_token_is_veto", True,
           "token TIS; sequences with any ρₜ < 1e-4 or > 10 rejected"),
)}

# The newer criteria: KPop's symmetric binary KL, signed Δp bands, the log-prob error, MinPRO's
# prefix-minimum weights (each on top of token TIS or as its weight) and the rollout-IS loss.
METHODS.update({m.name: m for m in (
    Method("kpop_rs", "KPop RS + token TIS", "decoupled_token_is", True,
           "token TIS; sequences whose mean symmetric binary KL max(KL(p‖q), KL(q‖p)) of the sampled token "
           "exceeds 0.02 rejected", options=(("rollout_rs", "seq_mean_kpop"), ("rollout_rs_threshold", 0.02))),
    Method("dp_rs", "Δp band + token TIS", "decoupled_token_is", True,
           "token TIS; sequences whose mean Δp = π_old − π_rollout of the sampled token leaves [−0.05, 0.05] "
           "rejected", options=(("rollout_rs", "seq_mean_dp"), ("rollout_rs_threshold", "-0.05_0.05"))),
    Method("lp_err_rs", "log-prob error RS + token TIS", "decoupled_token_is", True,
           "token TIS; sequences whose mean exp(|log ρₜ|) exceeds 1.1 rejected (NeMo-RL's log-prob error)",
           options=(("rollout_rs", "seq_logprob_error"), ("rollout_rs_threshold", 1.1))),
    Method("minpro", "MinPRO prefix-min TIS", "decoupled_token_is", True,
           "weight min_{s≤t} ρₛ per token (the running minimum of the prefix), truncated at 2, times the "
           "PPO-clip term", options=(("rollout_is", "prefix_min"),)),
    Method("rollout_is", "rollout-IS loss", "bypass_rollout_is", True,
           "REINFORCE with r = π_θ/π_rollout set to 0 outside (1 − ε, 1 + ε) (π_old := π_rollout)"),
    # prime-rl's losses (its default IPO, #3418 / #3586, and its IcePop, #3526): −A·r with r = π_θ/π_rollout
    # carrying the gradient, on the tokens a gate keeps, divided by every valid token.
    Method("prime_rl_ipo", "prime-rl IPO", "prime_rl_ipo", True,
           "−A·π_θ/π_rollout on the tokens with |π_θ − π_rollout| ≤ 0.3 (π_old := π_rollout; prime-rl's default)"),
    Method("prime_rl_icepop", "prime-rl IcePop", "prime_rl_icepop", True,
           "−A·π_θ/π_rollout on the tokens whose ratio lies in [0.2, 5], tested on its log (π_old := π_rollout)"),
    # The ``long`` scenario's geometric RS: its band fits 16 tokens of a 2-bit engine (docs/demo.md).
    Method("geo_rs_long", "geometric RS, band [0.5, 2]", "decoupled_geo_rs", True,
           "reject sequences whose geometric-mean ratio exp(mean log ρₜ) leaves [0.5, 2]; no IS weights",
           options=(("rollout_rs_threshold", "0.5_2.0"),)),
)})

#: Identical to another method at one update per batch (π_θ = π_old inside the step), so a results
#: table shows them once, under the name they alias; with several updates per batch
#: (``--minibatches``) they differ and run on their own.
ALIASES = {"seq_is": "pure_is", "gspo": "geo_is", "cispo": "token_tis", "dppo_tv": "token_tis",
           "dppo_kl": "token_tis"}

# Mixture-of-experts routing replay (R3): the engine records the experts it routed each token to
# while sampling; the trainer's forwards (π_old recompute and π_θ) replay them.
METHODS.update({m.name: m for m in (
    Method("r3", "R3 routing replay", None, True,
           "naive PPO with the trainer's routers replaying the engine's experts (π_old and π_θ)", replay=True),
    Method("r3_token_tis", "R3 + token TIS", "decoupled_token_is", True,
           "R3 routing replay, then token TIS ρₜ = min(π_old/π_rollout, 2) on what is left of the gap", replay=True),
    Method("bypass_r3", "bypass PPO-clip + R3", "bypass_ppo_clip", True,
           "R3 routing replay with π_old := π_rollout, PPO ratio π_θ/π_rollout clipped", replay=True),
)})
#: The methods of the ``moe`` scenario.
MOE_METHODS = ("naive", "token_tis", "r3", "r3_token_tis", "bypass_r3")

#: Run when ``--methods`` is not given: the reference pair, the scenario's recommended correction
#: and the other verl-preset corrections up to five methods, so that five seeds fit in 12 minutes on
#: two cores (``--methods all`` runs the rest).
DEFAULT_METHODS = ("on_policy", "naive", "bypass_ppo", "token_tis", "seq_is_rs")
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


@dataclass
class DemoConfig:
    """Everything one invocation of ``rollout-correction demo`` needs."""

    scenario: str = "stale"
    # task and model
    task: str = "sort"
    digits: int = 6
    tail: int = 0           # unscored continuation tokens after the answer (long responses; demo/task.py)
    reward: str = "partial"
    model: str = "tiny"
    # rollout engine (for the mismatched methods)
    precision: str = "fp32"
    quant: str = "none"
    granularity: str = "tensor"
    lag: int = 4
    # supervised warm start
    sft_steps: int = 60
    sft_batch: int = 64
    sft_lr: float = 1e-3
    # GRPO
    steps: int = 500
    prompts: int = 16       # × samples = 128 sequences per step (32 until the runs were made 2× cheaper)
    samples: int = 8
    lr: float = 3e-4
    minibatches: int = 1
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    # evaluation
    eval_every: int = 50
    eval_prompts: int = 512
    # experiment
    seeds: tuple[int, ...] = DEFAULT_SEEDS
    methods: tuple[str, ...] = DEFAULT_METHODS
    recommended: str | None = None   # the correction the scenario claims beats naive, declared before running
    # The claims, declared before running: (method, minus) pairs, each claiming method − minus > 0 on the
    # paired per-seed final exact match. None: on-policy − naive and recommended − naive (DEFAULT_CLAIMS).
    claims: tuple[tuple[str, str], ...] | None = None
    workers: int = 2
    threads: int = 1
    out: str = "demo-report"

    def __post_init__(self) -> None:
        for name, allowed in (("task", TASKS), ("model", tuple(MODEL_SIZES)), ("precision", tuple(PRECISIONS)),
                              ("quant", QUANTS), ("reward", REWARDS),
                              ("granularity", GRANULARITIES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        self.make_task()  # the digits and tail in range
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
        if not self.methods:
            raise ValueError("at least one method is required")
        if not self.seeds:
            raise ValueError("at least one seed is required")
        if len(set(self.seeds)) != len(self.seeds) or any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be distinct non-negative integers, got {list(self.seeds)}")
        if self.recommended is not None and (self.recommended not in METHODS or
                                             METHODS[self.recommended].preset is None):
            raise ValueError(f"recommended must name a corrected method, got {self.recommended!r}")
        for pair in self.claims or ():
            if len(pair) != 2 or any(m not in METHODS for m in pair) or pair[0] == pair[1]:
                raise ValueError(f"a claim is a pair of two different method names (method, minus), got {pair!r}")
        for name in ("steps", "prompts", "samples", "eval_every", "eval_prompts", "workers", "threads",
                     "minibatches", "sft_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sft_steps < 0 or self.lag < 0:
            raise ValueError("sft_steps and lag must be >= 0")
        if self.samples < 2:
            raise ValueError(f"samples per prompt must be >= 2 for group advantages, got {self.samples}")
        replaying = [m for m in self.methods if METHODS[m].replay]
        if replaying and self.model not in MOE_SIZES:
            raise ValueError(f"method(s) {replaying} replay expert routing and need a mixture-of-experts model "
                             f"(--model {' or '.join(MOE_SIZES)}), got --model {self.model}")
        if (self.prompts * self.samples) % self.minibatches:
            raise ValueError(f"minibatches ({self.minibatches}) must divide prompts × samples "
                             f"({self.prompts * self.samples})")

    def make_task(self) -> Task:
        """The task every run of this configuration trains on."""
        return Task(self.task, self.digits, self.reward, self.tail)

    def replace(self, **changes) -> "DemoConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["seeds"], d["methods"] = list(self.seeds), list(self.methods)
        d["claims"] = None if self.claims is None else [list(pair) for pair in self.claims]
        return d

    def declared_claims(self) -> tuple[tuple[str, str], ...]:
        """The (method, minus) pairs this configuration claims, each method − minus > 0."""
        return declared_claims(self.to_dict())


#: The claims of a scenario that declares none of its own: on-policy − naive (the mismatch costs naive
#: PPO something) and recommended − naive (the recommended correction wins some of it back).
DEFAULT_CLAIMS = (("on_policy", "naive"), ("recommended", "naive"))


def declared_claims(config: dict) -> tuple[tuple[str, str], ...]:
    """The (method, minus) pairs a config (``DemoConfig.to_dict()`` or a results file's ``config``)
    claims; "recommended" stands for its recommended correction (None when it declares none). A
    results file written before scenarios declared their own claims judges the default two."""
    pairs = config.get("claims") or DEFAULT_CLAIMS
    rec = config.get("recommended")
    return tuple((rec if a == "recommended" else a, rec if b == "recommended" else b) for a, b in pairs)


# Named defaults. ``stale`` is the default (asynchronous RL: the engine samples with weights four
# optimizer steps old); ``quantized`` has a 2-bit engine with one scale per output channel (a 3-bit
# per-tensor engine left token TIS tied with naive at five seeds: docs/demo.md); ``bf16-long`` is
# the opposite regime; ``long`` has long answers and a 2-bit engine, length × per-token KL ≥ 20 (docs/demo.md). Each
# names, before any run, the correction it recommends (``recommended``): the claims of the report
# are that it and on-policy beat naive, judged per seed.
SCENARIOS: dict[str, dict] = {
    "quantized": dict(task="sort", digits=6, precision="fp32", quant="int2", granularity="channel", lag=0,
                      recommended="token_tis"),
    # ``stale`` runs 750 GRPO steps (500 until its claims held with too little margin): at 500 the
    # on-policy and corrected runs were still climbing at seed-dependent speeds (docs/demo.md).
    "stale": dict(task="sort", digits=6, precision="fp32", quant="none", lag=4, steps=750, recommended="bypass_ppo"),
    "bf16-long": dict(task="sort", digits=16, precision="bf16", quant="none", lag=0, sft_steps=120, steps=300),
    # ``long``: long responses with a small per-token gap. The answer (sort 6 digits) is followed by
    # 594 unscored tokens of a fixed bigram language model (demo/task.py), on which the 2-bit
    # per-channel engine differs from a checkpoint warm-started for 55 steps by a few hundredths of a
    # nat per token (more the longer the warm start: one-seed trials), so that length × KL passes 20
    # with a per-token KL of at most 0.05. At lr 3e-4 the unscored tokens' share of the gradient
    # undid an on-policy run's sort within 20 steps (one-seed trial); at 1e-4 it held. The claims,
    # declared before running: the recommended token TIS beats naive PPO and sequence-level IS.
    "long": dict(task="sort", digits=6, tail=594, precision="fp32", quant="int2", granularity="channel", lag=0,
                 sft_steps=55, sft_batch=32, steps=100, prompts=8, samples=4, lr=1e-4, eval_every=20,
                 recommended="token_tis", claims=(("token_tis", "naive"), ("token_tis", "seq_is")),
                 methods=("on_policy", "naive", "token_tis", "geo_is", "seq_is")),
}
# ``moe``: a tiny Mixtral whose engine copy has 3-bit fake-quantised attention and expert weights
# (routers unquantised), so near-tied router scores flip between engine and trainer; the
# routing-replay comparison. 16 prompts × 8 samples per step keep a run within the dense budget.
SCENARIOS["moe"] = dict(task="sort", digits=6, model="moe", precision="fp32", quant="int3", granularity="tensor",
                        lag=0, prompts=16, methods=MOE_METHODS)

# ``--quick``: a first look and the CI smoke run (one seed, the reference pair and the scenario's
# recommended correction; ``long`` at a tiny size).
QUICK = dict(steps=40, seeds=(0,), eval_every=20, eval_prompts=256, prompts=16)
QUICK_LONG = dict(QUICK, tail=40, sft_steps=40, steps=20, eval_every=10, eval_prompts=64, prompts=8, samples=4)


def quick_methods(scenario: dict) -> tuple[str, ...]:
    """The methods of ``--quick``: the scenario's references and its recommended correction."""
    refs = ("naive", "token_tis", "r3") if scenario.get("model") in MOE_SIZES else ("on_policy", "naive")
    rec = scenario.get("recommended") or "token_tis"
    return tuple(dict.fromkeys(refs + (rec,)))
