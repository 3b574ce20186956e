"""`dcpserve tls ...`: a cluster's certificate authority and its nodes' certificates, for clusters an operator runs
(ray_cluster.yaml): `ca` makes the CA once, `node` issues the certificate of the node it runs on (in its setup
commands), `check` stops a node's start command with the name of a file that cannot work (missing, unreadable,
expired, another CA's). `make serve` and `make cluster` need none of them: they make their own (dcpserve/local/tls.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dcpserve.cluster.tls import CA_VALID_DAYS, NODE_VALID_DAYS, TLS_VARIABLES, ClusterCa, TlsConfigError, check_env


def _cmd_ca(args: argparse.Namespace) -> int:
    try:
        ca = ClusterCa.create(Path(args.directory), valid_days=args.days)
    except TlsConfigError as err:
        print(f"dcpserve tls ca: {err}", file=sys.stderr)
        return 2
    print(f"wrote the CA certificate {ca.cert} and its key {ca.key} (mode 0600; keep it off every machine but those "
          "that issue node certificates)")
    return 0


def _cmd_node(args: argparse.Namespace) -> int:
    try:
        identity = ClusterCa.load(Path(args.ca)).issue(Path(args.out), args.name, args.address, args.days)
    except TlsConfigError as err:
        print(f"dcpserve tls node: {err}", file=sys.stderr)
        return 2
    print(f"wrote {identity.cert} and {identity.key} (mode 0600), signed by {identity.ca_cert}")
    print(f"export RAY_USE_TLS=1 RAY_TLS_SERVER_CERT={identity.cert} RAY_TLS_SERVER_KEY={identity.key} "
          f"RAY_TLS_CA_CERT={identity.ca_cert}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        identity = check_env(os.environ)
    except TlsConfigError as err:
        print(f"dcpserve tls check: {err}", file=sys.stderr)
        return 2
    if identity is None:
        if args.require:
            print(f"dcpserve tls check: RAY_USE_TLS is not set: this node would start without mutual TLS and the "
                  f"cluster's nodes would refuse it; set {', '.join(TLS_VARIABLES)} (`dcpserve tls node` prints "
                  "them)", file=sys.stderr)
            return 2
        print("RAY_USE_TLS is off: nothing to check")
        return 0
    print(f"ok: {identity.cert} and {identity.key} are valid now and signed by {identity.ca_cert}")
    return 0


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds `tls ca`, `tls node` and `tls check` to the dcpserve command line."""
    tls = commands.add_parser("tls", help="Ray's mutual TLS for a cluster you run: its CA and node certificates")
    sub = tls.add_subparsers(dest="tls_command", required=True)
    ca = sub.add_parser("ca", help="make a cluster's CA (ca.crt, ca.key) in a new directory (mode 0700)")
    ca.add_argument("directory", help="where to write it; refused if it already holds a CA")
    ca.add_argument("--days", type=int, default=CA_VALID_DAYS, help=f"validity (default {CA_VALID_DAYS})")
    ca.set_defaults(func=_cmd_ca)
    node = sub.add_parser("node", help="issue this node's certificate and key from the cluster's CA")
    node.add_argument("--ca", required=True, help="the CA's directory (ca.crt and ca.key)")
    node.add_argument("--out", required=True, help="where to write node.crt and node.key (made mode 0700)")
    node.add_argument("--name", default=os.uname().nodename, help="the certificate's name (default: this host's)")
    node.add_argument("--address", action="append", default=[],
                      help="an IP or DNS name other nodes reach this one at (repeatable; loopback and the host name "
                           "are always in)")
    node.add_argument("--days", type=int, default=NODE_VALID_DAYS, help=f"validity (default {NODE_VALID_DAYS})")
    node.set_defaults(func=_cmd_node)
    check = sub.add_parser("check", help="check the certificates RAY_USE_TLS and RAY_TLS_* name, before `ray start`")
    check.add_argument("--require", action="store_true", help="fail when RAY_USE_TLS is not set")
    check.set_defaults(func=_cmd_check)
