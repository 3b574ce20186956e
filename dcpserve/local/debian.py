"""Debian packages the local tools run (Prometheus for `make observe`, Redis for `make cluster`'s GCS fault
tolerance), installed when missing without starting their services."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


def ensure_debian_package(binary: str, package: str, say: Callable[[str], None]) -> str:
    """The binary's path, installing its Debian package when missing (as root, without starting the package's
    service: apt runs with a policy-rc.d that refuses service starts, in place only for the install)."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit(f"{binary} is not installed: `apt-get install {package}` (as root), or put it on PATH")
    say(f"installing Debian's {package} package (its service is not started)")
    policy = Path("/usr/sbin/policy-rc.d")
    own_policy = not policy.exists()
    if own_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")  # invoke-rc.d: refuse every service start during the install
        policy.chmod(0o755)
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", RUNLEVEL="1")
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env)
    finally:
        if own_policy:
            policy.unlink(missing_ok=True)
    found = shutil.which(binary)
    if not found:
        raise SystemExit(f"apt-get installed {package} but {binary} is not on PATH")
    return found
