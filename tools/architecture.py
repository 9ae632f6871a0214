"""The package's layers, as data; the import scanner that checks them; the picture of them.

    python tools/architecture.py            # rewrites docs/img/architecture.png

``LAYERS`` lists the modules from the bottom of the stack to the top. A module imports only from
layers below its own: tests/test_architecture.py checks it against the source with the scanner
here (``ast`` only, nothing is imported), and checks that every module is placed, so the picture
cannot drift from the code. The arrows in the picture are the real module-level imports.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SRC = ROOT / "src" / "rollout_correction"
PKG = "rollout_correction"
#: The product surfaces: packages that may use only the public names of the core.
SURFACES = ("compat", "integrations", "diagnose", "demo", "diffusion", "monitor")
#: The modules that may import the private package ``rollout_correction._src``: the package root and
#: the public seam modules that re-export its names. Every other module (the surfaces and the public
#: extension modules) imports public names only.
SEAMS = ("rollout_correction", "rollout_correction.primitives", "rollout_correction.reductions",
         "rollout_correction.vocabulary")


def is_private(module: str) -> bool:
    """``rollout_correction._src`` or a module inside it."""
    return module == f"{PKG}._src" or module.startswith(f"{PKG}._src.")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=None)
def imports(module: str, *, top_level_only: bool) -> tuple[tuple[str, str | None, int], ...]:
    """(imported module, imported name or None, line) for every import of ``module``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    nodes = ast.walk(tree) if not top_level_only else top_level(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == PKG]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(module, node)
            if target.split(".")[0] != PKG:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # "from pkg import module"
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, a.name, node.lineno))
    return tuple(out)


def top_level(tree: ast.Module):
    """Statements executed at import time: the module body, including if/try blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                stack.extend(block)


def where(module: str) -> str:
    path = MODULES[module]
    return str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name


def surface(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SURFACES else None


@functools.lru_cache(maxsize=None)
def public_names(module: str) -> set[str]:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        deps = set()
        for target, _, _ in imports(m, top_level_only=True):
            # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in MODULES and name != m:
                    deps.add(name)
        graph[m] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = GREY
        path.append(n)
        for d in sorted(graph[n]):
            # A package importing the modules inside it is how packages are built, not a cycle.
            if d.startswith(n + ".") and is_package(n):
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


#: (layer, what it holds, modules or packages of ``rollout_correction``), bottom first.
LAYERS: list[tuple[str, str, list[str]]] = [
    ("foundations", "constants, input checks, statistics, config words",
     ["constants", "validation", "stats", "_src", "vocab", "segments"]),
    ("config parts", "presets; loading", ["presets", "config_io"]),
    ("config, groups", "config; context-parallel row exchange", ["config", "sequence_group"]),
    ("per-token pieces", "log-ratio, loss terms, alignment",
     ["logratio", "policy_losses", "m2po", "alignment"]),
    ("estimators", "IS weights, rejection, metrics, masking",
     ["weights", "rejection", "metrics", "opsm"]),
    ("pipeline", "compute_rollout_correction", ["correction"]),
    ("entry points", "policy loss; packed inputs", ["losses", "packed"]),
    ("public API", "package root; the seams of the core",
     ["__init__", "primitives", "reductions", "vocabulary"]),
    ("extensions", "async RL; MoE; supports; advantages",
     ["staleness", "moe", "supports", "advantages"]),
    ("command support", "one-line errors, progress lines, report folders", ["console"]),
    ("surfaces", "public names of the core only",
     ["compat", "integrations", "diagnose", "demo", "diffusion", "monitor", "presets_cli"]),
    ("command", "rollout-correction <sub-command>", ["cli"]),
]


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of a dotted module name (``rollout_correction.x.y``), or None."""
    for i, (_, _, names) in enumerate(LAYERS):
        if box_name(module) in names:
            return i
    return None


def box_name(module: str) -> str:
    """The box a module is drawn in: its first component below the package (below ``_src`` for
    the internals)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "_src":
        return parts[2]
    return "__init__" if len(parts) == 1 else parts[1]


def label(box: str) -> str:
    """A box's file (``stats.py``, ``_src/config.py``) or folder (``native/``)."""
    if box == "__init__":
        return "rollout_correction/__init__"
    files = [base / f"{box}.py" for base in (SRC, SRC / "_src") if (base / f"{box}.py").is_file()]
    return files[0].relative_to(SRC).as_posix() if files else box + "/"


def edges() -> set[tuple[str, str]]:
    """(importing box, imported box) for every module-level import between two boxes."""
    out = set()
    for m in MODULES:
        for target, _, _ in imports(m, top_level_only=True):
            if box_name(target) != box_name(m):
                out.add((box_name(m), box_name(target)))
    return out


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    width, row_h, box_h = 16.6, 1.0, 0.5
    fig, ax = plt.subplots(figsize=(14, 9.5))
    centres: dict[str, tuple[float, float]] = {}
    colours = {"surfaces": "#f6d7b0", "command": "#e8e8e8", "public API": "#c9e4c5"}
    x0 = 3.3
    for i, (name, what, boxes) in enumerate(LAYERS):
        y = i * row_h
        ax.text(0.1, y + 0.08, name, fontsize=11, fontweight="bold", va="center")
        ax.text(0.1, y - 0.2, what, fontsize=7, color="#555", va="center", wrap=True)
        span = (width - 0.9 - x0) / len(boxes)
        for j, b in enumerate(boxes):
            w = min(span - 0.25, 3.2)
            cx = x0 + span * (j + 0.5)
            ax.add_patch(FancyBboxPatch((cx - w / 2, y - box_h / 2), w, box_h, boxstyle="round,pad=0.02",
                                        fc=colours.get(name, "#cfe0f3"), ec="#35506b", lw=1.0, zorder=3))
            ax.text(cx, y, label(b), ha="center", va="center", fontsize=9, zorder=4, family="monospace")
            centres[b] = (cx, y)
    core_top = next(i for i, (name, _, _) in enumerate(LAYERS) if name == "public API")
    for src, dst in sorted(edges()):
        # Arrows inside the core only; the surfaces' many imports of public names would hide them.
        if src in centres and dst in centres and layer_of(f"{PKG}.{src}") < core_top:
            (x1, y1), (x2, y2) = centres[src], centres[dst]
            ax.annotate("", xy=(x2, y2 + box_h / 2), xytext=(x1, y1 - box_h / 2),
                        arrowprops=dict(arrowstyle="-|>", color="#6f849a", lw=0.6, alpha=0.5, shrinkA=0, shrinkB=0,
                                        mutation_scale=7, connectionstyle="arc3,rad=0.06"), zorder=1)
    top = (core_top + 1) * row_h
    ax.annotate("", xy=(width - 0.15, (core_top - 1) * row_h), xytext=(width - 0.15, top),
                arrowprops=dict(arrowstyle="-|>", color="#b06a1f", lw=2.0, mutation_scale=14), zorder=2)
    ax.text(width - 0.3, core_top * row_h - 0.05, "public\nnames\nonly", ha="right", va="center", fontsize=8,
            color="#b06a1f")
    ax.set_xlim(0, width)
    ax.set_ylim(-0.7, (len(LAYERS) - 1) * row_h + 0.7)
    ax.axis("off")
    ax.set_title("rollout_correction: layers from the bottom up. Arrows: module-level imports inside the "
                 "core, all pointing down", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "img" / "architecture.png")
