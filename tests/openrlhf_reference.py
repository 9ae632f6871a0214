"""OpenRLHF's own code, loaded for the tests from an installed (``pip install --no-deps``) release.

The full OpenRLHF install pulls DeepSpeed, vLLM, Ray and flash-attn, far too heavy for CI. The
files on the tested path are executed unmodified from the release:

* ``cli/train_ppo_ray.py``: the body of its ``if __name__ == "__main__":`` block (the argparse
  block, ``hierarchize`` and the argument validation that fills defaults such as
  ``actor.eps_clip_low_high``), run on a real command line; its last statement, ``train(args)``
  (which starts Ray), is replaced by capturing ``args``;
* ``models/loss.py`` (``PolicyLoss``, ``aggregate_loss``), ``models/utils.py``,
  ``trainer/ppo_utils/experience.py`` and ``replay_buffer.py`` (``Experience``, the replay buffer
  that splits and re-collates experiences), ``utils/loss_utils.py`` (where ``batch_num_tokens`` /
  ``global_batch_size`` are counted), ``utils/config.py``, ``utils/utils.py``, ``utils/logging_utils.py``;
* ``trainer/ray/ppo_actor.py`` (``ActorPPOTrainer.__init__``, ``ppo_train``, ``training_step``,
  ``PolicyModelActor.append``), unedited (the recipe subclasses ``PolicyModelActor``).

Stand-ins, only for what the tested path imports but never runs, or runs only for hardware:
the package ``__init__`` files (they import every trainer, DeepSpeed and vLLM) are replaced by
bare packages over the real directories; ``deepspeed``, ``ray`` (``ray.remote`` → identity),
``openrlhf.models.Actor`` (the transformer; the tests pass a tiny policy), ``get_tokenizer``,
``DeepspeedStrategy`` (a type annotation), ``deepspeed_utils`` (offload helpers),
``distributed_util`` (NCCL group setup; the barrier is a no-op in one process),
``vlm_utils``, ``trainer/ray/launcher.py`` (``BaseModelActor``, a Ray actor base) and
``trainer/ray/utils.py`` (GPU ids). The DeepSpeed engine itself is stood in by
:class:`CpuStrategy` in the tests (backward with DeepSpeed's 1/gas scaling and an optimizer step
at every gas-th micro-batch). All stand-ins leave ``sys.modules`` after loading.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

OPENRLHF_VERSION = "0.10.4"
_EXTRA_SOURCES = "ROLLOUT_CORRECTION_OPENRLHF_SOURCES"  # os.pathsep-separated extra release roots


def installed_root() -> Path:
    version = importlib.metadata.version("openrlhf")  # raises if not installed: CI must install it
    assert version == OPENRLHF_VERSION, f"tests pin openrlhf=={OPENRLHF_VERSION}, found {version}"
    return Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0])


def source_roots() -> list[Path]:
    """The installed release, then every extra release root named in the environment (CI adds
    0.11.0, 0.11.1 and 0.11.2: the recipe runs on every supported release)."""
    roots = [installed_root()]
    for entry in filter(None, os.environ.get(_EXTRA_SOURCES, "").split(os.pathsep)):
        root = Path(entry)
        assert (root / "models" / "loss.py").is_file(), f"{_EXTRA_SOURCES}: {root} is not an openrlhf package"
        roots.append(root)
    return roots


def release_of(root: Path) -> str:
    for parent in list(root.parents)[:3]:  # site-packages, or an unpacked wheel's <x>.data/purelib
        for dist_info in parent.glob("openrlhf-*.dist-info"):
            return dist_info.name[len("openrlhf-"):-len(".dist-info")]
    raise AssertionError(f"no dist-info next to {root}")


def gate_options(root: Path | None = None) -> bool:
    """Whether the release's CLI has 0.11.2's ``is_correction_level`` / ``_mode`` / ``_gating``
    options (else ``is_correction_enable`` / ``is_correction_type``)."""
    root = root or installed_root()
    return "--algo.advantage.is_correction_level" in (root / "cli" / "train_ppo_ray.py").read_text()


GATE_OF_TYPE = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}


def correction_flags(root: Path | None, kind: str = "seq-mask-tis", threshold=("0.5", "5.0")) -> list[str]:
    """The release's command-line flags for an OpenRLHF correction type (0.11.2: its level and mode,
    gating ratio, which is the default)."""
    if gate_options(root):
        level, mode = GATE_OF_TYPE[kind]
        flags = ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode]
    else:
        flags = ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", kind]
    return flags + ["--algo.advantage.is_correction_threshold", *map(str, threshold)]


def enable_flags(root: Path | None) -> list[str]:
    """The flags that turn the correction on with the release's default type (0.11.2: level token)."""
    if gate_options(root):
        return ["--algo.advantage.is_correction_level", "token"]
    return ["--algo.advantage.is_correction_enable"]


_PACKAGES = ("openrlhf", "openrlhf.cli", "openrlhf.models", "openrlhf.utils", "openrlhf.utils.deepspeed",
             "openrlhf.trainer", "openrlhf.trainer.ppo_utils", "openrlhf.trainer.ray")


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class _StandInActor:  # openrlhf.models.Actor: a transformer; the tests pass a tiny policy instead
    pass


