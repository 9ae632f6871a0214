"""The package's layering, read from the source with ``ast`` (nothing is imported).

* No import cycle among the package's modules (module-level imports; an import inside a
  function runs later and cannot deadlock the loader, but the core has none of those either
  towards the surfaces).
* The core never imports a product surface (adapters depend on the core, not the reverse).
* A surface imports from the core only public names: names listed in the core module's
  ``__all__`` (or the package's), never a name starting with ``_``, never a private module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rollout_correction"
PKG = "rollout_correction"
SURFACES = ("compat", "integrations", "diagnose", "demo", "diffusion", "monitor")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, *, top_level_only: bool) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of ``module``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if not top_level_only else _top_level(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.split(".")[0] != PKG:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # "from pkg import module"
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, a.name, node.lineno))
    return out


def _top_level(tree: ast.Module):
    """Statements executed at import time: the module body, including if/try blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                stack.extend(block)


def _where(module: str) -> str:
    path = MODULES[module]
    return str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name


def _surface(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SURFACES else None


def _all(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        deps = set()
        for target, _, _ in _imports(m, top_level_only=True):
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in MODULES and name != m:
                    deps.add(name)
        graph[m] = deps
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        path.append(n)
        for d in sorted(graph[n]):
            # A package importing its own submodules is how packages are built, not a cycle.
            if n == d.rsplit(".", 1)[0] and _is_package(n):
                continue
            if color[d] == GREY:
                return path[path.index(d):] + [d]
            if color[d] == WHITE:
                found = visit(d)
                if found:
                    return found
        path.pop()
        color[n] = BLACK
        return None

    for n in sorted(graph):
        if color[n] == WHITE:
            found = visit(n)
            if found:
                return found
    return None


def test_scanner_sees_the_package():
    assert "rollout_correction.correction" in MODULES and "rollout_correction.compat.verl" in MODULES
    g = _graph()
    assert "rollout_correction.metrics" in g["rollout_correction.correction"]
    assert "rollout_correction.config" in g["rollout_correction.weights"]


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(g) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_never_imports_a_surface():
    bad = []
    for m in MODULES:
        if _surface(m) is not None or m == PKG:
            continue
        for target, _, line in _imports(m, top_level_only=False):
            if _surface(target) is not None:
                bad.append(f"{MODULES[m].name}:{line} imports {target}")
    assert not bad, "the core imports a surface:\n" + "\n".join(bad)


def _surface_imports():
    """(surface, importing module, imported module, imported name or None, line) for every import
    made by a module of a surface."""
    for m in MODULES:
        surface = _surface(m)
        if surface is not None:
            for target, name, line in _imports(m, top_level_only=False):
                yield surface, m, target, name, line


def _private_core_imports() -> list[str]:
    bad = []
    for _, m, target, name, line in _surface_imports():
        if _surface(target) is not None:
            continue  # within the surfaces
        where = f"{_where(m)}:{line}"
        if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
            bad.append(f"{where} imports the private module {target}")
        elif name is not None and (name.startswith("_") or name not in _all(target)):
            bad.append(f"{where} imports {target}.{name}, which is not in {target}.__all__")
    return bad


def test_surfaces_use_only_the_public_api_of_the_core():
    bad = _private_core_imports()
    assert not bad, "a surface reaches into the core:\n" + "\n".join(bad)


def test_surfaces_do_not_import_each_other():
    bad = [f"{_where(m)}:{line} imports {target}" for surface, m, target, _, line in _surface_imports()
           if _surface(target) not in (None, surface)]
    assert not bad, "a surface depends on another surface:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("from rollout_correction.weights import _div\n", "weights._div"),
    ("from ..stats import SufficientStats\nfrom ..logratio import cached\n", "logratio.cached"),
])
def test_private_import_check_catches_a_planted_violation(tmp_path, monkeypatch, source, expected):
    # a module of the compat surface (relative imports resolve as for compat/verl.py)
    monkeypatch.setitem(MODULES, "rollout_correction.compat.planted", tmp_path / "planted.py")
    (tmp_path / "planted.py").write_text(source, encoding="utf-8")
    bad = [b for b in _private_core_imports() if "planted" in b]
    assert len(bad) == 1 and expected in bad[0].replace("rollout_correction.", ""), bad


def test_every_subcommand_suggests_an_extra_that_exists():
    import re
    import tomllib

    from rollout_correction import cli

    pyproject = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    extras = set(pyproject["project"]["optional-dependencies"])
    for command in cli._COMMANDS:
        hint = cli.install_hint(command)
        (extra,) = re.findall(r"rollout-correction\[([\w-]+)\]", hint)
        assert extra in extras, f"`rollout-correction {command}` suggests {hint!r}, but pyproject has no [{extra}]"
