"""prime-rl's own loss code, loaded for the side-by-side tests from a prime-rl source checkout.

prime-rl publishes no package on PyPI, so the files are read from a checkout named by
``$ROLLOUT_CORRECTION_PRIME_RL_SOURCE`` (the directory holding ``src/prime_rl``), at commit
:data:`COMMIT` (2026-08-21, PR #3337: IPO's threshold default is still 0.1 with ``kl_tau`` 1e-3; #3418
and #3586 later made IPO the only default with 0.3 and no KL term). The two files are checked
against their SHA-256 at that commit, so a checkout at another commit fails loudly instead of
comparing against different code. The test that uses them is marked ``nightly``
(docs/methods.md, "prime-rl's losses").

Executed unmodified:

* ``src/prime_rl/trainer/rl/loss.py`` — the whole module: ``LossInputs``, ``ipo_loss_fn``,
  ``setup_rl_loss_fn``, ``compute_loss`` (the per-sample loop and the division by ``rl_scale``);
* the classes ``DefaultLossConfig``, ``IPOLossConfig``, ``CustomLossConfig`` and the alias
  ``LossConfig`` of ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` (compiled from
  that file's own source text).

Stand-ins, for imports the tested path never calls: ``beartype`` (only the type checker of the
``selective_log_softmax`` / ``compute_entropy`` decorators, when beartype is not installed),
``prime_rl.utils.utils.import_object`` (only ``CustomLossConfig``'s path) and the configs'
base class (``pydantic_config.BaseConfig``, a pydantic model: ``pydantic.BaseModel`` with unknown
keys refused). They are in ``sys.modules`` only while the module is executed.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import pytest

COMMIT = "559b44772e471d1538537b8805cc77f3824a5e64"
_SOURCE = "ROLLOUT_CORRECTION_PRIME_RL_SOURCE"
LOSS = Path("src/prime_rl/trainer/rl/loss.py")
CONFIGS = Path("packages/prime-rl-configs/src/prime_rl/configs/trainer.py")
#: SHA-256 of the two files at :data:`COMMIT`.
SHA256 = {LOSS: "102b14539a2aa7e4b807967f9c9caeaaa974373391a21602ce45b24414fb7863",
          CONFIGS: "8e9dfae7baf22c7eecd0238ddde47f2f2073763b6b9ef6315a0878f9d287c4d6"}
CONFIG_CLASSES = ("DefaultLossConfig", "IPOLossConfig", "CustomLossConfig")


def source_root() -> Path:
    """The checkout (the directory holding ``src/prime_rl``), its two files checked."""
    root = os.environ.get(_SOURCE)
    if not root:
        pytest.skip(f"{_SOURCE} is not set: point it at a prime-rl checkout at {COMMIT} "
                    "(docs/methods.md, \"prime-rl's losses\")")
    root = Path(root)
    for rel, digest in SHA256.items():
        path = root / rel
        assert path.is_file(), f"{path} is missing: {_SOURCE} must name a prime-rl checkout"
        got = hashlib.sha256(path.read_bytes()).hexdigest()
        assert got == digest, f"{path} is not the file of prime-rl {COMMIT} (sha256 {got}); check out that commit"
    return root


def _config_module(root: Path) -> types.ModuleType:
    """``prime_rl.configs.trainer`` holding its own loss config classes, compiled from the file."""
    import pydantic

    class BaseConfig(pydantic.BaseModel):  # pydantic_config.BaseConfig: a pydantic model, unknown keys refused
        model_config = pydantic.ConfigDict(extra="forbid")

    path = root / CONFIGS
    tree = ast.parse(path.read_text(encoding="utf-8"))
    keep = [node for node in tree.body
            if (isinstance(node, ast.ClassDef) and node.name in CONFIG_CLASSES)
            or (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "LossConfig")]
    found = {getattr(n, "name", None) or n.target.id for n in keep}
    assert found == {*CONFIG_CLASSES, "LossConfig"}, f"{path} no longer defines {CONFIG_CLASSES} and LossConfig"
    module = types.ModuleType("prime_rl.configs.trainer")
    module.__dict__.update(BaseConfig=BaseConfig, Field=pydantic.Field, Literal=Literal, Any=Any,
                           Annotated=Annotated, TypeAlias=TypeAlias)
    with _stand_ins({module.__name__: module}):  # pydantic resolves the annotations in the class's module
        exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), module.__dict__)
        for name in CONFIG_CLASSES:
            getattr(module, name).model_rebuild()
    return module


@contextlib.contextmanager
def _stand_ins(modules: dict[str, types.ModuleType]):
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def loss_module() -> types.ModuleType:
    """prime-rl's ``loss.py``, executed from the checkout under a private name."""
    root = source_root()
    pytest.importorskip("jaxtyping")  # loss.py annotates LossInputs with jaxtyping types
    configs = _config_module(root)
    utils = types.ModuleType("prime_rl.utils.utils")
    utils.import_object = lambda path: getattr(importlib.import_module(path.rpartition(".")[0]), path.rpartition(".")[2])
    modules = {"prime_rl": types.ModuleType("prime_rl"), "prime_rl.configs": types.ModuleType("prime_rl.configs"),
               "prime_rl.configs.trainer": configs, "prime_rl.utils": types.ModuleType("prime_rl.utils"),
               "prime_rl.utils.utils": utils}
    if importlib.util.find_spec("beartype") is None:
        beartype = types.ModuleType("beartype")
        beartype.beartype = None  # jaxtyped(typechecker=None): shapes are not checked at run time
        modules["beartype"] = beartype
    with _stand_ins(modules):
        spec = importlib.util.spec_from_file_location("prime_rl_reference_loss", root / LOSS)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    module.configs = configs
    return module
