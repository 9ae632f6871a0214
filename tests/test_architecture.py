"""The two packages' layering, read from the source with ``ast`` (nothing is imported).

* No import cycle among the modules of the core and the toolkit, counting every import (an import
  inside a function runs later and cannot deadlock the loader, but two modules that need each
  other are one concept split in two).
* The core (``rollout_correction_core``) ships on its own: it never imports the toolkit
  (``rollout_correction``), imports only torch and the standard library at module level (the
  optional readers inside functions are listed in ``tools/architecture.py``), holds nothing of the
  product surfaces, and stays within its line budget.
* The toolkit's modules other than its surfaces never import a surface (adapters depend on the
  core, not the reverse).
* Only the core's root and seams (``primitives``, ``reductions``, ``vocabulary``) and the toolkit's
  modules that re-export them may import the private package ``rollout_correction_core._src``
  (``tools/architecture.py`` ``SEAMS``). Every other module — the surfaces and the public extension
  modules (``moe``, ``staleness``, ``supports``, ``advantages``) — imports only names listed in a
  public module's ``__all__``, never a name starting with ``_``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "architecture", Path(__file__).resolve().parents[1] / "tools" / "architecture.py")
A = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(A)


def test_scanner_sees_both_packages():
    assert "rollout_correction_core._src.correction" in A.MODULES and "rollout_correction.compat.verl" in A.MODULES
    assert A.MODULES["rollout_correction_core"].parent == A.CORE_SRC
    assert A.MODULES["rollout_correction"].parent == A.SRC
    g = A.graph()
    assert "rollout_correction_core._src.metrics" in g["rollout_correction_core._src.correction"]
    assert "rollout_correction_core._src.config" in g["rollout_correction_core._src.weights"]
    assert "rollout_correction_core.primitives" in g["rollout_correction.primitives"]  # across the packages


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert A.find_cycle(g) == ["a", "b", "c", "a"]
    assert A.find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_at_import_time():
    cycle = A.find_cycle(A.graph(top_level_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_anywhere():
    """Imports inside functions included: two modules that import each other are one concept."""
    cycle = A.find_cycle(A.graph(top_level_only=False))
    assert cycle is None, "modules that import each other: " + " -> ".join(cycle)


def _core_modules() -> list[str]:
    return [m for m in A.MODULES if A.in_core(m)]


def test_the_core_never_imports_the_toolkit():
    bad = [f"{A.where(m)}:{line} imports {target}" for m in _core_modules()
           for target, _, line in A.imports(m, top_level_only=False) if target.split(".")[0] == A.PKG]
    assert not bad, "the core imports the toolkit (rollout_correction):\n" + "\n".join(bad)


def _foreign_imports(*, top_level_only: bool) -> list[tuple[str, str, int]]:
    """(core module, top-level package, line) for each import of the core that is neither the core,
    torch nor the standard library."""
    allowed = set(sys.stdlib_module_names) | {"torch", A.CORE}
    return [(m, target.split(".")[0], line) for m in _core_modules()
            for target, _, line in A.all_imports(m, top_level_only=top_level_only)
            if target.split(".")[0] not in allowed]


def test_the_core_imports_torch_and_the_standard_library_only():
    at_import = [f"{A.where(m)}:{line} imports {pkg}" for m, pkg, line in _foreign_imports(top_level_only=True)]
    assert not at_import, ("the core imports more than torch and the standard library at module level "
                           "(rollout-correction-core depends on torch alone):\n" + "\n".join(at_import))
    optional = sorted({pkg for _, pkg, _ in _foreign_imports(top_level_only=False)})
    assert optional == sorted(A.CORE_OPTIONAL_IMPORTS), (
        f"imports of the core inside functions: {optional}; tools/architecture.py lists "
        f"{list(A.CORE_OPTIONAL_IMPORTS)} (each must be optional, with an error naming the extra)")


def test_the_scanner_sees_a_planted_foreign_import(tmp_path, monkeypatch):
    monkeypatch.setitem(A.MODULES, "rollout_correction_core._src.planted", tmp_path / "planted.py")
    (tmp_path / "planted.py").write_text("import numpy as np\nfrom ..seams import x\n"
                                         "def f():\n    import rollout_correction.demo\n", encoding="utf-8")
    A.all_imports.cache_clear()
    A.imports.cache_clear()
    try:
        foreign = [(pkg, line) for m, pkg, line in _foreign_imports(top_level_only=True) if m.endswith("planted")]
        with pytest.raises(AssertionError, match=r"planted.py:4 imports rollout_correction.demo"):
            test_the_core_never_imports_the_toolkit()
    finally:
        A.all_imports.cache_clear()
        A.imports.cache_clear()
    assert foreign == [("numpy", 1)]


def test_the_core_holds_no_surface():
    """Nothing of the demo, diagnose, diffusion, the adapters, compat or the monitor is in the core:
    no module of it bears such a name, and no file under core/ (the sdist's too) is one of theirs."""
    words = A.SURFACES + ("cli", "presets_cli")
    bad = [m for m in _core_modules() if any(part in words for part in m.split("."))]
    bad += [str(p.relative_to(A.ROOT)) for p in (A.ROOT / "core").rglob("*")
            if any(part in words or part.removesuffix(".py") in words for part in p.relative_to(A.ROOT / "core").parts)]
    assert not bad, f"the core holds parts of the toolkit's surfaces: {bad}"


def test_the_core_is_within_its_line_budget():
    lines = A.core_lines()
    assert lines <= A.CORE_LINE_BUDGET, (f"the core (every .py under core/) has {lines} lines, over its budget of "
                                         f"{A.CORE_LINE_BUDGET}: move conveniences to the toolkit, remove duplication")


#: The one import below the surfaces: ``rollout_correction.vocabulary.SKYRL_KEYS`` / ``from_skyrl``, moved to
#: the SkyRL adapter in 0.3.0, import it when used under their former names (deprecated, gone in 0.4).
DEPRECATED_ALIAS_IMPORTS = {("rollout_correction.vocabulary", "rollout_correction.compat.skyrl")}


def test_the_toolkit_core_never_imports_a_surface():
    """The toolkit's root, re-export and extension modules build on the core, never on a surface."""
    bad = []
    for m in A.MODULES:
        if A.in_core(m) or A.surface(m) is not None or m == A.PKG:
            continue
        for target, _, line in A.imports(m, top_level_only=False):
            if A.surface(target) is not None and (m, target) not in DEPRECATED_ALIAS_IMPORTS:
                bad.append(f"{A.where(m)}:{line} imports {target}")
    assert not bad, "a module below the surfaces imports a surface:\n" + "\n".join(bad)


def _surface_imports():
    """(surface, importing module, imported module, imported name or None, line) for every import
    made by a module of a surface."""
    for m in A.MODULES:
        surface = A.surface(m)
        if surface is not None:
            for target, name, line in A.imports(m, top_level_only=False):
                yield surface, m, target, name, line


def _outside_imports():
    """(importing module, imported module, imported name or None, line) for every import made by a
    module that is neither private nor a seam (the surfaces and the public extension modules)."""
    for m in A.MODULES:
        if not A.is_private(m) and m not in A.SEAMS:
            for target, name, line in A.imports(m, top_level_only=False):
                yield m, target, name, line


def _private_core_imports() -> list[str]:
    bad = []
    for m, target, name, line in _outside_imports():
        if A.surface(target) is not None and A.surface(m) is not None:
            continue  # within the surfaces
        where = f"{A.where(m)}:{line}"
        if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
            bad.append(f"{where} imports the private module {target}")
        elif name is not None and (_private_name(name) or name not in A.public_names(target)):
            bad.append(f"{where} imports {target}.{name}, which is not in {target}.__all__")
    return bad


def _private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def test_only_the_seams_import_the_private_package():
    """The count the versioning policy rests on: no module but the core's root and seams (and the
    toolkit's modules that re-export them) names ``_src``."""
    importers = {m for m in A.MODULES if not A.is_private(m)
                 for target, _, _ in A.imports(m, top_level_only=False) if A.is_private(target)}
    assert set(A.CORE_SEAMS) <= importers <= set(A.SEAMS), \
        f"modules importing rollout_correction_core._src: {sorted(importers)}"


def test_every_private_name_is_public_somewhere():
    """Each name in a ``_src`` module's ``__all__`` is re-exported by the root or a seam, so code outside
    the core never needs the private package."""
    public = set().union(*(A.public_names(m) for m in A.SEAMS))
    missing = sorted(f"{m}.{n}" for m in A.MODULES if A.is_private(m) for n in A.public_names(m) if n not in public)
    assert not missing, f"private names without a public home (add them to a seam module): {missing}"


def test_surfaces_use_only_the_public_api_of_the_core():
    bad = _private_core_imports()
    assert not bad, "a surface reaches into the core:\n" + "\n".join(bad)


# The health monitor is a sink: the demo reports with it and the adapters feed it (its public API).
# The verl adapter's batch step is the verl drop-in's (one implementation of that function).
SURFACE_DEPENDENCIES = {("demo", "monitor"), ("integrations", "monitor"), ("integrations", "compat"),
                        ("diagnose", "demo")}  # diagnose --example samples with the demo's rollout engine


def test_surfaces_do_not_import_each_other():
    bad = [f"{A.where(m)}:{line} imports {target}" for surface, m, target, _, line in _surface_imports()
           if A.surface(target) not in (None, surface) and (surface, A.surface(target)) not in SURFACE_DEPENDENCIES]
    assert not bad, "a surface depends on another surface:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from rollout_correction_core._src.weights import _div\n", "private module rollout_correction_core._src.weights"),
    ("from rollout_correction_core.primitives import _slots\n", "primitives._slots"),
    ("from rollout_correction.primitives import ISWeights\nfrom .._src.stats import SufficientStats\n",
     "private module _src.stats"),
    ("from rollout_correction.reductions import _owner\n", "reductions._owner"),
])
def test_private_import_check_catches_a_planted_violation(tmp_path, monkeypatch, source, expected):
    # a module of the compat surface (relative imports resolve as for compat/verl.py)
    monkeypatch.setitem(A.MODULES, "rollout_correction.compat.planted", tmp_path / "planted.py")
    (tmp_path / "planted.py").write_text(source, encoding="utf-8")
    A.all_imports.cache_clear()  # the scanner caches what it read; this file is new each time
    A.imports.cache_clear()
    try:
        bad = [b for b in _private_core_imports() if "planted" in b]
    finally:
        A.all_imports.cache_clear()
        A.imports.cache_clear()
    assert len(bad) == 1 and expected in bad[0].replace("rollout_correction.", ""), bad


