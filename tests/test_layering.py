"""The package layering of docs/structure.md: imports point down the table only, never up, not even lazily inside a
function. Checked on the source (every `import` / `from ... import` statement of every module), so a new upward
import fails here before it makes a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package -> the project packages it may import (besides itself).
ALLOWED = {
    "engine": set(),
    "cluster": {"engine"},
    "deployments": {"engine", "cluster"},
    "simulator": {"engine", "cluster", "deployments"},
    "dcpserve": {"engine", "cluster", "deployments", "simulator"},
}


def _project_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in ALLOWED]
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down_the_table(package: str) -> None:
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, target in _project_imports(path)
        if target != package and target not in ALLOWED[package]
    ]
    assert not wrong, f"{package}/ may import only {sorted(ALLOWED[package])}: " + "; ".join(wrong)


# The modules of the vLLM adapter (engine/backends/vllm/) that import vllm; its reaper runs on the standard library.
VLLM_IMPORTERS = {f"engine/backends/vllm/{name}.py" for name in ("engine", "args", "prefix", "stats")}


def test_engine_does_not_need_vllm_or_serve() -> None:
    """engine/ imports vllm only inside its vLLM adapter, and never Ray Serve."""
    for path in sorted((ROOT / "engine").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert not name.startswith("ray.serve"), f"{where} imports {name}"
                    if name.split(".")[0] == "vllm":
                        assert where in VLLM_IMPORTERS, f"{where} imports vllm (only the vLLM adapter may)"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under `if TYPE_CHECKING:` (they never run, so they make no circle)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at the top or lazily inside a function."""
    modules = {_module_name(path): path for path in sorted((ROOT / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from a.b import c` imports a.b, and a.b.c when c is a module of its own.
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_import_circle_inside_a_package(package: str) -> None:
    """Within a package, module imports (lazy ones inside functions included, TYPE_CHECKING ones not) form no
    circle: a module that needs one of its importers' names is in the wrong place (engine.protocol once imported
    its own implementations to start them; engine.backends does that now). The graph is over every module below the
    package, so it covers engine's subpackages (engine.core, engine.worker, ...) and the imports between them."""
    assert not _cycles(_module_graph(package)), _cycles(_module_graph(package))


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# engine/ by role (docs/structure.md): engine subpackage -> the engine packages or modules it may not import (at the
# top, lazily inside a function, or for type checking alone), and the modules of those it may import all the same.
# The core reaches the rank side only through the executor interface, the ranks know of the core only its step
# messages and block arithmetic, and the fronts reach the ranks only through the core.
ENGINE_FORBIDDEN: dict[str, tuple[set[str], set[str]]] = {
    "engine.core": ({"engine.worker", "engine.frontend", "engine.backends"}, {"engine.worker.executor"}),
    "engine.worker": ({"engine.core", "engine.frontend", "engine.backends"},
                      {"engine.core.step", "engine.core.outputs", "engine.core.block_manager"}),
    "engine.frontend": ({"engine.worker"}, set()),
    "engine.backends.vllm": ({"engine.worker", "engine.frontend"}, set()),
    # The attention kernels are a leaf: torch and Triton only (their tests run them without an engine).
    "engine.kernels": ({"engine"}, {"engine.kernels"}),
}


def _engine_imports(path: Path) -> list[tuple[int, str]]:
    """Every engine module or package a module names in an import statement (lazy and TYPE_CHECKING ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from engine.worker import executor` names engine.worker.executor.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] == "engine"]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("subpackage", sorted(ENGINE_FORBIDDEN))
def test_engine_subpackages_keep_to_their_role(subpackage: str) -> None:
    forbidden, allowed = ENGINE_FORBIDDEN[subpackage]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / subpackage.replace(".", "/")).rglob("*.py"))
        for line, name in _engine_imports(path)
        if any(_inside(name, package) for package in forbidden) and not any(_inside(name, ok) for ok in allowed)
    ]
    assert not wrong, f"{subpackage} may not import {sorted(forbidden)} (but {sorted(allowed)}): " + "; ".join(wrong)


def test_the_engine_protocol_imports_no_implementation() -> None:
    """engine/protocol.py names other engine modules for type checking only: at run time it imports none of them."""
    path = ROOT / "engine" / "protocol.py"
    skip = _type_checking_only(ast.parse(path.read_text()))
    wrong = [f"line {line} imports {name}" for line, name in _engine_imports(path) if line not in skip]
    assert not wrong, "; ".join(wrong)
