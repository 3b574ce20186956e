"""`python -m bench NAME [ARGS...]`: runs benchmark NAME's main(ARGS); `python -m bench` or `--help` lists them."""

from __future__ import annotations

import difflib
import importlib
import sys

from bench import BENCHMARKS

USAGE = "usage: python -m bench NAME [ARGS...]   (python -m bench NAME --help: that benchmark's own options)"


def listing() -> str:
    """The usage line and every benchmark with what it measures."""
    width = max(map(len, BENCHMARKS))
    return "\n".join([USAGE, "", "benchmarks:", *(f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items())])


def unknown(name: str) -> str:
    """The error for a name that is no benchmark: the name, the closest ones, and every name there is."""
    guess = difflib.get_close_matches(name.removeprefix("bench/").removesuffix(".py"), BENCHMARKS, n=1)
    hint = f" (did you mean {guess[0]!r}?)" if guess else ""
    return (f"python -m bench: unknown benchmark {name!r}{hint}. Give one of: {', '.join(BENCHMARKS)} "
            "(`python -m bench` says what each measures)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(unknown(name), file=sys.stderr)
        return 2
    from dcpserve.local.serve import bind_ray_to_loopback
    from dcpserve.local.tls import prepare_driver_tls

    # Before the benchmark imports ray (Ray reads these settings once, at import): every Ray it starts or joins
    # listens on 127.0.0.1 only, and uses mutual TLS with a CA of that cluster's own (unless DCPSERVE_TLS=0).
    bind_ray_to_loopback()
    prepare_driver_tls()
    module = importlib.import_module(f"bench.{name}")
    saved = sys.argv
    # argparse names the program after sys.argv[0] in usage lines, and a benchmark that quotes its own command line
    # in the docs reads sys.argv[1:] when it is given no argv.
    sys.argv = [f"python -m bench {name}", *rest]
    try:
        code = module.main(rest)
    finally:
        sys.argv = saved
    return 0 if code is None else int(code)


if __name__ == "__main__":
    raise SystemExit(main())