def test_every_subcommand_suggests_an_extra_that_exists():
    import re
    import tomllib

    from rollout_correction import cli

    pyproject = tomllib.loads((A.SRC.parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(pyproject["project"]["optional-dependencies"])
    for command in cli._COMMANDS:
        hint = cli.install_hint(command)
        (extra,) = re.findall(r"\[([\w-]+)\]'$", hint)  # 'rollout-correction[x]' or '<checkout>[x]'; -e
        assert extra in extras, f"`rollout-correction {command}` suggests {hint!r}, but pyproject has no [{extra}]"


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in A.MODULES if A.layer_of(m) is None)
    assert not unplaced, (f"modules without a layer: {unplaced}; add each to LAYERS in tools/architecture.py "
                          "(then run: python tools/architecture.py)")


def test_modules_import_only_from_lower_layers():
    bad = []
    for m in A.MODULES:
        mine = A.layer_of(m)
        for target, _, line in A.imports(m, top_level_only=True):
            theirs = A.layer_of(target)
            if A.box_name(target) != A.box_name(m) and theirs is not None and theirs >= mine:
                bad.append(f"{A.where(m)}:{line} ({A.LAYERS[mine][0]}) imports {target} ({A.LAYERS[theirs][0]})")
    assert not bad, ("imports that do not go down the stack (move the module to a higher layer in "
                     "tools/architecture.py, or the import down):\n" + "\n".join(bad))


def test_layer_check_catches_an_upward_import(monkeypatch):
    monkeypatch.setattr(A, "LAYERS", [("low", "", ["correction", "metrics"]), ("high", "", ["logratio"])]
                        + [(n, w, [x for x in mods if x not in ("correction", "metrics", "logratio")])
                           for n, w, mods in A.LAYERS])
    assert A.layer_of("rollout_correction_core._src.metrics") == 0 and A.layer_of("rollout_correction_core._src.logratio") == 1
    with pytest.raises(AssertionError, match="metrics.py:.*imports rollout_correction_core._src.logratio"):
        test_modules_import_only_from_lower_layers()


def test_architecture_page_names_every_module():
    """docs/architecture.md gives every module of both packages its own mention: a module of the
    core as `_src/name.py` or `name.py`, a toolkit module by its path (`diagnose/readers.py`), or —
    inside a sub-folder laid out like another (`diffusion/example/`) — the folder and the file name;
    the two roots as `rollout_correction_core/__init__.py` and `rollout_correction/__init__.py`."""
    page = (A.ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for module, path in A.MODULES.items():
        base = A.CORE_SRC if A.in_core(module) else A.SRC
        rel = path.relative_to(base)
        if rel.name == "__init__.py" and len(rel.parts) > 1:
            continue  # a package is described by its folder's paragraph
        named = f"`{rel.as_posix()}`" in page or (
            len(rel.parts) > 2 and f"`{rel.parent.as_posix()}/`" in page and f"`{rel.name}`" in page)
        if rel.as_posix() == "__init__.py":
            named = f"`{base.name}/__init__.py`" in page
        if not named:
            missing.append(f"{base.name}/{rel.as_posix()}")
    assert not missing, f"docs/architecture.md does not describe: {missing}"
