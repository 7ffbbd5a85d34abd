"""The import graph of docs/architecture.md, enforced.

Every ``import`` in the source (module level and inside functions) is read
with ``ast``; each module is mapped to its layer (the first name under
``autopar``: ``cost``, ``search``, ``runtime``, ...). The rules below are the
architecture's dependency direction; a change that breaks one fails here,
with the importing file and line in the message.
"""
from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layers that may import anything below them never import these (the planner
# knows nothing of execution; the runtime nothing of planning)
FORBIDDEN = {
    "cost": {"search", "api", "compile", "runtime", "parallelize", "cli", "explain", "trace"},
    "sharding": {"search", "cost", "api", "compile", "runtime", "parallelize", "cli"},
    "strategies": {"search", "cost", "api", "compile", "runtime", "parallelize", "cli", "trace"},
    "graph": {"search", "cost", "api", "compile", "runtime", "parallelize", "cli", "trace", "strategies"},
    "plan": {"search", "cost", "api", "compile", "runtime", "parallelize", "cli", "trace"},
    "pipeline": {"search", "cost", "api", "compile", "runtime", "parallelize", "cli"},
    "search": {"api", "compile", "runtime", "parallelize", "cli"},
    "compile": {"api", "search", "cost", "parallelize", "cli", "explain"},
}
# the runtime executes: it may import only these (autopar.pipeline only for its schedule)
RUNTIME_ALLOWED = {"errors", "runtime", "spec", "pipeline.schedule"}
# the leaf vocabulary and the op registry import nothing of autopar but the errors
SPEC_ALLOWED = {"errors", "spec"}
OPS_ALLOWED = {"errors", "ops"}
# other frameworks' configs in and out: strategies and plans only, nothing that plans or runs
COMPAT_ALLOWED = {"errors", "spec", "plan", "compat"}


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """Absolute names of every module ``path`` imports (``from x import y``
    also yields ``x.y``, which may be a submodule), with their line."""
    mod = _dotted(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.lineno))
            out += [(f"{name}.{a.name}", node.lineno) for a in node.names]
    return out


def layer(name: str) -> str | None:
    """``autopar.search.ilp`` -> ``search``; the package root (``__version__``) and non-autopar -> None."""
    parts = name.split(".")
    if parts[0] != "autopar" or len(parts) < 2 or parts[1] in ("__version__",):
        return None
    return parts[1]


def _existing(name: str) -> bool:
    """Whether ``name`` is an autopar module (not a name imported from one)."""
    rel = ROOT.joinpath(*name.split("."))
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def _edges() -> list[tuple[str, str, str, int]]:
    """(importing layer, imported layer, file, line) for every autopar import."""
    out = []
    for path in _modules("autopar"):
        src = layer(_dotted(path))
        if src is None:
            continue
        for name, line in imports(path):
            dst = layer(name)
            if dst is not None and dst != src and _existing(name):
                out.append((src, dst, str(path.relative_to(ROOT)), line))
    return out


@pytest.mark.parametrize("src", sorted(FORBIDDEN))
def test_forbidden_imports(src):
    bad = [f"{f}:{line} imports autopar.{dst}" for s, dst, f, line in _edges()
           if s == src and dst in FORBIDDEN[src]]
    assert not bad, f"autopar.{src} must not import {sorted(FORBIDDEN[src])}:\n" + "\n".join(bad)


def test_runtime_is_a_leaf():
    bad = []
    for path in _modules("autopar/runtime"):
        for name, line in imports(path):
            if layer(name) is None or not _existing(name):
                continue
            rest = name.split(".", 1)[1]
            if not any(rest == a or rest.startswith(a + ".") for a in RUNTIME_ALLOWED):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "the runtime only executes; it imports only " + ", ".join(sorted(RUNTIME_ALLOWED)) + \
        ":\n" + "\n".join(bad)


def _imports_outside(package: str, allowed: set[str]) -> list[str]:
    """``file:line imports name`` for every autopar import of ``package`` outside the ``allowed`` layers."""
    return [f"{p.relative_to(ROOT)}:{line} imports {n}" for p in _modules(package)
            for n, line in imports(p) if layer(n) not in (None, *allowed) and _existing(n)]


def test_spec_is_a_leaf():
    assert (ROOT / "autopar" / "spec").is_dir(), "the strategy vocabulary lives in autopar/spec"
    bad = _imports_outside("autopar/spec", SPEC_ALLOWED)
    assert not bad, "\n".join(bad)


def test_ops_is_a_leaf():
    bad = _imports_outside("autopar/ops", OPS_ALLOWED)
    assert not bad, "\n".join(bad)


def test_compat_reads_and_writes_only_strategies_and_plans():
    bad = _imports_outside("autopar/compat", COMPAT_ALLOWED)
    assert not bad, "autopar.compat imports only " + ", ".join(sorted(COMPAT_ALLOWED)) + ":\n" + "\n".join(bad)


def test_cost_models_is_standalone():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {n}" for p in _modules("cost_models")
           for n, line in imports(p) if n.split(".")[0] in ("torch", "autopar")]
    assert not bad, "cost_models imports neither torch nor autopar:\n" + "\n".join(bad)


def test_no_package_cycle():
    deps: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, f, line in _edges():
        deps.setdefault(src, set()).add(dst)
        where.setdefault((src, dst), f"{f}:{line}")
    try:
        list(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        cycle = e.args[1]   # each entry is imported by the next one
        steps = [f"{b} -> {a} ({where[(b, a)]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("package cycle: " + "; ".join(steps))


def test_rules_can_fail():
    """The checker sees relative, absolute and function-level imports."""
    src = ROOT / "autopar" / "cost.py"
    if not src.exists():
        src = ROOT / "autopar" / "cost" / "__init__.py"
    names = {n for n, _ in imports(src)}
    assert any(layer(n) == "graph" for n in names)
    probe = ast.parse("def f():\n    from ..search import ilp\n")
    found = [n for n in ast.walk(probe) if isinstance(n, ast.ImportFrom)]
    assert found and found[0].level == 2


def _long_functions(limit: int = 80) -> list[str]:
    """Functions whose code (docstring left out) runs over ``limit`` lines and
    whose docstring gives no reason (a sentence starting "Long because")."""
    out = []
    for path in _modules("autopar"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node) or ""
            body = node.body[1:] if doc and len(node.body) > 1 else node.body
            lines = node.end_lineno - body[0].lineno + 1
            if lines > limit and "long because" not in doc.lower():
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_long_function_without_a_reason():
    """Issue 14's rule: no function over ~80 lines of code without a reason in its docstring."""
    assert _long_functions() == []


def test_long_function_rule_can_fail():
    assert _long_functions(limit=40)
