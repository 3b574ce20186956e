"""The package layering of docs/structure.md: imports point down the table only, never up, not even lazily inside a
function. Checked on the source (every `import` / `from ... import` statement of every module), so a new upward
import fails here before it makes a cycle."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dcpserve"
# The design's folders, bottom up (docs/structure.md), -> the ones each may import (besides itself). "cli" is the
# modules directly in dcpserve/ (the command line, `python -m dcpserve`): the top, which nothing else imports. The
# local tooling (`make serve`, `make cluster`, `make observe`) sits beside the simulator: neither imports the other.
ALLOWED = {
    "kernels": set(),
    "engine": {"kernels"},
    "cluster": {"kernels", "engine"},
    "deployments": {"kernels", "engine", "cluster"},
    "local": {"kernels", "engine", "cluster", "deployments"},
    "simulator": {"kernels", "engine", "cluster", "deployments"},
    "cli": {"kernels", "engine", "cluster", "deployments", "local", "simulator"},
}
# The names the tree had before it became one package: nothing imports them (Hugging Face's `kernels` is not ours).
OLD_TOP_LEVEL = ("engine", "cluster", "deployments", "simulator", "kernels", "local")


def _folder(module: str) -> str:
    """The design folder of a dcpserve module name ("dcpserve.engine.core.x" -> "engine"; "dcpserve.cli" -> "cli")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED and parts[1] != "cli" else "cli"


def _sources(folder: str) -> list[Path]:
    if folder == "cli":
        return sorted(PACKAGE.glob("*.py"))
    return sorted((PACKAGE / folder).rglob("*.py"))


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an import statement of the file names (lazy and TYPE_CHECKING ones too): `from a.b import c`
    names a.b.c, which is a.b's attribute c or its submodule c."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down_the_table(folder: str) -> None:
    wrong = sorted({
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _sources(folder)
        for line, name in _imported_modules(path)
        if name.startswith("dcpserve.") and _folder(name) != folder and _folder(name) not in ALLOWED[folder]
        and name.split(".")[1] in ALLOWED  # `from dcpserve import x` of a name dcpserve/__init__ defines: none today
    })
    assert not wrong, f"dcpserve/{folder} may import only {sorted(ALLOWED[folder])}: " + "; ".join(wrong)


def test_every_folder_is_in_the_table() -> None:
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED) - {"cli"}


def test_nothing_imports_the_old_top_level_names() -> None:
    """One import name: no module of the product, the benchmarks or the tests imports `engine`, `cluster`, ... as a
    top-level package (they are dcpserve.engine, dcpserve.cluster, ...)."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for top in ("dcpserve", "bench", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        for line, name in _imported_modules(path)
        if name.split(".")[0] in OLD_TOP_LEVEL
    ]
    assert not wrong, "; ".join(wrong)


def test_the_distribution_installs_one_top_level_package() -> None:
    """The installed distribution's top-level names are `dcpserve` alone, and in this environment the names the tree
    once installed resolve to nothing of ours (another distribution's `kernels` may be there)."""
    distribution = importlib.metadata.distribution("dcpserve")
    top_level = (distribution.read_text("top_level.txt") or "").split()
    assert top_level == ["dcpserve"], top_level
    for name in OLD_TOP_LEVEL:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin or next(iter(spec.submodule_search_locations or []), "")) if spec else None
        assert origin is None or not origin.resolve().is_relative_to(ROOT / name), f"`import {name}` finds {origin}"


# The modules of the vLLM adapter (dcpserve/engine/backends/vllm/) that import vllm; its reaper runs on the standard
# library.
VLLM_IMPORTERS = {f"dcpserve/engine/backends/vllm/{name}.py" for name in ("engine", "args", "prefix", "stats")}


