"""The package's architecture, enforced: layers import downward only, no import cycles, short
functions and modules, and ruff's lint and format pass (issue 23).

The layers, bottom up, are ``jaxcomp.LAYERS``; docs/architecture.md draws them. Every import
counts, a function-level one too: an import inside a function is deferred, not gone.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

import jaxcomp

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "jaxcomp"  # the source tree, whichever copy of jaxcomp is installed

#: Lines of code per function, its docstring not counted.
MAX_FUNCTION_LINES = 60
#: Lines per function in all, its docstring counted: a longer docstring is a guide for docs/.
MAX_FUNCTION_TOTAL = 80
#: Lines per module.
MAX_MODULE_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module an imported dotted name lives in (``jaxcomp.ops.topk.topk`` ->
    ``jaxcomp.ops.topk``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> set[str]:
    """The jaxcomp modules ``module`` imports, anywhere in it."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                )
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {_resolve(n) for n in names if n.split(".")[0] == "jaxcomp"}
    found.discard(module)
    return found


def _layer(module: str) -> int | None:
    """Index in ``jaxcomp.LAYERS`` (None for the package root's own files)."""
    parts = module.split(".")
    return jaxcomp.LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in jaxcomp.LAYERS else None


GRAPH = {module: _imports(module) for module in MODULES}


def test_every_module_sits_in_a_layer():
    """Only the root's plumbing (lazy exports, the old paths, ``python -m jaxcomp``) is outside."""
    outside = sorted(m for m in MODULES if _layer(m) is None)
    assert outside == [
        "jaxcomp",
        "jaxcomp.__main__",
        "jaxcomp._deprecated",
        "jaxcomp._lazy",
    ], outside


def test_layers_import_downward_only():
    upward = [
        f"{module} ({jaxcomp.LAYERS[_layer(module)]}) imports {target} "
        f"({jaxcomp.LAYERS[_layer(target)]})"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(module) is not None
        and _layer(target) is not None
        and _layer(target) > _layer(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_layers_import_nothing_from_the_root_but_its_plumbing():
    allowed = {"jaxcomp", "jaxcomp._lazy"}
    bad = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _layer(module) is not None
        for target in targets
        if _layer(target) is None and target not in allowed
    ]
    assert not bad, "\n".join(bad)


#: Inside ``optim``, bottom up: the pieces every stage reads, the stages, what composes them.
OPTIM_TIERS = (
    {"vma", "host", "sharding", "packing", "readiness", "state"},
    {"stages"},
)


def _optim_tier(module: str) -> int:
    """A module's tier in :data:`OPTIM_TIERS` (past the last: the modules that compose)."""
    name = module.split(".")[2]
    return next((i for i, tier in enumerate(OPTIM_TIERS) if name in tier), len(OPTIM_TIERS))


def test_optim_imports_downward_inside_too():
    """A stage reads the state's types, never the modules that compose the stages."""
    upward = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith("jaxcomp.optim.")
        for target in targets
        if target.startswith("jaxcomp.optim.") and _optim_tier(target) > _optim_tier(module)
    ]
    assert not upward, "\n".join(upward)


def _calls(path: pathlib.Path, name: str) -> list[str]:
    """The calls in a file of a function by its bare name (``print(...)``)."""
    return [
        f"{path.relative_to(SRC.parent)}:{node.lineno} {name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == name
    ]


def test_nothing_below_cli_prints():
    bad = [
        call
        for module, path in MODULES.items()
        if _layer(module) is not None and jaxcomp.LAYERS[_layer(module)] != "cli"
        for call in _calls(path, "print")
    ]
    assert not bad, "\n".join(bad)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    # The root package's lazy table names every layer as strings, not imports: not an edge.
    assert not _cycles(GRAPH), _cycles(GRAPH)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _code_lines(node) -> int:
    body = node.body
    first = body[0]
    has_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    start = first.end_lineno + 1 if has_doc and len(body) > 1 else first.lineno
    return node.end_lineno - start + 1


def test_functions_are_short():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            code, total = _code_lines(node), node.end_lineno - node.lineno + 1
            if code > MAX_FUNCTION_LINES or total > MAX_FUNCTION_TOTAL:
                long.append(f"{module}.{node.name} (line {node.lineno}): {code} / {total} lines")
    assert not long, "\n".join(long)


def test_modules_are_short():
    long = [
        f"{module}: {n} lines"
        for module, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


def _ruff():
    ruff = shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which(
        "ruff"
    )
    if ruff is None:
        pytest.fail("ruff is not installed: `pip install '.[test]'` pins it (pyproject.toml)")
    return ruff


def test_ruff_check_passes():
    result = subprocess.run([_ruff(), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_applied():
    result = subprocess.run(
        [_ruff(), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
