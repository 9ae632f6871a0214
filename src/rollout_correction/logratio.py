"""The per-token log-ratio and the per-sequence reductions every estimator shares.

``LogRatioBatch`` is built once per call from ``(old_log_prob, rollout_log_prob,
response_mask)``; each derived quantity (clamped log-ratio, ratio, k3, per-row sums and means, …)
is computed the first time an estimator asks for it and then reused, so a configuration pays
only for what it uses.

Every derived (B, T) tensor is exactly 0 at invalid positions. Invalid positions are removed
arithmetically — non-finite values are first replaced by ±1e30, then multiplied by the 0/1
mask — so a NaN or ±inf in padding can never leak into a sum, without the cost of ``where``
(several times slower than arithmetic on CPU). A valid position holding a non-finite value (or a
log-ratio of magnitude ≥ 1e30) is detected from the per-row min and max.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch

from . import native
from .constants import SAFETY_BOUND
from .stats import SufficientStats
from .validation import check_pair, check_same

if TYPE_CHECKING:
    from .sequence_group import RowExchange

__all__ = ["LogRatioBatch", "NONFINITE_SENTINEL", "TOKEN_OUTPUTS", "float_mask"]

#: Replacement for NaN / ±inf before masking; a valid |log-ratio| this large means "non-finite".
NONFINITE_SENTINEL = 1e30


def cached(fn):
    """A lazily computed attribute (like functools.cached_property, without its lock, so that
    torch.compile can trace through it)."""
    slot = "_cached_" + fn.__name__

    @functools.wraps(fn)
    def get(self):
        value = self.__dict__.get(slot)
        if value is None:
            value = fn(self)
            self.__dict__[slot] = value
        return value

    return property(get)


#: The per-token tensors a batch can be asked to produce (``outputs=``).
TOKEN_OUTPUTS = frozenset({"mask", "log_ratio", "ratio", "k3"})

#: Input dtypes whose subtraction promotes to float32 (then ``torch.sub`` upcasts as it subtracts).
_FLOAT32_SUB = {(a, b): torch.promote_types(a, b) == torch.float32
                for a in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                for b in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def float_mask(mask: torch.Tensor) -> torch.Tensor:
    """(…) float32 0/1: 1 where ``mask`` is non-zero, whatever its dtype."""
    return (mask if mask.dtype == torch.bool else mask != 0).to(torch.float32)


class Workspace:
    """Reusable buffers of :class:`LogRatioBatch` (see :meth:`LogRatioBatch.workspace`):
    ``slots`` (slots, rows, T) float32, and a (rows, T) float64 scratch made on first use."""

    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots
        self._f64: Optional[torch.Tensor] = None

    def float64(self, shape: torch.Size) -> torch.Tensor:
        """A float64 scratch tensor of ``shape`` (at most (rows, T)); its contents are garbage."""
        if self._f64 is None:
            self._f64 = torch.empty(self.slots.shape[1:], dtype=torch.float64, device=self.slots.device)
        return self._f64[:shape[0]]


class LogRatioBatch:
    """log ρ_t = log π_train(y_t) − log π_rollout(y_t) on valid tokens, 0 elsewhere.

    Args:
        old_log_prob: (B, T) π_train log-probs (π_old in decoupled mode, π_θ in bypass mode).
        rollout_log_prob: (B, T) π_rollout log-probs.
        response_mask: (B, T) bool or 0/1 mask of valid tokens.
        on_nonfinite: ``"reject"`` drops any sequence with a NaN/±inf log-prob at a valid
            position (counted in the ``nonfinite_*`` statistics); ``"raise"`` raises ValueError
            naming the first bad position.
        row_offset: index of this batch's first row in the caller's batch (for messages).
        rows: a :class:`~rollout_correction.sequence_group.RowExchange` when the sequences are
            split across a group (each rank holds part of every row); every per-row reduction
            then spans the group. None (default): the rows are whole.
        workspace: a buffer from :meth:`workspace` for the per-token temporaries (several
            (B, T) attributes are views of it); successive batches, e.g. the blocks of one call,
            reuse its memory instead of allocating fresh pages each time.
        outputs: the (B, T) tensors the caller will read among ``"mask"``, ``"log_ratio"``,
            ``"ratio"`` and ``"k3"`` (:data:`TOKEN_OUTPUTS`), so that the fused CPU pass
            (:mod:`.native`) writes only those; another is still computed when first read (with
            ATen). None: all of them. The ATen pass ignores it.
        mask_out: a (B, T) tensor, contiguous, of ``response_mask``'s dtype, that receives the mask
            of the tokens used (1 / 0 of that dtype) — the final mask of a call that rejects
            nothing, written by the same sweep on the fused pass.

    Attributes:
        mask: (B, T) float32 0/1 mask of the tokens used (input mask minus dropped rows).
        native: True when the fused CPU pass built this batch (:mod:`.native`).
        log_ratio: (B, T) float32 log ρ_t, 0 at unused positions.
        n_row: (B,) float32 valid-token count per row; ``row_valid`` (B,) bool: n_row > 0.
    """

    def __init__(self, old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                 response_mask: torch.Tensor, on_nonfinite: str = "reject", row_offset: int = 0,
                 rows: Optional[RowExchange] = None, *, workspace: Optional[Workspace] = None,
                 outputs: Optional[frozenset] = None, mask_out: Optional[torch.Tensor] = None) -> None:
        check_pair(old_log_prob, rollout_log_prob, response_mask)
        self.rows = rows
        self.old_log_prob = old_log_prob
        self.rollout_log_prob = rollout_log_prob
        if (rows is None and not torch.compiler.is_compiling()
                and native.enabled_for(old_log_prob, rollout_log_prob, response_mask)):
            self._setup_native(response_mask, on_nonfinite, row_offset, workspace, outputs, mask_out)
        else:
            self._setup(None, response_mask, on_nonfinite, row_offset, workspace)
            if mask_out is not None:
                mask_out.copy_(self.mask)

    @classmethod
    def from_log_ratio(cls, log_ratio: torch.Tensor, response_mask: torch.Tensor,
                       on_nonfinite: str = "reject", row_offset: int = 0) -> "LogRatioBatch":
        """A batch from a precomputed (B, T) log-ratio log π_train − log π_rollout.

        Everything that depends on the ratio only (IS weights, rejection, their statistics) works
        as on a batch built from the two log-probs; the perplexity metrics need the log-probs
        themselves, so :attr:`old_row_mean` raises on such a batch.
        """
        check_same([("log_ratio", log_ratio), ("response_mask", response_mask)], float_names=("log_ratio",))
        batch = cls.__new__(cls)
        batch.rows = None
        batch.old_log_prob = batch.rollout_log_prob = None
        batch._source_log_ratio = log_ratio
        batch._setup(log_ratio, response_mask, on_nonfinite, row_offset)
        return batch

    @classmethod
    def from_mask(cls, response_mask: torch.Tensor) -> "LogRatioBatch":
        """A batch that carries a (B, T) response mask only: the valid positions, the rows with a
        valid token and the token / row counts (:meth:`add_counts`), for statistics of weights or
        of a rejection statistic that the caller computed itself (verl's metric helpers take them
        precomputed). Its log-ratio is 0 everywhere; use :meth:`from_log_ratio` when you have one.
        """
        zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        return cls.from_log_ratio(zeros, response_mask)

    #: Slots of the stacked (B, T) token tensors whose per-row sums one reduction gives:
    #: input mask, mask used, log ρ, then (with the log-probs) π_train log-prob (masked), k3, ρ, ρ².
    _SLOTS = ("input_mask", "mask", "log_ratio", "old", "k3", "ratio", "ratio2")

    @classmethod
    def workspace(cls, rows: int, length: int, device: torch.device) -> "Workspace":
        """Buffers for the per-token temporaries of batches of up to ``rows`` rows of ``length``
        tokens (pass it as ``workspace=`` to successive batches to reuse the memory)."""
        return Workspace(torch.empty((len(cls._SLOTS), rows, length), dtype=torch.float32, device=device))

    def _setup(self, source: Optional[torch.Tensor], response_mask: torch.Tensor, on_nonfinite: str,
               row_offset: int, workspace: Optional[Workspace] = None) -> None:
        """The float32 log-ratio (from ``source``, or old − rollout), sanitised and masked; rows with
        a non-finite valid value; the masks; and, in one stacked reduction, the per-row sums of
        the mask, the log-ratio and (with the log-probs) everything the off-policy metrics need."""
        self.response_mask = response_mask
        full = self.old_log_prob is not None
        B, T = response_mask.shape
        device = response_mask.device
        # Every (B, T) temporary whose row sum is needed is written into one buffer, so one sum
        # reduces them all (and the float64 per-row values are derived from one small matrix).
        # Under torch.compile the same values are computed functionally and stacked (the compiler
        # fuses them; a graph must not alias its outputs to slices of a temporary).
        self._workspace = workspace
        self.native = False
        n_slots = len(self._SLOTS) if full else 3
        if torch.compiler.is_compiling():
            buf = None
        elif workspace is not None and full:
            buf = workspace.slots[:, :B]  # overwritten: the previous batch using it must be finished
        else:
            buf = torch.empty((n_slots, B, T), dtype=torch.float32, device=device)

        def slot(i: int) -> Optional[torch.Tensor]:
            return None if buf is None else buf[i]

        if full:
            old, roll = self.old_log_prob, self.rollout_log_prob
            if _FLOAT32_SUB.get((old.dtype, roll.dtype)):  # (torch.result_type would break a compiled graph)
                lr = torch.sub(old, roll, out=slot(2))  # upcast inside the subtraction
            else:  # e.g. both bf16: upcast first (a subtraction in bf16 would round)
                lr = (old.to(torch.float32, copy=True) if buf is None else buf[2].copy_(old)).sub_(roll)
        else:
            lr = source.to(torch.float32, copy=True) if buf is None else buf[2].copy_(source)
        # Non-zero marks a valid token, whatever the mask's dtype or values.
        if buf is None:
            mask_in = float_mask(response_mask)
        elif response_mask.dtype == torch.bool:
            mask_in = buf[0].copy_(response_mask)
        else:
            mask_in = torch.ne(response_mask, 0, out=buf[0])
        # Sanitise (NaN / ±inf → ±1e30) and mask: a valid |log ρ| ≥ 1e30 marks the row as bad.
        if buf is None:  # compiled: the compiler's nan_to_num tests NaN one lane at a time; x != x is vectorised
            lr = torch.where(lr != lr, NONFINITE_SENTINEL, lr.clamp(-NONFINITE_SENTINEL, NONFINITE_SENTINEL))
        else:
            torch.nan_to_num_(lr, nan=NONFINITE_SENTINEL, posinf=NONFINITE_SENTINEL, neginf=-NONFINITE_SENTINEL)
        lr.mul_(mask_in)
        if T > 0:
            # (abs + amax: on CPU ~20x faster than aminmax or an inf-norm, which are not vectorised)
            good = lr.abs().amax(-1) < NONFINITE_SENTINEL
        else:
            good = torch.ones(B, dtype=torch.bool, device=device)
        rows = self.rows
        if rows is not None:  # split rows: the group decides; the caller raises for on_nonfinite="raise"
            good = ~rows.max(~good)
        elif on_nonfinite == "raise" and not bool(good.all()):
            raise self._nonfinite_error(mask_in, ~good, row_offset)
        self._good_rows = good
        # Rows are dropped arithmetically whether or not any is bad: no data-dependent branch,
        # so the call never waits for the device (and can be captured in a CUDA graph).
        keep_row = good.unsqueeze(-1)
        mask = torch.mul(mask_in, keep_row, out=slot(1))
        lr.mul_(keep_row)
        self._cached_input_mask, self._cached_mask, self._cached_log_ratio = mask_in, mask, lr
        slots = [mask_in, mask, lr]
        if full:
            lrc = self._cached_log_ratio_clamped = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
            ratio = self._cached_ratio = torch.exp(lrc, out=slot(5)).mul_(mask)
            k3 = self._cached_k3 = torch.sub(ratio, mask, out=slot(4)).sub_(lrc).clamp_min_(0.0)
            ratio2 = torch.mul(ratio, ratio, out=slot(6))
            # log π_train at the positions used; NaN·0 (a NaN or ±inf in padding or a dropped row) → 0
            if buf is None:  # (a used position has a finite log ρ, so a finite π_train log-prob)
                old_used = torch.where(mask > 0, self.old_log_prob.to(torch.float32), 0.0)
            else:
                old_used = torch.mul(self.old_log_prob, mask, out=slot(3)).nan_to_num_(nan=0.0)
            slots += [old_used, k3, ratio, ratio2]
        # One reduction for every per-row sum, spanning the group when the rows are split. The
        # partials exchanged come from the collect pass, where a rank may not yet know that a row
        # is dropped: the group's sums of a dropped row are set to those of an empty row (0) here.
        # Compiled, each slot is reduced on its own (stacking the (B, T) slots first would make the
        # compiler write the whole stack to memory and read it back; separate sums fuse into the
        # pass that computes them).
        sums = self.reduce_sum(buf.sum(-1) if buf is not None else torch.stack([s.sum(-1) for s in slots]))
        if rows is not None:
            sums[1:].mul_(good)
            rows.drop(~good)
        self._set_row_sums(sums)

    def _set_row_sums(self, sums: torch.Tensor) -> None:
        """``row_sums`` ((slots, B) float32, rows in :attr:`_SLOTS` order) and the counts read off it."""
        self.row_sums = sums
        self.n_row_input, self.n_row, self.row_sum = sums[0], sums[1], sums[2]
        counted = sums[:2] > 0
        self.input_rows, self.row_valid = counted[0], counted[1]

    def _setup_native(self, response_mask: torch.Tensor, on_nonfinite: str, row_offset: int,
                      workspace: Optional[Workspace], outputs: Optional[frozenset],
                      mask_out: Optional[torch.Tensor]) -> None:
        """:meth:`_setup` in one fused sweep (:func:`.native.fused_pass`) for whole rows on CPU: the
        same attributes, with the off-policy sums as extra rows of ``row_sums`` — Σ clamp(log ρ),
        Σ k2, max k2, max k3 — that sequence-level rejection reads instead of a pass of its own."""
        self.response_mask = response_mask
        self._workspace = workspace
        self.native = True
        B, T = response_mask.shape
        wanted = TOKEN_OUTPUTS if outputs is None else outputs
        if workspace is not None:
            buf = workspace.slots[:, :B]  # overwritten: the previous batch using it must be finished
            self._free_slots = [buf[i] for i in (6, 3, 0)]  # slots the ATen pass needs and this one does not
        else:
            buf = None
            self._free_slots = []

        def take(i: int, name: Optional[str] = None) -> Optional[torch.Tensor]:
            if name is not None and name not in wanted:
                return None
            return buf[i] if buf is not None else torch.empty((B, T), dtype=torch.float32)

        mask, lr, ratio, k3 = take(1, "mask"), take(2, "log_ratio"), take(5, "ratio"), take(4, "k3")
        sums, good = native.fused_pass(self.old_log_prob, self.rollout_log_prob, response_mask, mask, lr, ratio, k3,
                                       keep=mask_out)
        if on_nonfinite == "raise" and not bool(good.all()):
            raise self._nonfinite_error(self.input_mask, ~good, row_offset)
        self._good_rows = good
        self._mask_out = mask_out
        for name, value in (("mask", mask), ("log_ratio", lr), ("ratio", ratio), ("k3", k3)):
            if value is not None:
                self.__dict__["_cached_" + name] = value
        self._native_sums = sums
        self._set_row_sums(sums[:len(self._SLOTS)])

    def band(self, x: torch.Tensor, mode: str, lo: float, hi: float, *, wlo: float = 0.0, whi: float = 0.0,
             zlo: float = 0.0, zhi: float = 0.0, transform: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A native batch's one-sweep band statistics of ``x`` (see :func:`.native.band`): the (B, T)
        tensor written (in a free workspace slot when there is one) and the (NSTAT, B) float64
        per-row statistics, spanning nothing beyond these rows (native batches hold whole rows)."""
        out = self._free_slots.pop() if self._free_slots else torch.empty(x.shape, dtype=torch.float32)
        return out, native.band(x, self.mask, out, mode, lo, hi, wlo=wlo, whi=whi, zlo=zlo, zhi=zhi,
                                transform=transform)

    def native_row_statistic(self, estimator: str, agg: str) -> Optional[torch.Tensor]:
        """Per-row Σ / mean / max of the divergence ``estimator`` read off the fused sweep's sums,
        or None when this batch did not take that sweep (or it does not hold that reduction)."""
        if not self.native:
            return None

        def row(name: str) -> torch.Tensor:
            return self._native_sums[native.PASS_ROWS.index(name)]

        if agg in ("seq_sum", "seq_mean"):
            total = -row("log_ratio_clamped") if estimator == "k1" else row(estimator)  # k1 = −clamp(log ρ)
            return total if agg == "seq_sum" else total / self.n_row.clamp_min(1.0)
        if agg == "seq_max" and estimator in ("k2", "k3"):
            return row(estimator + "_max")
        return None

    @cached
    def mask(self) -> torch.Tensor:
        """(B, T) float32 0/1 mask of the tokens used (input mask minus dropped rows); computed in
        the first pass, or here from ``mask_out`` on a native batch that did not write it."""
        if self._mask_out is None:
            raise RuntimeError("LogRatioBatch: the mask was neither written nor given as mask_out")
        return float_mask(self._mask_out)

    @cached
    def input_mask(self) -> torch.Tensor:
        """(B, T) float32 0/1 mask of the valid input tokens (before dropping rows)."""
        return float_mask(self.response_mask)

    @cached
    def log_ratio(self) -> torch.Tensor:
        """(B, T) float32 log ρ_t on the tokens used, 0 elsewhere (computed in the first pass;
        recomputed here, with the same arithmetic, only on a native batch that did not write it)."""
        lr = torch.sub(self.old_log_prob.to(torch.float32), self.rollout_log_prob.to(torch.float32))
        lr.nan_to_num_(nan=NONFINITE_SENTINEL, posinf=NONFINITE_SENTINEL, neginf=-NONFINITE_SENTINEL)
        return lr.mul_(self.mask)

    @cached
    def bad_rows(self) -> torch.Tensor:
        """(B,) bool: rows dropped for a non-finite value at a valid position."""
        return ~self._good_rows

    def _nonfinite_error(self, mask_in: torch.Tensor, bad_rows: torch.Tensor, row_offset: int) -> ValueError:
        b = int(bad_rows.nonzero()[0, 0])
        if self.old_log_prob is not None:
            row = self.old_log_prob[b].float() - self.rollout_log_prob[b].float()
        else:
            row = self._source_log_ratio[b].float()
        t = int(((mask_in[b] > 0) & ~(row.abs() < NONFINITE_SENTINEL)).nonzero()[0, 0])
        if self.old_log_prob is not None:
            values = (f"old_log_prob={self.old_log_prob[b, t].item()}, "
                      f"rollout_log_prob={self.rollout_log_prob[b, t].item()}")
        else:
            values = f"log_ratio={row[t].item()}"
        return ValueError(
            f"non-finite log-prob at valid position (row {b + row_offset}, column {t}; "
            f"|log-ratio| ≥ 1e30 counts as non-finite): {values}; "
            "fix the producer, or set on_nonfinite='reject' to drop such sequences")

    # -- token level -------------------------------------------------------------------
    @cached
    def valid(self) -> torch.Tensor:
        """(B, T) bool mask of the tokens used."""
        return self.mask > 0

    @cached
    def log_ratio_clamped(self) -> torch.Tensor:
        """clamp(log ρ_t, ±20); 0 at invalid positions."""
        return self.log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)

    @cached
    def ratio(self) -> torch.Tensor:
        """Safety-bounded ρ_t = exp(clamp(log ρ_t, ±20)) on valid tokens, 0 elsewhere."""
        return self.log_ratio_clamped.exp().mul_(self.mask)

    @cached
    def k3(self) -> torch.Tensor:
        """ρ_t − 1 − log ρ_t ≥ 0 on valid tokens, 0 elsewhere."""
        return (self.ratio - self.mask).sub_(self.log_ratio_clamped).clamp_min_(0.0)

    @cached
    def _pad_offset(self) -> torch.Tensor:
        """−1e30 at invalid positions, 0 at valid ones: x + this excludes padding from a max."""
        return (self.mask - 1.0).mul_(NONFINITE_SENTINEL)

    # -- sequence level ----------------------------------------------------------------
    @cached
    def row_mean(self) -> torch.Tensor:
        """mean_t log ρ_t per row (0 for empty rows), shape (B,)."""
        return self.row_sum / self.n_row.clamp_min(1.0)

    @cached
    def row_sums64(self) -> torch.Tensor:
        """:attr:`row_sums` in float64, (slots, B)."""
        return self.row_sums.double()

    @cached
    def row_means64(self) -> torch.Tensor:
        """(2, B) float64: mean_t log ρ_t and mean_t log π_train per row (0 for empty rows).

        NaN·0 at padding counts 0; rows with a non-finite valid value are dropped rows (their sum
        is discarded); absurd finite values are bounded at ±1e30 per token.
        """
        if self.old_log_prob is None:
            raise ValueError("this LogRatioBatch was built from a log-ratio alone "
                             "(LogRatioBatch.from_log_ratio); the perplexity metrics need the log-probs: "
                             "build it as LogRatioBatch(old_log_prob, rollout_log_prob, response_mask)")
        r = self.row_sums64
        means = r[2:4] / r[1].clamp_min(1.0)
        # the sums are 0 on empty and dropped rows (mask 0); bounding the mean bounds the sum per token
        return means.nan_to_num_(nan=0.0).clamp_(-NONFINITE_SENTINEL, NONFINITE_SENTINEL)

    @property
    def old_row_mean(self) -> torch.Tensor:
        """mean_t log π_train per row, float64, shape (B,)."""
        return self.row_means64[1]

    @cached
    def rollout_row_mean(self) -> torch.Tensor:
        """mean_t log π_rollout per row, float64, from old and the log-ratio (no extra pass)."""
        return self.row_means64[1] - self.row_means64[0]

    @property
    def row_sum64(self) -> torch.Tensor:
        """Σ_t log ρ_t per row in float64."""
        return self.row_sums64[2]

    # -- helpers for statistics ----------------------------------------------------------
    # Each returns a per-row (B,) part; SufficientStats reduces parts in float64, batched.
    # Every per-row reduction of token values goes through reduce_sum / reduce_max (or a helper
    # built on them), so that it spans the group when the rows are split (``rows``).
    def reduce_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The row's total of a per-row partial sum (B,) (the partial itself for whole rows)."""
        return partial if self.rows is None else self.rows.sum(partial)

    def reduce_max(self, partial: torch.Tensor) -> torch.Tensor:
        """The row's maximum of a per-row partial maximum (B,)."""
        return partial if self.rows is None else self.rows.max(partial)

    def reduce_min(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.rows is None else self.rows.min(partial)

    def row_total(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row Σ_t of a (B, T) tensor that is 0 at invalid positions."""
        return self.reduce_sum(x.sum(-1))

    def token_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over valid tokens of a (B, T) tensor that is 0 at invalid positions (per-row part)."""
        return self.row_total(x)

    def ratio_row_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Per-row Σ_t of ``x`` (0 at invalid positions); read off the batch's one reduction when
        ``x`` is :attr:`ratio` of a batch built from the log-probs."""
        if x is self.__dict__.get("_cached_ratio") and self.row_sums.shape[0] > 5:
            return self.row_sums[5]
        return self.row_total(x)

    def token_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row Σx and Σx² of a (B, T) tensor that is 0 at invalid positions, in float64.

        Squares are taken in float64: a variance E[x²] − E[x]² from float32 squares carries an
        absolute error of ~1e-7·E[x²], i.e. a spurious std of ~3e-4 for weights near 1.
        """
        if self._workspace is not None:  # a reused float64 buffer (no fresh pages per block)
            xd = self._workspace.float64(x.shape)
            xd.copy_(x)
        else:
            xd = x.to(torch.float64, copy=True)
        s = xd.sum(-1)
        return self.reduce_sum(s), self.reduce_sum(xd.mul_(xd).sum(-1))  # squares in place

    def above(self, x: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) float 0/1 indicator of x > threshold on valid tokens (x must be 0 elsewhere).

        Computed as sign(max(x − c, 0)) — exact, since a > c implies a − c > 0 in IEEE
        arithmetic — which is several times faster on CPU than a bool comparison and reduction.
        """
        ind = (x - threshold).clamp_min_(0.0).sign_()
        return ind.mul_(self.mask) if threshold < 0 else ind

    def below(self, x: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) float 0/1 indicator of x < threshold on valid tokens (x must be 0 elsewhere)."""
        ind = (threshold - x).clamp_min_(0.0).sign_()
        return ind.mul_(self.mask) if threshold > 0 else ind

    def token_max(self, x: torch.Tensor) -> torch.Tensor:
        """max over valid tokens (≤ −1e29 when there are none; callers check the count)."""
        if x.shape[-1] == 0:
            return self.reduce_max(torch.full(x.shape[:-1], -torch.inf, device=x.device))
        return self.reduce_max((x + self._pad_offset).amax(-1))

    def token_min(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == 0:
            return self.reduce_min(torch.full(x.shape[:-1], torch.inf, device=x.device))
        return self.reduce_min((x - self._pad_offset).amin(-1))

    def row_sum_of(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over valid rows of a (B,) tensor."""
        return torch.where(self.row_valid, x, 0.0)

    def row_count(self, cond: torch.Tensor) -> torch.Tensor:
        return cond & self.row_valid

    def row_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.row_valid, x, -torch.inf)

    def row_min(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.row_valid, x, torch.inf)

    def tokens_weighted_row_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ_rows n_row·x_row: the token sum of a per-row value broadcast over its tokens."""
        return self.n_row.double() * torch.where(self.row_valid, x.double(), 0.0)

    def add_counts(self, stats: SufficientStats) -> None:
        """Counts every statistic family divides by (recorded once per call). The rows dropped for
        a non-finite value are ``n_rows_input − n_rows`` (see ``nonfinite_metrics``)."""
        stats.add_sum("n_tok", self.n_row)
        stats.add_sum("n_rows", self.row_valid)
        stats.add_sum("n_rows_input", self.input_rows)

    def expand_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-row (B,) value over the row's valid tokens, 0 elsewhere; (B, T)."""
        return x.to(torch.float32).unsqueeze(-1) * self.mask

