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
    "kernels": set(),
    "engine": {"kernels"},
    "cluster": {"kernels", "engine"},
    "deployments": {"kernels", "engine", "cluster"},
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


def test_engine_does_not_need_vllm_or_serve() -> None:
    """engine/ imports vllm only inside its vLLM adapter, and never Ray Serve."""
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert not name.startswith("ray.serve"), f"{path.name} imports {name}"
                    if name.split(".")[0] == "vllm":
                        assert path.name in ("vllm_engine.py", "vllm_args.py", "vllm_prefix.py", "vllm_stats.py"), (
                            f"{path.name} imports vllm (only the vLLM adapter may)")
