"""Count the ATen operations and host syncs of one correction call, ours against verl 0.9.1.

Not a test: it prints counts and ratios. On a GPU this computation is launch-bound (a (B, T)
batch of log-probs is a few microseconds of memory traffic; every ATen operation is a kernel
launch of several microseconds, every host read stalls the stream), so the number of dispatched
operations is the measurable proxy for GPU time on a machine without a GPU.

What is counted, per call, with a ``TorchDispatchMode`` (every operation that reaches the ATen
dispatcher below autograd):

* **ops**: every dispatched operation **except** views and metadata-only operations, which
  launch no kernel: operations whose schema marks them as views (``select``, ``slice``,
  ``view``, ``unsqueeze``, ``expand``, ``unbind``, ``as_strided``, ``t``, ``reshape`` as a
  view, …), plus ``detach``, ``alias``, ``lift_fresh`` and the ``sym_*`` / ``size`` / ``stride``
  / ``numel`` / ``dim`` queries. Allocations (``empty``, ``full``, …) are counted.
* **syncs**: host reads of device values — ``aten::_local_scalar_dense`` (``.item()``,
  ``float(t)``, ``bool(t)``, ``int(t)``) plus calls of ``Tensor.tolist()`` / ``Tensor.numpy()``
  (which read memory directly and are invisible to the dispatcher; counted by wrapping them
  during the call).
* **dynamic**: operations whose output shape depends on the data (``nonzero``,
  ``masked_select``, ``unique``, boolean indexing, …): they sync too and cannot be captured in
  a CUDA graph.

Implementations, for each of the 9 configurations of ``benchmarks/bench_vs_verl.py``:

* ``ours``: ``compute_rollout_correction(...).metrics_as_floats()``; ``ours (no read)``: the
  call alone, metrics left unread.
* ``drop-in``: ``rollout_correction.compat.verl.compute_rollout_correction_and_rejection_mask``
  (returns float metrics, like verl's).
* ``verl``: verl 0.9.1's ``compute_rollout_correction_and_rejection_mask`` (the installed file,
  see ``tests/verl_reference.py``).
* ``loss``: ``compute_policy_loss`` in bypass mode (the correction computed inside, PPO clip
  against π_rollout) with its metrics read as floats (``metrics_to_floats``); ``verl loss``:
  verl 0.9.1's ``compute_policy_loss_bypass_mode`` with the same settings (it returns floats).
  Forward only.

Usage::

    python benchmarks/bench_dispatch.py                 # B=64, T=512, fp32
    python benchmarks/bench_dispatch.py --shape 256x4096 --ops   # also list the ops of each call
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable


import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from bench_vs_verl import CASES, DTYPES, Case, make_inputs, our_config  # noqa: E402
from verl_reference import (load_verl_algorithm_config, load_verl_core_algos,  # noqa: E402
                            load_verl_rollout_corr_helper)

import rollout_correction as rc  # noqa: E402
from rollout_correction.compat import verl as dropin  # noqa: E402

_METADATA = {"detach", "alias", "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "size", "stride", "numel", "dim", "is_contiguous", "is_same_size", "_has_compatible_shallow_copy_type"}
_SYNC = {"_local_scalar_dense", "is_nonzero", "item"}
_DYNAMIC = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
            "repeat_interleave", "masked_scatter", "argwhere", "_nested_tensor_from_mask"}


def _base(func: Any) -> str:
    return func._schema.name.split("::")[-1]


def _is_view(func: Any) -> bool:
    return bool(getattr(func, "is_view", False))


class OpCounter(TorchDispatchMode):
    """Counts dispatched ATen operations by kind (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.excluded = 0
        self.syncs = 0
        self.dynamic: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _base(func)
        if name in _SYNC:
            self.syncs += 1
        if name in _DYNAMIC or (name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []))):
            self.dynamic[name] += 1
        if _is_view(func) or name in _METADATA:
            self.excluded += 1
        else:
            self.ops[str(func.overloadpacket).replace("aten.", "")] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_host_reads(counter: OpCounter):
    """Count Tensor.tolist / Tensor.numpy calls (host reads the dispatcher does not see)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(name: str, fn: Callable) -> Callable:
        def read(self, *args, **kwargs):
            counter.syncs += 1
            return fn(self, *args, **kwargs)

        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def count(fn: Callable[[], Any]) -> OpCounter:
    """Run ``fn`` once to warm up (lazy imports, caches), then count one call."""
    fn()
    counter = OpCounter()
    with counting_host_reads(counter), counter:
        fn()
    return counter


def _verl_loss_config(case: Case):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    algo = load_verl_algorithm_config()
    kwargs = case.verl_kwargs()
    rc_cfg = algo.RolloutCorrectionConfig(bypass_mode=True, loss_type="ppo_clip", **kwargs)
    policy_loss = PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=rc_cfg)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean",
                       policy_loss=policy_loss)


def runners(case: Case, inputs) -> dict[str, Callable[[], Any]]:
    old, rollout, mask = inputs
    verl = load_verl_rollout_corr_helper()
    algos = load_verl_core_algos()
    cfg = our_config(case)
    loss_cfg = rc.RolloutCorrectionConfig.from_dict({**case.settings(), "bypass_mode": True, "loss_type": "ppo_clip"})
    verl_loss_cfg = _verl_loss_config(case)
    gen = torch.Generator().manual_seed(1)
    log_prob = (old.float() + 0.05 * torch.randn(old.shape, generator=gen)).to(old.dtype)
    adv = torch.randn(old.shape[0], 1, generator=gen).expand(old.shape).contiguous().to(old.dtype)
    kwargs = case.verl_kwargs()

    def loss():
        value, metrics = rc.compute_policy_loss(log_prob, rollout, adv, mask, config=loss_cfg, rollout_log_prob=rollout)
        return value, rc.metrics_to_floats(metrics)

    return {
        "ours": lambda: rc.compute_rollout_correction(old, rollout, mask, config=cfg).metrics_as_floats(),
        "ours (no read)": lambda: rc.compute_rollout_correction(old, rollout, mask, config=cfg),
        "drop-in": lambda: dropin.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs),
        "verl": lambda: verl.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs),
        "loss": loss,
        "verl loss": lambda: algos.compute_policy_loss_bypass_mode(rollout, log_prob, adv, mask,
                                                                   loss_agg_mode="token-mean", config=verl_loss_cfg),
    }


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64x512", help="BxT (default 64x512)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--ops", action="store_true", help="print the operations of each call")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    batch, length = (int(x) for x in args.shape.lower().split("x"))
    inputs = make_inputs(batch, length, DTYPES[args.dtype])
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    impls = ["ours", "ours (no read)", "drop-in", "verl", "loss", "verl loss"]
    rows = []
    for case in [c for c in CASES if not wanted or c.name in wanted]:
        counted = {name: count(fn) for name, fn in runners(case, inputs).items()}
        rows.append((case.name, counted))
        if args.ops:
            for name in impls:
                c = counted[name]
                print(f"-- {case.name} / {name}: {sum(c.ops.values())} ops, {c.syncs} syncs")
                print("   " + ", ".join(f"{op}×{n}" for op, n in c.ops.most_common()))

    print(f"ATen ops (views/metadata excluded) / host syncs / dynamic-shape ops per call; "
          f"B={batch}, T={length}, {args.dtype}, forward, 1 thread")
    head = ["configuration"] + impls + ["verl/ours", "verl/drop-in", "verl loss/loss"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    ratios: dict[str, list[float]] = {"verl/ours": [], "verl/drop-in": [], "verl loss/loss": []}
    for name, counted in rows:
        n = {k: sum(v.ops.values()) for k, v in counted.items()}
        cells = [name]
        for impl in impls:
            c = counted[impl]
            dyn = sum(c.dynamic.values())
            cells.append(f"{n[impl]} / {c.syncs}" + (f" / {dyn}" if dyn else ""))
        for key, (a, b) in {"verl/ours": ("verl", "ours"), "verl/drop-in": ("verl", "drop-in"),
                            "verl loss/loss": ("verl loss", "loss")}.items():
            ratios[key].append(n[a] / n[b])
            cells.append(f"{n[a] / n[b]:.2f}×")
        print("| " + " | ".join(cells) + " |")
    print()
    for key, values in ratios.items():
        print(f"geometric mean {key} (ops): {geometric_mean(values):.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
