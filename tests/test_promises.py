"""What docs/api.md promises, held to the packages.

The page's section "The promised API" has one entry per promised name, a level-4 heading holding a
code span, in one of four forms:

* ``name(parameters)`` or ``Class.method(parameters)`` (a method of a promised class: an extra entry):
  the parameters must be those of ``inspect.signature`` — names, order, kinds (``*``, ``*args``,
  ``**kwargs``) and defaults (evaluated in the root's namespace and compared with ``==``; a dataclass
  field's ``default_factory`` is called). A default written ``…`` only says that there is one; a
  trailing ``…`` allows further parameters after those shown, each optional;
* ``class Name(Base, ...)``: ``Name`` is a class derived from each base;
* ``NAME = literal``: ``NAME`` equals it;
* ``NAME: type``: ``NAME`` is an instance of that builtin type.

The subjects of those entries are exactly the root's ``__all__``, at most 40 names (the page states
their number), each importable from ``rollout_correction_core`` and, the same object or the toolkit's
0.2-keyword wrapper of it, from ``rollout_correction``. The page's provisional modules exist, and
every public module of both packages is either the root or one of them.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import rollout_correction
import rollout_correction_core

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
MAX_PROMISED = 40


def _section(title: str) -> str:
    return PAGE.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


PROMISED = _section("The promised API")
ENTRIES = re.findall(r"^#### `(.+)`$", PROMISED, flags=re.M)


def _subject(entry: str) -> str:
    """The documented name of an entry: ``Name`` or ``Class.method``."""
    return re.match(r"(?:class )?([\w.]+)", entry).group(1)


def _resolve(subject: str):
    obj = rollout_correction_core
    for part in subject.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_promise_is_the_root_and_at_most_40_names():
    names = [_subject(e) for e in ENTRIES if "." not in _subject(e)]
    assert len(names) == len(set(names)), "a name has two entries"
    assert sorted(names) == sorted(rollout_correction_core.__all__)
    assert len(names) <= MAX_PROMISED
    stated = {int(n) for n in re.findall(r"The (\d+) names of", PAGE)}
    assert stated == {len(names)}, f"the page states {stated} promised names; it lists {len(names)}"
    methods = [_subject(e) for e in ENTRIES if "." in _subject(e)]
    assert all(m.split(".")[0] in names for m in methods), methods


@pytest.mark.parametrize("name", rollout_correction_core.__all__)
def test_every_promised_name_is_importable_from_both_roots(name):
    from rollout_correction import _compat

    core_obj = getattr(importlib.import_module("rollout_correction_core"), name)
    toolkit_obj = getattr(importlib.import_module("rollout_correction"), name)
    assert name in rollout_correction.__all__
    if name in _compat.__all__:  # the entry points that also take the 0.2 keywords (through 0.3.x)
        assert toolkit_obj is getattr(_compat, name) and toolkit_obj.__doc__.startswith(core_obj.__doc__)
    else:
        assert toolkit_obj is core_obj


def _shown_parameters(text: str) -> tuple[list[tuple[str, str, object]], bool]:
    """(name, kind, default expression or None or ...) of each parameter shown, and whether more may follow."""
    text = text.strip()
    more = text == "…" or text.endswith(", …")
    if more:
        text = text[:-1].rstrip().rstrip(",")
    args = ast.parse(f"def f({text.replace('=…', '=...')}): pass").body[0].args
    out = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out += [(a.arg, "POSITIONAL_OR_KEYWORD", d) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", None))
    out += [(a.arg, "KEYWORD_ONLY", d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", None))
    return out, more


def _actual_default(owner, name: str, param: inspect.Parameter):
    """The default of ``param``; a dataclass field's factory is called."""
    if repr(param.default) == "<factory>" and dataclasses.is_dataclass(owner):
        return {f.name: f for f in dataclasses.fields(owner)}[name].default_factory()
    return param.default


