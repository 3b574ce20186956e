"""Each benchmark owns one marked section of docs/benchmarks.md and rewrites only that section; the command line a
section quotes is `python -m bench NAME ARGS`."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def bench_command(name: str, argv: Sequence[str] | None = None) -> str:
    """The command that runs benchmark `name` with `argv` (None: this process's own arguments), as the docs quote it:
    `python -m bench NAME ARGS`."""
    return shlex.join(["python", "-m", "bench", name, *(sys.argv[1:] if argv is None else argv)])


class DocsSection:
    """The part of docs/benchmarks.md between `<!-- {key}:begin -->` and `<!-- {key}:end -->`.

    The keys are the sections' names in the file since the benchmarks ran as scripts ("bench/capacity.py",
    "bench/kernels.py --shape mla", "grammar_engines"): they stay as they are, so every recorded section is found."""

    def __init__(self, key: str, path: Path = DOCS_PATH) -> None:
        self.path = path
        self.begin = f"<!-- {key}:begin -->"
        self.end = f"<!-- {key}:end -->"

    def replaced(self, text: str, section: str) -> str:
        """`text` with this section replaced by `section` (appended, under a title if the file is new)."""
        block = f"{self.begin}\n{section.rstrip()}\n{self.end}"
        begin, end = text.find(self.begin), text.find(self.end)
        if begin == -1 and end == -1:
            return (text.rstrip("\n") if text.strip() else "# Benchmarks") + "\n\n" + block + "\n"
        if begin == -1 or end < begin:
            raise SystemExit(f"{self.path}: the {self.begin} / {self.end} markers are unpaired or out of order")
        return text[:begin] + block + text[end + len(self.end) :]

    def check(self) -> None:
        """Fails now, before a long run, if the file's markers would not allow an update."""
        self.replaced(self._read(), "")

    def write(self, section: str) -> None:
        """Re-reads the file (other benchmarks may have written theirs meanwhile) and replaces this section."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.replaced(self._read(), section))

    def _read(self) -> str:
        return self.path.read_text() if self.path.exists() else ""
