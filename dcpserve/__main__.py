"""`python -m dcpserve`: the `dcpserve` command line (dcpserve/cli.py), for an environment without the console script
on its PATH."""

from __future__ import annotations

import sys

from dcpserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
