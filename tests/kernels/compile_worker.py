"""Compiles launch configurations (dcpserve/kernels/launch_configs.py) for a GPU target, no GPU needed: Triton's own
compiler down to a cubin with the ptxas its wheel bundles, in a process of its own.

A process of its own because the test suite imports the kernels under TRITON_INTERPRET=1 (tests/conftest.py), which
makes every triton.jit function, Triton's own standard library included, an interpreter function that cannot be
compiled; this process imports them with the interpreter off. `python -m tests.kernels.compile_worker` reads one
request per line, `NAME ARCH` (a configuration's name, 90 or 100), and answers each with one line of JSON:
{"name", "arch", "error" (null when it compiled), "shared" (bytes per block), "registers", "spill_stores",
"spill_loads", "stack" (bytes), "seconds", "cached"}. Its stdout carries only the answers; whatever else prints goes
to stderr.

A configuration that compiled is remembered by what determines its binary: Triton's hash of the source (the kernel's
and every function it calls, the signature, constants and hints), the target, the options and the versions of Triton
and of its ptxas. An answer for the same key is read back instead of compiling again (only successes are kept), so a
run after a change compiles only what the change touched, as ccache does for C; the first run on a machine compiles
everything. The results live in DCPSERVE_COMPILE_CACHE (default ~/.cache/dcpserve/kernel-compile); `off` compiles
every configuration every time.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_usage(log: str) -> dict[str, int]:
    """Registers, spill stores / loads and stack bytes from ptxas -v's report of one kernel."""
    spill, registers = SPILL.search(log), REGISTERS.search(log)
    if spill is None or registers is None:
        raise RuntimeError(f"no register / spill report in the ptxas log:\n{log}")
    return {"registers": int(registers.group(1)), "stack": int(spill.group(1)),
            "spill_stores": int(spill.group(2)), "spill_loads": int(spill.group(3))}


def result_cache() -> Path | None:
    """Where compile results are kept (None: `off`)."""
    where = os.environ.get("DCPSERVE_COMPILE_CACHE", "")
    if where == "off":
        return None
    return Path(where) if where else Path.home() / ".cache" / "dcpserve" / "kernel-compile"


def toolchain(arch: int) -> str:
    """Triton's version and the version line of the ptxas it runs for sm_<arch> (its wheel's; sm_100 has its own)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version

    return f"triton {triton.__version__}; {get_ptxas_version(arch)}"


def compile_config(config: Any, arch: int, cache: Path | None = None, tools: str = "") -> dict[str, Any]:
    """triton.compile of one LaunchConfig for sm_<arch>: the binary's shared memory and ptxas' register report (read
    back from `cache` when this exact compile succeeded before; `tools`: toolchain(arch))."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = config.jit_function()
    signature, constants, divisible = config.signature()
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(fn, signature, constants, attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    key = hashlib.sha256(json.dumps([source.hash(), arch, options, tools]).encode()).hexdigest()
    known = cache / f"{key}.json" if cache is not None else None
    if known is not None and known.is_file():
        return {**json.loads(known.read_text()), "cached": True}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the ptxas log Triton prints (knobs.nvidia.dump_ptxas_log)
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    result = {"shared": int(kernel.metadata.shared), **ptxas_usage(log.getvalue())}
    if known is not None:
        known.parent.mkdir(parents=True, exist_ok=True)
        partial = known.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(result))
        partial.replace(known)  # atomic: a concurrent worker reads a whole answer or none
    return {**result, "cached": False}


def serve(requests: TextIO, answers: TextIO) -> None:
    import triton

    from dcpserve.kernels._triton import triton_interpreting
    from dcpserve.kernels.launch_configs import launch_configs

    if triton_interpreting():
        raise RuntimeError("compile_worker must run with TRITON_INTERPRET unset: it compiles for GPUs")
    triton.knobs.compilation.always_compile = True  # ptxas runs (and reports) for every request, cache or not
    triton.knobs.nvidia.dump_ptxas_log = True
    configs = {config.name: config for config in launch_configs()}
    cache = result_cache()
    tools: dict[int, str] = {}
    for line in requests:
        name, arch = line.split()
        start = time.perf_counter()
        answer: dict[str, Any] = {"name": name, "arch": int(arch), "error": None}
        try:
            if int(arch) not in tools:
                tools[int(arch)] = toolchain(int(arch))
            answer.update(compile_config(configs[name], int(arch), cache, tools[int(arch)]))
        except Exception as error:  # noqa: BLE001 - the answer carries it to the test, whose failure it is
            answer["error"] = f"{type(error).__name__}: {error}"
        answer["seconds"] = round(time.perf_counter() - start, 3)
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints (compiler warnings) to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, answers)


if __name__ == "__main__":
    main()
