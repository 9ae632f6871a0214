"""Mixture-of-experts routing: record it, replay it, measure how often two stacks disagree.

For an MoE model the largest part of the training–inference mismatch is often the router: the
rollout engine and the trainer score the experts with different kernels and precisions, near-tied
scores flip, and the token's log-probability then comes from a different sub-network. Routing
replay removes that part of the gap:

* **R3** (rollout routing replay): the engine records the experts it used while sampling, the
  trainer replays them in its forwards (the π_old recompute and π_θ with gradient);
* **R2** (trainer routing replay): the trainer records its own first pass and replays it in the
  later passes over the same batch.

Both go through the same two context managers, :func:`record_routing` and
:func:`replay_routing`, on any Hugging Face ``transformers`` model whose routers follow the
library's top-k router convention (Mixtral, Qwen3-MoE, OLMoE; a router module with ``top_k`` and a
``(num_experts, hidden)`` ``weight`` whose forward returns ``(router_logits, router_scores,
router_indices)``). Routers are found by that structure and the model's config (its expert count,
``num_experts_per_tok`` and ``hidden_size`` where it names them), never by class name, with

    p = softmax(router_logits)                 (in fp32)
    I = top-k(p),  sᵢ = p_i  for i ∈ I,         sᵢ ← sᵢ / Σ_{j∈I} p_j  when the architecture renormalises

Each router is checked against this formula when a context is entered (a few random tokens through
the router itself); a model without such routers, or whose routers compute anything else (sigmoid
scores, bias-corrected selection, grouped top-k), is refused by name. Nothing in the model is
changed: the context managers add forward hooks (``torch.nn.Module.register_forward_hook``) and
remove them on exit.

Under replay the router still computes its own probabilities p, so the gate values of the recorded
experts R are sᵢ = p_i (/ Σ_{j∈R} p_j), a differentiable function of the router weights: the router
keeps learning. Gate replay (``replay_routing(..., gates="recorded")``; prime-rl #3509 / #3523, "Total
Router Recall") replays the recorded gate values too, in fp32 as recorded, with the router frozen:
the forward then combines the same experts with the same weights as the recording one, whatever the
trainer's router weights are (prime-rl #3524: router weights downcast to bf16 in the weight transfer
gave k3 0 → 0.055 within 3 steps). Positions the record does not hold, and padding (the forward's ``attention_mask``
is 0 there), are never replayed. :func:`routing_agreement` measures two records against each other
with the library's exact, data-parallel reductions, and :func:`routing_confidence` the top-k
probability mass Σ_{i∈I} p_i each side's routers put on their choice (prime-rl #2545).

``router_fp32=True`` (prime-rl #2952) makes every router compute its logits in fp32 from its own
input and weights, z = x W^T in float32, and select and gate from them, whatever the model's
dtype: a bf16 engine then rounds no router logit, and the near-ties that decide its top-k fall
the same way as in an fp32 trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from rollout_correction import METRIC_PREFIX, ConfigError, ShapeMismatchError
from rollout_correction.reductions import SufficientStats, safe_div

__all__ = ["RoutingRecord", "RecordingHandle", "Router", "find_routers", "record_routing", "replay_routing",
           "gate_weights", "routing_agreement", "routing_confidence", "routing_mask_from_response",
           "UnsupportedModelError", "RoutingMismatchError", "ROUTING_METRICS", "GATE_SOURCES"]

#: The metrics :func:`routing_agreement` returns (besides the per-layer ones), unprefixed.
ROUTING_METRICS = ("routing_match", "routing_overlap", "routing_token_differs", "routing_tokens")


class UnsupportedModelError(TypeError):
    """The model has no routers following the top-k router convention."""


class RoutingMismatchError(ShapeMismatchError):
    """A routing record does not fit the model or the batch (rows, positions, layers, top-k)."""


# ---------------------------------------------------------------------------------------------
# The record


@dataclass(frozen=True)
class RoutingRecord:
    """The experts every router selected: ``experts[b, t, l]`` is the top-k set of layer ``l``'s
    router for the token at row ``b``, position ``t`` (the token *fed* to the model there; its
    output predicts position t + 1).

    Attributes:
      experts: (B, T, L, K) int64 expert indices.
      valid: (B, T) bool, True where the position was routed (recorded); replay leaves the other
        positions to the router's own choice and agreement skips them.
      topk_mass: (B, T, L) float32 Σ_{i∈I} p_i, the router probability of the selected experts
        (:func:`record_routing` records it; engines' formats carry none: None).
      gates: (B, T, L, K) float32 gate values of ``experts``, in the same order: the weights the
        forward combined the experts' outputs with (:func:`record_routing` records them; verl's and
        slime's formats carry none: None). ``replay_routing(..., gates="recorded")`` replays them.
    """

    experts: torch.Tensor
    valid: torch.Tensor
    topk_mass: Optional[torch.Tensor] = None
    gates: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.experts.dim() != 4:
            raise RoutingMismatchError(f"experts must be (rows, positions, layers, top_k), got shape "
                                       f"{tuple(self.experts.shape)}")
        if self.experts.dtype.is_floating_point or self.experts.dtype == torch.bool:
            raise RoutingMismatchError(f"experts must hold integer expert indices, got {self.experts.dtype}")
        if tuple(self.valid.shape) != tuple(self.experts.shape[:2]):
            raise RoutingMismatchError(f"valid must be (rows, positions) = {tuple(self.experts.shape[:2])}, "
                                       f"got {tuple(self.valid.shape)}")
        if self.topk_mass is not None and tuple(self.topk_mass.shape) != tuple(self.experts.shape[:3]):
            raise RoutingMismatchError(f"topk_mass must be (rows, positions, layers) = {tuple(self.experts.shape[:3])}, "
                                       f"got {tuple(self.topk_mass.shape)}")
        if self.gates is not None and (tuple(self.gates.shape) != tuple(self.experts.shape)
                                       or self.gates.dtype != torch.float32):
            raise RoutingMismatchError(f"gates must be float32 (rows, positions, layers, top_k) = "
                                       f"{tuple(self.experts.shape)}, got {self.gates.dtype} {tuple(self.gates.shape)}")

    def _with(self, experts: torch.Tensor, valid: torch.Tensor, select) -> "RoutingRecord":
        """A record of ``experts`` / ``valid`` whose ``topk_mass`` and ``gates`` are ``select`` of this one's."""
        return RoutingRecord(experts, valid, *(None if t is None else select(t) for t in (self.topk_mass, self.gates)))

    def describe(self) -> str:
        """``(rows, positions, layers, top_k) = (…)`` and what it holds, for messages."""
        held = ", ".join(name for name in ("topk_mass", "gates") if getattr(self, name) is not None) or "expert ids only"
        return f"(rows, positions, layers, top_k) = {tuple(self.experts.shape)}, holding {held}"

    @classmethod
    def from_experts(cls, experts: torch.Tensor, valid: Optional[torch.Tensor] = None,
                     gates: Optional[torch.Tensor] = None) -> "RoutingRecord":
        """A record from a (B, T, L, K) integer tensor; ``valid`` (B, T) defaults to every position;
        ``gates`` (B, T, L, K), the experts' gate values (an engine that returns them), as float32."""
        experts = torch.as_tensor(experts)
        if experts.dim() != 4:
            raise RoutingMismatchError(f"experts must be (rows, positions, layers, top_k), got shape "
                                       f"{tuple(experts.shape)}")
        if valid is None:
            valid = torch.ones(experts.shape[:2], dtype=torch.bool, device=experts.device)
        gates = None if gates is None else torch.as_tensor(gates, device=experts.device).float()
        return cls(experts.long(), torch.as_tensor(valid, device=experts.device).bool(), gates=gates)

    # -- shape ---------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.experts.shape[0]

    @property
    def positions(self) -> int:
        return self.experts.shape[1]

    @property
    def num_layers(self) -> int:
        return self.experts.shape[2]

    @property
    def top_k(self) -> int:
        return self.experts.shape[3]

    # -- slicing and layouts -----------------------------------------------------------
    def __getitem__(self, rows) -> "RoutingRecord":
        """The record of some rows (a slice, an index tensor or a bool row mask): one micro-batch."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)
        return self._with(self.experts[rows], self.valid[rows], lambda m: m[rows])

    def __len__(self) -> int:
        return self.rows

    def to(self, device) -> "RoutingRecord":
        return self._with(self.experts.to(device), self.valid.to(device), lambda m: m.to(device))

    def positions_slice(self, start: int, stop: Optional[int] = None) -> "RoutingRecord":
        """The record of positions [start, stop) of every row (e.g. the response part)."""
        return self._with(self.experts[:, start:stop], self.valid[:, start:stop], lambda m: m[:, start:stop])

    def pack(self, attention_mask: torch.Tensor) -> "RoutingRecord":
        """The packed (varlen) layout: the positions where ``attention_mask`` (B, T) is non-zero,
        row after row, as one row (1, N, L, K) — the order a packed forward feeds them in."""
        m = _layout_mask(attention_mask, self)
        return self._with(self.experts[m].unsqueeze(0), self.valid[m].unsqueeze(0), lambda t: t[m].unsqueeze(0))

    def unpack(self, attention_mask: torch.Tensor) -> "RoutingRecord":
        """Inverse of :meth:`pack`: scatter a (1, N, L, K) record back to the (B, T) layout of
        ``attention_mask`` (positions outside the mask are not valid)."""
        m = torch.as_tensor(attention_mask, device=self.experts.device).bool()
        if self.rows != 1 or m.dim() != 2 or int(m.sum()) != self.positions:
            raise RoutingMismatchError(f"unpack needs a packed record (1, N, L, K) and a (B, T) mask with N "
                                       f"non-zero entries; got record {tuple(self.experts.shape)} and mask "
                                       f"{tuple(m.shape)} with {int(m.sum())} tokens")
        experts = self.experts.new_zeros((*m.shape, self.num_layers, self.top_k))
        valid = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
        experts[m], valid[m] = self.experts[0], self.valid[0]

        def scatter(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((*m.shape, *t.shape[2:]))
            out[m] = t[0]
            return out

        return self._with(experts, valid, scatter)

    @staticmethod
    def cat(records: Sequence["RoutingRecord"]) -> "RoutingRecord":
        """Records of the same positions, layers and top-k stacked along rows."""
        if not records:
            raise ValueError("cat needs at least one record")
        shapes = {tuple(r.experts.shape[1:]) for r in records}
        if len(shapes) > 1:
            raise RoutingMismatchError(f"records to stack differ in (positions, layers, top_k): {sorted(shapes)}")
        extra = [[getattr(r, name) for r in records] for name in ("topk_mass", "gates")]
        extra = [torch.cat(ts) if all(t is not None for t in ts) else None for ts in extra]
        return RoutingRecord(torch.cat([r.experts for r in records]), torch.cat([r.valid for r in records]), *extra)

    # -- engines' formats ----------------------------------------------------------------
    @classmethod
    def from_verl(cls, data, attention_mask: Optional[torch.Tensor] = None) -> "RoutingRecord":
        """verl's ``routed_experts``: a (B, prompt_len + response_len, L, K) integer tensor (int16)
        aligned with ``input_ids`` (left-padded prompt, right-padded response), zero where the
        engine recorded nothing. ``data`` is that tensor, or a ``DataProto`` / ``TensorDict`` /
        mapping holding ``routed_experts`` (and ``attention_mask``). After verl's
        ``left_right_2_no_padding`` the field is a jagged nested tensor: the record is then the
        packed (1, N, L, K) layout of the trainer's remove-padding forward.

        Valid positions: ``attention_mask`` non-zero and, for K > 1, a top-k set of K distinct
        experts (verl's zero fill repeats expert 0, which no router selects, so unrecorded rows —
        the last token, turns after the last generation — are left to the trainer's own router).
        With K = 1 the zero fill cannot be told from expert 0: the ``attention_mask`` is then
        required, so that no padded position replays to expert 0.
        """
        batch = getattr(data, "batch", data)
        if isinstance(batch, torch.Tensor):
            experts = batch
        else:
            experts = batch["routed_experts"]
            if attention_mask is None and "attention_mask" in batch.keys():
                attention_mask = batch["attention_mask"]
        if isinstance(experts, torch.Tensor) and experts.is_nested:
            # verl's no-padding layout (``left_right_2_no_padding``): a jagged (B, j, L, K) tensor whose
            # values are the tokens of every row in order, i.e. the packed layout.
            flat = experts.values()
            return cls.from_experts(flat.unsqueeze(0), _distinct(flat.unsqueeze(0)))
        experts = torch.as_tensor(experts)
        if experts.dim() != 4:
            raise RoutingMismatchError(f"verl's routed_experts is (batch, seq_len, layers, top_k); got shape "
                                       f"{tuple(experts.shape)}")
        valid = _distinct(experts)
        if attention_mask is None and experts.shape[-1] == 1:
            raise RoutingMismatchError("verl's routed_experts with top_k = 1 need the attention_mask: verl fills "
                                       "unrecorded positions with expert 0, which a top-1 record cannot tell from "
                                       "a real choice of expert 0")
        if attention_mask is not None:
            valid = valid & _layout_mask(attention_mask, RoutingRecord.from_experts(experts))
        return cls.from_experts(experts, valid)

    @classmethod
    def from_slime(cls, routed_experts: Sequence) -> "RoutingRecord":
        """slime's ``rollout_routed_experts``: one (len(tokens) − 1, L, K) array per sample (the
        routing of every token fed to the engine; the last token is never fed), as
        ``Sample.rollout_routed_experts`` holds it. Returns a right-padded (B, max_len, L, K)
        record whose ``valid`` marks each sample's rows."""
        items = [torch.as_tensor(x) for x in routed_experts]
        if not items:
            raise RoutingMismatchError("slime's rollout_routed_experts is empty")
        bad = [i for i, x in enumerate(items) if x.dim() != 3 or tuple(x.shape[1:]) != tuple(items[0].shape[1:])]
        if bad:
            raise RoutingMismatchError(f"slime's rollout_routed_experts are (len(tokens) - 1, layers, top_k) with the "
                                       f"same layers and top_k for every sample; samples {bad} differ "
                                       f"(first: {tuple(items[bad[0]].shape)}, expected (*, {tuple(items[0].shape[1:])}))")
        n = max(x.shape[0] for x in items)
        experts = items[0].new_zeros((len(items), n, *items[0].shape[1:]), dtype=torch.long)
        valid = torch.zeros((len(items), n), dtype=torch.bool)
        for i, x in enumerate(items):
            experts[i, :x.shape[0]] = x.long()
            valid[i, :x.shape[0]] = True
        return cls(experts, valid)


def _distinct(experts: torch.Tensor) -> torch.Tensor:
    """(B, T) True where every layer's top-k set holds K distinct experts."""
    if experts.shape[-1] < 2:
        return torch.ones(experts.shape[:2], dtype=torch.bool, device=experts.device)
    s = experts.sort(dim=-1).values
    return (s[..., 1:] != s[..., :-1]).all(-1).all(-1)


def _layout_mask(mask: torch.Tensor, record: RoutingRecord) -> torch.Tensor:
    m = torch.as_tensor(mask, device=record.experts.device)
    if tuple(m.shape) != (record.rows, record.positions):
        raise RoutingMismatchError(f"mask must be (rows, positions) = ({record.rows}, {record.positions}), "
                                   f"got {tuple(m.shape)}")
    return m.bool()


# ---------------------------------------------------------------------------------------------
# Finding the routers


@dataclass(frozen=True)
class Router:
    """One router module of the model: its layer index among the routers, its name, and whether
    the architecture renormalises the top-k probabilities."""

    layer: int
    name: str
    module: torch.nn.Module
    top_k: int
    num_experts: int
    renormalize: bool


def _model_name(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    return f"{type(model).__name__}" + (f" (model_type {kind!r})" if kind else "")


#: The model-config fields transformers' MoE configs name the expert count, top-k and width with.
_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def _config_shape(model: torch.nn.Module) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(experts, top-k, hidden size) from the model's config (``model.config``), None where absent."""
    config = getattr(model, "config", None)
    experts = next((v for k in _EXPERTS_KEYS if isinstance(v := getattr(config, k, None), int)), None)
    top_k, hidden = getattr(config, "num_experts_per_tok", None), getattr(config, "hidden_size", None)
    return experts, top_k if isinstance(top_k, int) else None, hidden if isinstance(hidden, int) else None


def _candidate(module: torch.nn.Module, shape: tuple[Optional[int], Optional[int], Optional[int]]) -> bool:
    """A router by structure, whatever its class is called: an int ``top_k`` and a 2-D ``weight``
    of (experts, hidden) with more experts than ``top_k``; where the model's config names the
    expert count, top-k or width, the module must agree with them. The probe of
    :func:`_renormalizes` then checks what it computes."""
    w, top_k = getattr(module, "weight", None), getattr(module, "top_k", None)
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and isinstance(w, torch.Tensor) and w.dim() == 2):
        return False
    experts, k, hidden = shape
    return (w.shape[0] > top_k and (experts is None or w.shape[0] == experts) and (k is None or top_k == k)
            and (hidden is None or w.shape[1] == hidden))


@torch.no_grad()
def _renormalizes(name: str, module: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Run a few random tokens through the router and tell which form of the convention it
    computes (top-k probabilities renormalised or not); refuse any other router."""
    w = module.weight
    if w.device.type == "meta":
        raise UnsupportedModelError(f"{_model_name(model)}: router {name} has no weights (meta device)")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, w.shape[1], generator=gen).to(device=w.device, dtype=w.dtype)
    out = module.forward(x)  # not through __call__: no forward hook (ours or the user's) sees the probe
    if not (isinstance(out, tuple) and len(out) == 3):
        raise UnsupportedModelError(f"{_model_name(model)}: router {name} ({type(module).__name__}) does not return "
                                    "(router_logits, router_scores, router_indices)")
    logits, scores, idx = out
    p = torch.softmax(logits.float(), dim=-1)
    top, top_idx = torch.topk(p, module.top_k, dim=-1)
    same_set = torch.equal(idx.sort(-1).values.long(), top_idx.sort(-1).values.long())
    if same_set:
        own = p.gather(-1, idx.long())
        for renorm in (True, False):
            expect = own / own.sum(-1, keepdim=True) if renorm else own
            if torch.allclose(scores.float(), expect.to(scores.dtype).float(), rtol=1e-3, atol=1e-6):
                return renorm
    raise UnsupportedModelError(
        f"{_model_name(model)}: router {name} ({type(module).__name__}) does not compute softmax → top-k "
        "(→ renormalise) over its logits; routing replay supports Mixtral, Qwen3-MoE, OLMoE and models whose "
        "routers follow that convention")


# Router module -> whether it renormalises: the probe's answer depends on the router's code, not on
# its weights, so each module is probed once (its first context) and never again.
_RENORMALIZES: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def find_routers(model: torch.nn.Module) -> list[Router]:
    """The model's routers in forward order (their order among the modules), each checked against
    the top-k router convention (once per module); raises :class:`UnsupportedModelError` naming the
    model otherwise."""
    shape = _config_shape(model)
    found = [(name, m) for name, m in model.named_modules() if _candidate(m, shape)]
    if not found:
        raise UnsupportedModelError(
            f"{_model_name(model)} has no top-k router modules; routing record/replay supports Hugging Face "
            "transformers MoE models whose routers follow the top-k router convention (Mixtral, Qwen3-MoE, OLMoE)")
    routers = []
    for layer, (name, m) in enumerate(found):
        num_experts = int(m.weight.shape[0])
        if m not in _RENORMALIZES:
            _RENORMALIZES[m] = _renormalizes(name, m, model)
        routers.append(Router(layer, name, m, int(m.top_k), num_experts, _RENORMALIZES[m]))
    return routers


# ---------------------------------------------------------------------------------------------
# Tracking the calls: which rows and positions a forward covers


_CACHE_ARGS = ("cache", "past_key_values")


class _Calls:
    """Reads each top-level forward's (rows, positions) and where it starts: 0 for a fresh
    forward, the cached length for a KV-cache continuation."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.shape: Optional[tuple[int, int]] = None
        self.start = 0
        self.padding: Optional[torch.Tensor] = None  # (B, S) True at this forward's padded positions

    def pre_hook(self, module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            raise RoutingMismatchError(f"{_model_name(self.model)} was called without (batch, seq) input_ids or "
                                       "inputs_embeds; routing record/replay cannot place its tokens")
        self.shape = (int(x.shape[0]), int(x.shape[1]))
        cache = next((kwargs[k] for k in _CACHE_ARGS if kwargs.get(k) is not None), None)
        self.start = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        self.padding = _padding(kwargs.get("attention_mask", args[1] if len(args) > 1 else None), self.shape)
        self.on_call()

    def on_call(self) -> None:
        pass

    def tokens(self, n: int, router: Router) -> tuple[int, int]:
        if self.shape is None:
            raise RoutingMismatchError(f"router {router.name} ran outside a forward of the model given to the "
                                       "context manager; pass the model you call")
        b, s = self.shape
        if b * s != n:
            raise RoutingMismatchError(f"router {router.name} saw {n} tokens, the forward has {b} × {s}")
        return b, s


def _padding(attention_mask, shape: tuple[int, int]) -> Optional[torch.Tensor]:
    """(B, S) True where a forward's 2-D ``attention_mask`` is 0 (its last S columns: with a KV
    cache the mask also covers the cached positions); None without such a mask."""
    b, s = shape
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[0] == b \
            and attention_mask.shape[1] >= s:
        return attention_mask[:, attention_mask.shape[1] - s:] == 0
    return None


def _fp32_route(router: Router, inputs: tuple, out):
    """The router's output recomputed from fp32 logits z = x W^T (+ b): p = softmax(z), I = top-k(p),
    sᵢ = pᵢ (/ Σ_{j∈I} pⱼ where the architecture renormalises); logits stay fp32, gates and indices
    keep the router's dtypes."""
    _, scores, idx = out
    w = router.module.weight
    bias = getattr(router.module, "bias", None)
    logits = torch.nn.functional.linear(inputs[0].reshape(-1, w.shape[1]).float(), w.float(),
                                        bias.float() if isinstance(bias, torch.Tensor) else None)
    top, chosen = torch.softmax(logits, dim=-1).topk(router.top_k, dim=-1)
    gates = top / top.sum(-1, keepdim=True) if router.renormalize else top
    return logits, gates.to(scores.dtype), chosen.to(idx.dtype)


@contextlib.contextmanager
def _hooked(model: torch.nn.Module, calls: _Calls, routers: list[Router], router_hook, prepend: bool,
            router_fp32: bool = False):
    if not isinstance(router_fp32, bool):
        raise TypeError(f"router_fp32 must be True or False, got {router_fp32!r}")
    handles = [model.register_forward_pre_hook(calls.pre_hook, with_kwargs=True, prepend=True)]

    def hook(r: Router, inputs, out):
        return router_hook(r, _fp32_route(r, inputs, out) if router_fp32 else out)

    try:
        for r in routers:
            handles.append(r.module.register_forward_hook(
                lambda mod, inp, out, r=r: hook(r, inp, out), prepend=prepend))
        yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------
# Record


class _Recorder(_Calls):
    def __init__(self, model: torch.nn.Module, routers: list[Router]):
        super().__init__(model)
        self.routers = routers
        self.segments: list[list[RoutingRecord]] = []   # per fresh forward: (B, S_i) pieces
        self._layers: list[torch.Tensor] = []
        self._masses: list[torch.Tensor] = []
        self._gates: list[torch.Tensor] = []
        self._padding: Optional[torch.Tensor] = None  # of the forward whose layers are being collected
        self._length = 0

    def on_call(self) -> None:
        self._flush()
        self._padding = self.padding
        b, s = self.shape
        if self.start == 0:
            self.segments.append([])
            self._length = 0
        elif not self.segments or self.start != self._length:
            raise RoutingMismatchError(
                f"a KV-cache forward starts at position {self.start} but the record holds "
                f"{self._length if self.segments else 0} positions; record the whole generation, prompt included")
        self._length += s

    def hook(self, router: Router, out):
        logits, scores, idx = out
        b, s = self.tokens(idx.shape[0], router)
        if router.layer != len(self._layers):
            raise RoutingMismatchError(f"router {router.name} ran out of order (layer {router.layer} after "
                                       f"{len(self._layers)} layers of this forward)")
        idx = idx.detach().long()
        self._layers.append(idx.reshape(b, s, -1))
        self._gates.append(scores.detach().float().reshape(b, s, -1))  # exact: fp32 holds every bf16 / fp16 value
        p = torch.softmax(logits.detach().float(), dim=-1)
        self._masses.append(p.gather(-1, idx).sum(-1).reshape(b, s))
        return out

    def _flush(self) -> None:
        if self._layers:
            if len(self._layers) != len(self.routers):
                raise RoutingMismatchError(f"a forward ran {len(self._layers)} of the {len(self.routers)} routers")
            experts = torch.stack(self._layers, dim=2)
            valid = torch.ones(experts.shape[:2], dtype=torch.bool, device=experts.device)
            if self._padding is not None:
                valid = ~self._padding.to(experts.device)
            self.segments[-1].append(RoutingRecord(experts, valid, torch.stack(self._masses, dim=2),
                                                   torch.stack(self._gates, dim=2)))
            self._layers, self._masses, self._gates = [], [], []

    def record(self) -> RoutingRecord:
        self._flush()
        if not self.segments:
            raise RoutingMismatchError("nothing was recorded: no forward of the model ran inside record_routing")
        parts = [RoutingRecord(*(torch.cat([getattr(p, name) for p in seg], dim=1)
                                 for name in ("experts", "valid", "topk_mass", "gates"))) for seg in self.segments]
        return RoutingRecord.cat(parts)


class RecordingHandle:
    """What :func:`record_routing` yields; ``.record`` is available once the block has run (and
    inside it, for the forwards so far)."""

    def __init__(self, recorder: _Recorder):
        self._recorder = recorder
        self._final: Optional[RoutingRecord] = None

    @property
    def record(self) -> RoutingRecord:
        return self._final if self._final is not None else self._recorder.record()


@contextlib.contextmanager
def record_routing(model: torch.nn.Module, *, router_fp32: bool = False) -> Iterator[RecordingHandle]:
    """Record the experts every router of ``model`` selects in the forwards run inside the block.

    Each fresh forward (no KV cache, or an empty one) adds its rows; a forward continuing a KV
    cache (generation) appends its positions to the rows of the forward that filled the cache, so
    a generation loop yields the (B, P + T − 1) routing of the tokens it fed — exactly the
    positions a trainer's teacher-forced forward over ``tokens[:, :-1]`` routes. Fresh forwards of
    different lengths cannot be stacked into one record (their ``record`` raises).

    The record holds the router's *own* choice, also inside :func:`replay_routing` (the recording
    hook runs first), which is how the trainer's agreement with a replayed record is measured.
    Padded batches are recorded as laid out; positions where the forward's 2-D ``attention_mask``
    is 0 are marked not valid (never replayed, skipped by the agreement). A packed forward (one row
    of concatenated sequences) gives a (1, N, L, K) record (:meth:`RoutingRecord.unpack` restores
    the rows). The record's ``topk_mass`` is each router's probability of its own top-k set, for
    :func:`routing_confidence`; its ``gates`` are the gate values each router returned for its top-k
    set, stored in fp32 (every bf16 / fp16 value exactly), for ``replay_routing(..., gates="recorded")``.

    Args:
      model: the model whose routers to record.
      router_fp32: route from fp32 router logits (module docstring) in the forwards inside the
        block; the record is then of that routing.

    Yields:
      a handle whose ``.record`` is the :class:`RoutingRecord`.
    """
    routers = find_routers(model)
    recorder = _Recorder(model, routers)
    handle = RecordingHandle(recorder)
    with _hooked(model, recorder, routers, recorder.hook, prepend=True, router_fp32=router_fp32):
        yield handle
    if recorder.segments:
        handle._final = recorder.record()


# ---------------------------------------------------------------------------------------------
# Replay


class _Replayer(_Calls):
    def __init__(self, model: torch.nn.Module, routers: list[Router], record: RoutingRecord, gates: str):
        super().__init__(model)
        self.routers = routers
        self.record = record
        self.recorded_gates = gates == "recorded"

    def on_call(self) -> None:
        b, s = self.shape
        rec = self.record
        if b != rec.rows:
            raise RoutingMismatchError(f"the batch has {b} rows, the routing record {rec.rows}; slice the record "
                                       "by rows (record[i:j]) for each micro-batch")
        if self.start + s > rec.positions:
            raise RoutingMismatchError(f"the forward covers positions [{self.start}, {self.start + s}), the routing "
                                       f"record holds {rec.positions}; the record covers the tokens fed to the model "
                                       "(forward tokens[:, :-1], or pass the positions the record was made over)")

    def hook(self, router: Router, out):
        logits, scores, idx = out
        b, s = self.tokens(idx.shape[0], router)
        sl = slice(self.start, self.start + s)
        rec = self.record.experts[:, sl, router.layer].reshape(b * s, -1).to(idx.device)
        valid = self.record.valid[:, sl]
        if self.padding is not None:  # padding is never replayed, whatever the record holds there
            valid = valid & ~self.padding.to(valid.device)
        valid = valid.reshape(b * s, 1).to(idx.device)
        chosen = torch.where(valid, rec, idx.long())
        if not self.recorded_gates:
            return logits, gate_weights(logits, chosen, router.renormalize).to(scores.dtype), chosen.to(idx.dtype)
        # the router frozen: the recorded gate values where replayed, the router's own elsewhere, no gradient
        recorded = self.record.gates[:, sl, router.layer].reshape(b * s, -1).to(device=scores.device)
        gates = torch.where(valid, recorded.to(scores.dtype), scores.detach())
        return logits.detach(), gates, chosen.to(idx.dtype)


def gate_weights(router_logits: torch.Tensor, experts: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """Gate values of the given experts from the router's own logits.

    p = softmax(router_logits) in fp32;  sᵢ = p_{eᵢ}, divided by Σⱼ p_{eⱼ} when ``renormalize``.

    Args:
      router_logits: (N, E) logits of N tokens over E experts.
      experts: (N, K) expert indices.
    Returns:
      (N, K) float32 gate values, differentiable with respect to the logits.
    """
    p = torch.softmax(router_logits.float(), dim=-1).gather(-1, experts)
    return p / p.sum(-1, keepdim=True) if renormalize else p


#: The values of ``replay_routing``'s ``gates``: the router's own gate values over the replayed experts
#: (R3 as the engines ship it), or the record's (gate replay, "Total Router Recall").
GATE_SOURCES = ("recomputed", "recorded")


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, record: RoutingRecord, mask: Optional[torch.Tensor] = None, *,
                   router_fp32: bool = False, gates: str = "recomputed") -> Iterator[None]:
    """Make every router of ``model`` select the experts in ``record`` for the forwards run inside
    the block. With ``gates="recomputed"`` (the default) the gate values are :func:`gate_weights` of
    the router's own logits over those experts (renormalised where the architecture renormalises),
    so gradients reach the router. With ``gates="recorded"`` they are the record's own (``record.gates``,
    the values the recording forward combined the experts with), and the router is frozen: its
    outputs are detached, so no gradient reaches it (prime-rl #3509 / #3523); replaying the ids and
    the gates of a record reproduces the recording forward's output bit for bit whatever the router's
    weights have become, where replaying the ids alone leaves the gates to them.

    A forward of (B, S) tokens replays rows 0..B−1 of the record at positions [c, c + S), where c
    is the KV cache's length (0 for a teacher-forced forward): slice the record by rows for
    micro-batches (``record[i:j]``). Positions the record marks not valid, positions ``mask``
    (B, T) at the record's positions leaves out, and the forward's padding (its 2-D
    ``attention_mask`` is 0 there) keep the router's own choice: a padded route is never replayed.
    R3 passes the engine's record, R2 the trainer's own first-pass record. ``router_fp32``: the
    routers compute their logits (and so the positions not replayed, and every gate value) in fp32.

    Raises:
      ConfigError: ``gates`` is not one of :data:`GATE_SOURCES`.
      RoutingMismatchError: rows, positions, layers or top-k of the record do not fit, or
        ``gates="recorded"`` with a record that holds no gate values.
      UnsupportedModelError: the model's routers do not follow the top-k router convention.
    """
    if gates not in GATE_SOURCES:
        raise ConfigError(f"replay_routing: gates={gates!r} is invalid; choose one of {list(GATE_SOURCES)}")
    if not isinstance(record, RoutingRecord):
        raise TypeError(f"record must be a RoutingRecord, got {type(record).__name__}")
    if gates == "recorded" and record.gates is None:
        raise RoutingMismatchError(
            f"replay_routing(gates='recorded'): the routing record passed as `record` ({record.describe()}) holds "
            "no gate values; record_routing records them (verl's and slime's expert-id formats carry none), or "
            "replay the ids alone with gates='recomputed'")
    if mask is not None:
        record = dataclasses.replace(record, valid=record.valid & _layout_mask(mask, record))
    routers = find_routers(model)
    if record.num_layers != len(routers):
        raise RoutingMismatchError(f"the routing record has {record.num_layers} layers, {_model_name(model)} has "
                                   f"{len(routers)} routers")
    k = {r.top_k for r in routers}
    if k != {record.top_k}:
        raise RoutingMismatchError(f"the routing record has top_k = {record.top_k}, the model's routers select "
                                   f"{sorted(k)}")
    e = min(r.num_experts for r in routers)
    if record.experts.numel() and (int(record.experts.min()) < 0 or int(record.experts.max()) >= e):
        raise RoutingMismatchError(f"the routing record names experts outside [0, {e})")
    replayer = _Replayer(model, routers, record, gates)
    with _hooked(model, replayer, routers, replayer.hook, prepend=False, router_fp32=router_fp32):
        yield


# ---------------------------------------------------------------------------------------------
# Agreement


def _compared(a: RoutingRecord, b: RoutingRecord, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, T) bool: the positions two records of the same shape both hold and ``mask`` keeps."""
    if tuple(a.experts.shape) != tuple(b.experts.shape):
        raise RoutingMismatchError(f"the records differ in shape (rows, positions, layers, top_k): "
                                   f"{tuple(a.experts.shape)} vs {tuple(b.experts.shape)}")
    keep = a.valid & b.valid.to(a.valid.device)
    return keep if mask is None else keep & _layout_mask(mask, a)


def routing_agreement(record_a: RoutingRecord | torch.Tensor, record_b: RoutingRecord | torch.Tensor,
                      mask: Optional[torch.Tensor] = None, *, process_group: Optional[object] = None
                      ) -> dict[str, torch.Tensor]:
    """How often two records route the same tokens to the same experts.

    Over the tokens n = 1..N that ``mask`` (B, T) keeps and both records hold, and layers l = 1..L,
    with top-k sets Aₙₗ and Bₙₗ of size K:

      routing_match          = Σₙₗ [Aₙₗ = Bₙₗ] / (N·L)              (exact top-k set match)
      routing_overlap        = Σₙₗ |Aₙₗ ∩ Bₙₗ| / (K·N·L)             (mean top-k overlap)
      routing_match_layer{l} = Σₙ [Aₙₗ = Bₙₗ] / N,   routing_overlap_layer{l} likewise
      routing_token_differs  = Σₙ [∃l: Aₙₗ ≠ Bₙₗ] / N              (tokens routed differently anywhere)
      routing_tokens         = N
      routing_gate_abs_diff  = Σ_{nl: Aₙₗ = Bₙₗ} Σ_{e∈Aₙₗ} |gᵃₙₗₑ − gᵇₙₗₑ| / (K · #{nl: Aₙₗ = Bₙₗ})
                               (when both records hold gate values: the mean difference of the gate
                               values of the same experts, over the (token, layer) pairs routed alike)

    With ``process_group`` the sums are all-reduced first, so every rank gets the values of the
    whole batch, however it was split (one collective, no host sync). Values over an empty set are 0.

    Args:
      record_a, record_b: :class:`RoutingRecord` or (B, T, L, K) expert indices, same shape.
      mask: (B, T) bool or 0/1, e.g. the response mask placed at the recorded positions.
    Returns:
      dict ``rollout_corr/<name>`` → 0-d float64 tensor.
    """
    a = record_a if isinstance(record_a, RoutingRecord) else RoutingRecord.from_experts(record_a)
    b = record_b if isinstance(record_b, RoutingRecord) else RoutingRecord.from_experts(record_b)
    keep = _compared(a, b, mask)
    ea, eb = a.experts, b.experts.to(a.experts.device)
    k = a.top_k
    same_set = (ea.sort(-1).values == eb.sort(-1).values).all(-1)                     # (B, T, L)
    overlap = (ea.unsqueeze(-1) == eb.unsqueeze(-2)).any(-1).sum(-1).double() / k     # (B, T, L)
    w = keep.double().unsqueeze(-1)
    names = ["tokens", "token_differs"] + [f"match{l}" for l in range(a.num_layers)] \
        + [f"overlap{l}" for l in range(a.num_layers)]
    parts = [keep.double().sum().reshape(1), (keep & ~same_set.all(-1)).double().sum().reshape(1),
             (same_set.double() * w).sum((0, 1)), (overlap * w).sum((0, 1))]
    gated = a.gates is not None and b.gates is not None
    if gated:  # the gates of the same experts, aligned by expert id, where the sets match
        ga = a.gates.gather(-1, ea.argsort(-1))
        gb = b.gates.to(ga.device).gather(-1, eb.argsort(-1))
        alike = same_set.double() * w
        names += ["gate_pairs", "gate_diff"]
        parts += [alike.sum().reshape(1), ((ga - gb).abs().double().mean(-1) * alike).sum().reshape(1)]
    stats = SufficientStats.from_vector(names, torch.cat(parts)).all_reduce(process_group)
    s = stats.sums
    n, layers = s["tokens"], a.num_layers
    out = {"routing_tokens": n, "routing_token_differs": safe_div(s["token_differs"], n)}
    match = [safe_div(s[f"match{l}"], n) for l in range(layers)]
    over = [safe_div(s[f"overlap{l}"], n) for l in range(layers)]
    out["routing_match"] = torch.stack(match).mean()
    out["routing_overlap"] = torch.stack(over).mean()
    for l in range(layers):
        out[f"routing_match_layer{l}"] = match[l]
        out[f"routing_overlap_layer{l}"] = over[l]
    if gated:
        out["routing_gate_abs_diff"] = safe_div(s["gate_diff"], s["gate_pairs"])
    return {METRIC_PREFIX + name: torch.as_tensor(v, dtype=torch.float64) for name, v in out.items()}


def routing_confidence(engine: RoutingRecord, trainer: RoutingRecord, mask: Optional[torch.Tensor] = None, *,
                       process_group: Optional[object] = None) -> dict[str, torch.Tensor]:
    """The routers' confidence in their own choice, engine vs trainer (prime-rl #2545): the mean
    top-k probability mass.

    Over the tokens n = 1..N that ``mask`` keeps and both records hold, and layers l = 1..L, with
    mₙₗ = Σ_{i∈Iₙₗ} pₙₗᵢ the router probability of its own top-k set Iₙₗ (``topk_mass``):

      routing_confidence_engine  = Σₙₗ m^engine_nl / (N·L)
      routing_confidence_trainer = Σₙₗ m^trainer_nl / (N·L)
      routing_confidence_diff    = routing_confidence_trainer − routing_confidence_engine

    A mass near K/E (uniform router) means near-ties, where the two stacks' rounding flips the
    selection; near 1, a decided router. One all-reduce over ``process_group``; 0 over an empty set.

    Args:
      engine, trainer: :class:`RoutingRecord` s of the same tokens, each with ``topk_mass``
        (:func:`record_routing` records it).
      mask: (B, T) bool or 0/1 at the recorded positions.
    Returns:
      dict ``rollout_corr/<name>`` → 0-d float64 tensor.
    """
    for name, r in (("engine", engine), ("trainer", trainer)):
        if not isinstance(r, RoutingRecord):
            raise TypeError(f"{name} must be a RoutingRecord, got {type(r).__name__}")
        if r.topk_mass is None:
            raise RoutingMismatchError(f"the {name} record has no topk_mass (the router probabilities of its "
                                       "choice); record it with record_routing")
    w = _compared(engine, trainer, mask).double().unsqueeze(-1)
    me, mt = engine.topk_mass.double(), trainer.topk_mass.to(engine.topk_mass.device).double()
    vec = torch.stack([(w.expand_as(me)).sum(), (me * w).sum(), (mt * w).sum()])
    s = SufficientStats.from_vector(["n", "engine", "trainer"], vec).all_reduce(process_group).sums
    eng, tr = safe_div(s["engine"], s["n"]), safe_div(s["trainer"], s["n"])
    out = {"routing_confidence_engine": eng, "routing_confidence_trainer": tr, "routing_confidence_diff": tr - eng}
    return {METRIC_PREFIX + name: torch.as_tensor(v, dtype=torch.float64) for name, v in out.items()}


def routing_mask_from_response(response_mask: torch.Tensor, prompt_len: int, positions: int) -> torch.Tensor:
    """The (B, positions) mask of the recorded positions whose routing produced a response token's
    log-prob: response token t (0-based) is predicted from the token fed at position
    prompt_len − 1 + t."""
    m = torch.as_tensor(response_mask).bool()
    out = torch.zeros((m.shape[0], positions), dtype=torch.bool, device=m.device)
    out[:, prompt_len - 1: prompt_len - 1 + m.shape[1]] = m[:, : positions - prompt_len + 1]
    return out
