"""`python -m tests.e2e.join_node GCS_ADDRESS TEMP_DIR`: one worker node (a raylet of its own with 1 CPU, started as
the local autoscaler's provider starts one, dcpserve/local/provider.py) joining the head at GCS_ADDRESS with whatever
Ray TLS its environment says. Prints `JOINED <node id>` once the head has registered it, then stays until its stdin
closes and stops its processes. Run in a session of its own: a node the head refuses never gets that far, and its
caller ends it with its process group."""

from __future__ import annotations

import sys


def main() -> None:
    gcs_address, temp_dir = sys.argv[1:3]
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        min_worker_port=0, max_worker_port=0, dashboard_port=None, dashboard_agent_listen_port=0, num_cpus=1,
        num_gpus=0, gcs_address=gcs_address, redis_address=gcs_address, temp_dir=temp_dir)
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
    print(f"JOINED {node.node_id}", flush=True)
    sys.stdin.read()
    node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    main()