@contextmanager
def _openrlhf_modules(root: Path):
    """Bare packages over ``root`` and the stand-ins; everything inserted leaves ``sys.modules`` after."""
    saved = {name: mod for name, mod in sys.modules.items() if name == "openrlhf" or name.startswith("openrlhf.")}
    for name in saved:
        del sys.modules[name]
    inserted = []

    def put(name, module):
        if name in sys.modules and name not in saved:
            return
        sys.modules[name] = module
        inserted.append(name)

    try:
        for name in _PACKAGES:
            pkg = _module(name)
            pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
            put(name, pkg)
        if "deepspeed" not in sys.modules and importlib.util.find_spec("deepspeed") is None:
            put("deepspeed", _module("deepspeed"))
        if "ray" not in sys.modules and importlib.util.find_spec("ray") is None:
            put("ray", _module("ray", remote=lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda c: c))))
        put("openrlhf.utils.deepspeed.deepspeed_utils",
            _module("openrlhf.utils.deepspeed.deepspeed_utils", offload_deepspeed_states=None,
                    reload_deepspeed_states=None))
        put("openrlhf.utils.distributed_util",
            _module("openrlhf.utils.distributed_util", stateless_init_process_group=None,
                    torch_dist_barrier_and_cuda_sync=lambda: None))
        put("openrlhf.utils.vlm_utils", _module("openrlhf.utils.vlm_utils", merge_mm_train_inputs=None))
        put("openrlhf.trainer.ray.launcher", _module("openrlhf.trainer.ray.launcher", BaseModelActor=object))
        put("openrlhf.trainer.ray.utils", _module("openrlhf.trainer.ray.utils", get_physical_gpu_id=None))
        sys.modules["openrlhf.utils"].get_tokenizer = None
        sys.modules["openrlhf.utils.deepspeed"].DeepspeedStrategy = object
        yield
    finally:
        for name in inserted:
            sys.modules.pop(name, None)
        for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _import(name: str) -> types.ModuleType:
    return importlib.import_module(name)


def parse_cli(argv: list[str], root: Path | None = None):
    """``args`` exactly as ``python -m openrlhf.cli.train_ppo_ray <argv>`` hands them to ``train``."""
    root = root or installed_root()
    source = (root / "cli" / "train_ppo_ray.py").read_text()
    tree = ast.parse(source)
    main = next(node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
    body = list(main.body)
    last = body[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last) == "train(args)", ast.unparse(last)
    # The file's standard-library imports run as they are; the others (ray, the trainers) are not
    # used by the block.
    stdlib = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
              and all(name.split(".")[0] in sys.stdlib_module_names
                      for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]))]
    module = ast.Module(body=stdlib + body[:-1] + [ast.parse("_captured.append(args)").body[0]], type_ignores=[])
    captured: list = []
    namespace = {"_captured": captured, "__name__": "__main__"}
    old_argv = sys.argv
    with _openrlhf_modules(root):
        sys.argv = ["train_ppo_ray.py", *argv]
        try:
            exec(compile(module, str(root / "cli" / "train_ppo_ray.py"), "exec"), namespace)
        finally:
            sys.argv = old_argv
    return captured[0]


@contextmanager
def ppo_actor(root: Path | None = None):
    """OpenRLHF's ``ppo_actor`` module (and the real modules it uses), unedited, with the bare
    packages and stand-ins in ``sys.modules`` for the duration of the ``with`` block
    (``from openrlhf.models import PolicyLoss`` inside it gives the release's real class).
    Returns a namespace with ``ppo_actor``, ``loss``, ``experience``, ``replay_buffer`` and ``loss_utils``.
    """
    root = root or installed_root()
    path = root / "trainer" / "ray" / "ppo_actor.py"
    source = path.read_text()
    with _openrlhf_modules(root):
        loss = _import("openrlhf.models.loss")
        models = sys.modules["openrlhf.models"]
        models.PolicyLoss, models.aggregate_loss, models.Actor = loss.PolicyLoss, loss.aggregate_loss, _StandInActor
        replay_buffer = _import("openrlhf.trainer.ppo_utils.replay_buffer")
        sys.modules["openrlhf.trainer.ppo_utils"].NaiveReplayBuffer = replay_buffer.NaiveReplayBuffer
        name = "openrlhf.trainer.ray.ppo_actor"
        module = types.ModuleType(name)
        module.__file__ = str(path)
        module.__package__ = "openrlhf.trainer.ray"
        sys.modules[name] = module
        exec(compile(source, str(path), "exec"), module.__dict__)
        yield types.SimpleNamespace(
            ppo_actor=module, loss=loss, experience=_import("openrlhf.trainer.ppo_utils.experience"),
            replay_buffer=replay_buffer, loss_utils=_import("openrlhf.utils.loss_utils"), root=root,
        )


def policy_loss_class(root: Path | None = None):
    """The release's real ``PolicyLoss`` class."""
    with ppo_actor(root) as ns:
        return ns.loss.PolicyLoss
