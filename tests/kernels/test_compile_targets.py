"""Every production kernel configuration (dcpserve/kernels/launch_configs.py) compiles for the GPUs the engine runs on,
sm_90 (H100 / H200) and sm_100 (B200), with Triton's own compiler and the ptxas of its wheel: no GPU needed.

Each configuration fails on a compile error, on shared memory over what a block may opt into on the target, or on
register spills past MAX_SPILL_BYTES. The compiles run in a worker process per pytest process (compile_worker.py:
the suite imports the kernels under the interpreter, which cannot compile); under xdist each pytest worker has its
own. Ids: test_compiles[sm90-decode-gqa-d128-g8-kv1-s1x64-bf16] names target, kernel, configuration and dtype.
Marker `compile` (pyproject.toml): 219 configurations x 2 targets, about 460 CPU-seconds (4 minutes at -n 2 on 2
idle cores) when nothing is known yet, so a tier can run or leave them by name. The worker keeps each success under
the exact inputs of its binary (compile_worker.py): a later run compiles only the configurations a change touched
(the fast tier runs them; DCPSERVE_COMPILE_CACHE=off compiles all of them every time).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcpserve.kernels.launch_configs import LaunchConfig, launch_configs

pytestmark = pytest.mark.compile

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"sm90": 90, "sm100": 100}
# Shared memory one block may opt into (cudaFuncAttributeMaxDynamicSharedMemorySize): 227 KiB on sm_90 and sm_100.
MAX_SHARED_BYTES = {90: 232448, 100: 232448}
# Register spills ptxas may report (stores + loads, bytes per thread). ptxas (Triton 3.9's) for sm_100 keeps a value
# or two of the prefill kernels' context loop on the stack: 4 + 4 bytes at GQA head_dim 64, 8 + 8 at MLA's widths;
# nothing else spills. A few bytes through L1 cost nothing measurable; a spilled tile costs hundreds of bytes (MLA
# prefill at 4 warps: 208 + 240, hence its 8) and fails here. Headroom for another ptxas' choices.
MAX_SPILL_BYTES = 32
COMPILE_TIMEOUT_S = 120.0  # one configuration; the slowest take a few seconds

CONFIGS = launch_configs()


class Compiler:
    """The compile worker process, one request at a time."""

    def __init__(self, cache_dir: Path) -> None:
        env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
        env.update(TRITON_CACHE_DIR=str(cache_dir), TRITON_DEFAULT_FP_FUSION="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.kernels.compile_worker"], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )

    def compile(self, config: LaunchConfig, arch: int) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{config.name} {arch}\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], COMPILE_TIMEOUT_S)
        if not ready:
            self.close()
            raise TimeoutError(f"compiling {config.name} for sm_{arch} took over {COMPILE_TIMEOUT_S} s")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the compile worker died (exit code {self.process.wait()}); its stderr says why")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compiler]:
    worker = Compiler(tmp_path_factory.mktemp("triton-cache"))
    yield worker
    worker.close()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config.name)
@pytest.mark.parametrize("arch", list(TARGETS.values()), ids=list(TARGETS))
def test_compiles(compiler: Compiler, config: LaunchConfig, arch: int, record_property: Any) -> None:
    answer = compiler.compile(config, arch)
    record_property("usage", json.dumps(answer))  # shared, registers, spills, seconds: in --junitxml's report
    assert answer["error"] is None, f"{config.name} does not compile for sm_{arch}: {answer['error']}"
    assert answer["shared"] <= MAX_SHARED_BYTES[arch], (
        f"{config.name} needs {answer['shared']} bytes of shared memory on sm_{arch}, over the "
        f"{MAX_SHARED_BYTES[arch]} a block may have: smaller tiles or fewer stages"
    )
    spilled = answer["spill_stores"] + answer["spill_loads"]
    assert spilled <= MAX_SPILL_BYTES, (
        f"{config.name} spills {answer['spill_stores']} + {answer['spill_loads']} bytes on sm_{arch} "
        f"({answer['registers']} registers), over MAX_SPILL_BYTES={MAX_SPILL_BYTES}: smaller tiles or more warps"
    )
