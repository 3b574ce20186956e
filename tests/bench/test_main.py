"""`python -m bench`: the list of benchmarks, a clear refusal of an unknown name, every benchmark's own --help, and
bench/ as a package that never edits sys.path nor imports tests/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from bench import BENCHMARKS
from bench.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [(), ("--help",), ("-h",)])
def test_it_lists_every_benchmark_with_what_it_measures(args: tuple[str, ...]) -> None:
    done = run_bench(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench NAME")
    for name, what in BENCHMARKS.items():
        assert f"  {name} " in done.stdout and what in done.stdout


def test_an_unknown_name_is_refused_with_the_names_there_are() -> None:
    done = run_bench("capacty", "--quick")
    assert done.returncode == 2 and not done.stdout
    assert "unknown benchmark 'capacty' (did you mean 'capacity'?)" in done.stderr
    assert all(name in done.stderr for name in BENCHMARKS)
    assert "(did you mean 'capacity'?)" in run_bench("bench/capacity.py").stderr


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_answers_help_with_its_own_options(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = list(sys.argv)
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench {name}")
    assert sys.argv == argv  # put back after the benchmark ran


def _module_main(path: Path) -> ast.FunctionDef | None:
    tree = ast.parse(path.read_text(), filename=str(path))
    return next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main"), None)


def test_every_module_with_a_main_is_a_benchmark_and_takes_argv() -> None:
    """A module of bench/ with a main of its own is listed (none is forgotten); each benchmark's main(argv)."""
    with_main = {path.stem for path in BENCH.glob("*.py") if path.stem != "__main__" and _module_main(path)}
    assert with_main == set(BENCHMARKS)
    for name in BENCHMARKS:
        function = _module_main(BENCH / f"{name}.py")
        assert function is not None and [a.arg for a in function.args.args] == ["argv"], name


def test_bench_never_edits_sys_path_nor_imports_tests() -> None:
    wrong = []
    for path in sorted(BENCH.rglob("*.py")):
        where = path.relative_to(REPO_ROOT)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                wrong += [f"{where}:{node.lineno} imports {alias.name}" for alias in node.names
                          if alias.name.split(".")[0] == "tests"]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tests":
                wrong.append(f"{where}:{node.lineno} imports from {node.module}")
            elif (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                  and node.value.id == "sys"):
                wrong.append(f"{where}:{node.lineno} uses sys.path")
    assert not wrong, "; ".join(wrong)
