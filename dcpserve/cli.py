"""The `dcpserve` command line: the planner's and engine's commands (dcpserve/cluster/cli.py) and the simulator's
(dcpserve/simulator/cli.py). `dcpserve --help` lists them; `dcpserve COMMAND --help` describes one.

The commands live with the package they use; this module only assembles them, from the top of the package table
(it may import every package, and nothing imports it), so `dcpserve plan --trace` (dcpserve/simulator/plan.py's
`extend_plan` on dcpserve/cluster/cli.py's plan command) can use the simulator without the planner importing it.
"""

from __future__ import annotations

import argparse
import sys

from dcpserve.cluster.cli import add_commands as add_cluster_commands
from dcpserve.cluster.tls_cli import add_commands as add_tls_commands
from dcpserve.simulator.cli import add_commands as add_simulator_commands
from dcpserve.simulator.plan import extend_plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcpserve",
                                     description="Long-context LLM serving with decode context parallelism.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_cluster_commands(commands)
    add_simulator_commands(commands)
    add_tls_commands(commands)
    extend_plan(commands.choices["plan"])  # plan --trace: the layouts ranked by simulated goodput
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