def check_signature(entry: str) -> None:
    subject, params = re.fullmatch(r"([\w.]+)\((.*)\)", entry).groups()
    obj = _resolve(subject)
    actual = list(inspect.signature(obj).parameters.values())
    if "." in subject and actual and actual[0].name == "self":
        actual = actual[1:]  # a method read on its class
    shown, more = _shown_parameters(params)
    assert [(p.name, p.kind.name) for p in actual[:len(shown)]] == [(n, k) for n, k, _ in shown], \
        f"{subject}: shown {[(n, k) for n, k, _ in shown]}, actual {[(p.name, p.kind.name) for p in actual]}"
    for (name, _, default), param in zip(shown, actual):
        if default is None:
            assert param.default is inspect.Parameter.empty or param.kind.name.startswith("VAR"), \
                f"{subject}: {name} has a default ({param.default!r}) the page does not show"
        elif isinstance(default, ast.Constant) and default.value is Ellipsis:
            assert param.default is not inspect.Parameter.empty, f"{subject}: {name} has no default"
        else:
            expected = eval(ast.unparse(default), vars(rollout_correction_core))  # noqa: S307 - the page's own text
            assert _actual_default(obj, name, param) == expected, f"{subject}: {name}={param.default!r}"
    rest = actual[len(shown):]
    assert not rest or more, f"{subject}: parameters the page does not show: {[p.name for p in rest]}"
    assert all(p.default is not inspect.Parameter.empty or p.kind.name.startswith("VAR") for p in rest), \
        f"{subject}: a required parameter hides behind '…'"


@pytest.mark.parametrize("entry", ENTRIES, ids=_subject)
def test_every_entry_is_the_code(entry):
    if entry.startswith("class "):
        name, bases = re.fullmatch(r"class (\w+)\((.*)\)", entry).groups()
        cls = _resolve(name)
        for base in (b.strip() for b in bases.split(",")):
            assert issubclass(cls, getattr(builtins, base, None) or _resolve(base)), (name, base)
    elif " = " in entry:
        name, literal = entry.split(" = ", 1)
        assert _resolve(name) == ast.literal_eval(literal), name
    elif re.fullmatch(r"[\w.]+: \w+", entry):
        name, kind = entry.split(": ")
        assert isinstance(_resolve(name), getattr(builtins, kind)), name
    else:
        check_signature(entry)


def test_the_signature_check_fails_on_a_drifted_entry():
    """The checker sees a renamed parameter, a changed default, a missing one and a hidden required one."""
    check_signature("ClipRange(low=0.2, high=0.2, dual=3.0)")
    check_signature("ClipRange(low=0.2, …)")
    for drifted in ("ClipRange(low=0.2, high=0.2, c=3.0)", "ClipRange(low=0.1, high=0.2, dual=3.0)",
                    "ClipRange(low=0.2, high=0.2)", "ClipRange(low=0.2, high=…, dual=3.0, extra=1)",
                    "rejection_mask(old_log_prob, rollout_log_prob, response_mask, criterion, …)",
                    "agg_loss(loss_mat, loss_mask, aggregation=Aggregation(), parallel=None, count_mask=None)"):
        with pytest.raises(AssertionError):
            check_signature(drifted)


def _provisional_modules() -> list[str]:
    section = _section("What is promised, and what is provisional")
    provisional = section.split("**Provisional**", 1)[1].split("**Not public**", 1)[0]
    return sorted(set(re.findall(r"`(rollout_correction(?:_core)?\.[\w.]+)`", provisional)))


def test_every_provisional_module_exists_and_every_public_module_is_named():
    listed = _provisional_modules()
    for module in listed:
        importlib.import_module(module)
    public = [f"{pkg.__name__}.{m.name}" for pkg in (rollout_correction_core, rollout_correction)
              for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    missing = [m for m in public if m not in listed]
    assert not missing, f"public modules docs/api.md neither promises nor lists as provisional: {missing}"
    # the reference tables at the end of the page cover provisional modules only
    tables = re.findall(r"^### `([\w.]+)`$", _section("Provisional modules"), flags=re.M)
    assert set(tables) <= set(listed) and "rollout_correction_core" not in tables