def test_engine_does_not_need_vllm_or_serve() -> None:
    """dcpserve/engine imports vllm only inside its vLLM adapter, and never Ray Serve."""
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for _, name in _imported_modules(path):
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


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules of dcpserve it imports, at the top or lazily inside a function."""
    modules = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
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


def test_no_import_circle() -> None:
    """Module imports (lazy ones inside functions included, TYPE_CHECKING ones not) form no circle: a module that
    needs one of its importers' names is in the wrong place (dcpserve.engine.protocol once imported its own
    implementations to start them; dcpserve.engine.backends does that now). The graph is over every module of the
    package, so it covers the subpackages (dcpserve.engine.core, dcpserve.deployments.admission, ...) and the imports
    between them."""
    assert not _cycles(_module_graph()), _cycles(_module_graph())


def test_the_circle_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# dcpserve/engine/ by role (docs/structure.md): engine subpackage -> the engine packages or modules it may not import
# (at the top, lazily inside a function, or for type checking alone), and the modules of those it may import all the
# same. The core reaches the rank side only through the executor interface, the ranks know of the core only its step
# messages and block arithmetic, and the fronts reach the ranks only through the core.
ENGINE = "dcpserve.engine"
ENGINE_FORBIDDEN: dict[str, tuple[set[str], set[str]]] = {
    f"{ENGINE}.core": ({f"{ENGINE}.worker", f"{ENGINE}.frontend", f"{ENGINE}.backends"}, {f"{ENGINE}.worker.executor"}),
    f"{ENGINE}.worker": ({f"{ENGINE}.core", f"{ENGINE}.frontend", f"{ENGINE}.backends"},
                         {f"{ENGINE}.core.step", f"{ENGINE}.core.outputs", f"{ENGINE}.core.block_manager"}),
    f"{ENGINE}.frontend": ({f"{ENGINE}.worker"}, set()),
    f"{ENGINE}.backends.vllm": ({f"{ENGINE}.worker", f"{ENGINE}.frontend"}, set()),
}


def _imports_of(path: Path, package: str) -> list[tuple[int, str]]:
    """Every module or name of `package` an import statement of the file names (lazy and TYPE_CHECKING ones too):
    `from dcpserve.engine.worker import executor` names dcpserve.engine.worker.executor."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if _inside(name, package)]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("subpackage", sorted(ENGINE_FORBIDDEN))
def test_engine_subpackages_keep_to_their_role(subpackage: str) -> None:
    forbidden, allowed = ENGINE_FORBIDDEN[subpackage]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / subpackage.replace(".", "/")).rglob("*.py"))
        for line, name in _imports_of(path, ENGINE)
        if any(_inside(name, package) for package in forbidden) and not any(_inside(name, ok) for ok in allowed)
    ]
    assert not wrong, f"{subpackage} may not import {sorted(forbidden)} (but {sorted(allowed)}): " + "; ".join(wrong)


def test_the_engine_protocol_imports_no_implementation() -> None:
    """dcpserve/engine/protocol.py names other engine modules for type checking only: at run time it imports none of
    them."""
    path = PACKAGE / "engine" / "protocol.py"
    skip = _type_checking_only(ast.parse(path.read_text()))
    wrong = [f"line {line} imports {name}" for line, name in _imports_of(path, ENGINE)
             if line not in skip and not _inside(name, f"{ENGINE}.protocol")]
    assert not wrong, "; ".join(wrong)


# dcpserve/deployments/ by role, bottom up: each part may import only the parts before it (at the top, lazily, or for
# type checking alone). The messages that cross a process boundary are the bottom, which every part speaks; the
# app's arguments and metrics; the admission queue (and KvAdmission, its deployment); the autoscaling policies; the
# engine replica; dispatch (a granted request sent to its replica, its deltas streamed back); the OpenAI surface
# (the ingress); and the app, which binds the deployments.
DEPLOYMENTS = "dcpserve.deployments"
DEPLOYMENT_PARTS = ["messages", "config", "metrics", "admission", "autoscaling", "replica", "dispatch", "api", "app"]


def _part(module: str) -> str | None:
    rest = module.removeprefix(DEPLOYMENTS + ".").split(".")[0]
    return rest if rest in DEPLOYMENT_PARTS else None


def test_deployments_has_only_the_parts_of_the_table() -> None:
    names = {p.stem for p in (PACKAGE / "deployments").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert names - {"__init__"} == set(DEPLOYMENT_PARTS)


@pytest.mark.parametrize("part", DEPLOYMENT_PARTS)
def test_deployments_parts_point_down(part: str) -> None:
    below = set(DEPLOYMENT_PARTS[:DEPLOYMENT_PARTS.index(part)])
    base = PACKAGE / "deployments" / part
    paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in paths
        for line, name in _imports_of(path, DEPLOYMENTS)
        if (target := _part(name)) is not None and target != part and target not in below
    ]
    assert not wrong, f"deployments/{part} may import only {sorted(below)}: " + "; ".join(wrong)
