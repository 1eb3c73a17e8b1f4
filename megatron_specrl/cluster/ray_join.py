"""Wait until every node of a `ray start` cluster has joined with its GPUs, or fail with a named error.

The Slurm script `launch` renders starts the head and the workers in the background and then runs
this module: it polls the head's GCS port, connects, and polls `ray.nodes()` until `--nodes` alive
nodes each report at least `--gpus-per-node` GPUs. No fixed sleeps: a slow node delays the run only as
long as it needs, a node that never joins ends the job after `--timeout-s` with the missing count.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from megatron_specrl.errors import quote_exception


class ClusterJoinTimeout(RuntimeError):
    """Not every node joined the Ray cluster in time; the message says how many did."""


def _head_reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def token_refused(address: str) -> str | None:
    """Why the Ray head at `address` refuses this process's token (Ray's AuthenticationError, quoted), or
    None where it accepts it or the head is down. ray.init meets the same refusal only as a ConnectionError
    after about 20 s of retries, its cause in log lines; a GCS client raises it at once."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError
    try:
        GcsClient(address=address)
    except AuthenticationError as e:
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        where = os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")
        return (f"the Ray head at {address} refused this process's token ({quote_exception(e)}); RAY_AUTH_MODE="
                f"{mode}, token from {where}: every node and the driver need the job's token (the launch "
                "script's RAY_AUTH_TOKEN_PATH)")
    except Exception:   # not reachable, or no GCS there: ray.init's own error says so
        return None
    return None


def head_ip(nodes: int) -> str:
    """This node's address as Ray itself chooses it (the interface that routes outward), for the head's
    `--node-ip-address` and every worker's `--address`. `hostname --ip-address` gives 127.0.1.1 or 127.0.0.1
    on hosts whose /etc/hosts maps their own name to loopback (Debian's default; this CI machine), and
    workers on other nodes then cannot reach the head. A loopback answer is refused for a multi-node job."""
    import ray.util

    ip = ray.util.get_node_ip_address()
    if nodes > 1 and (ip.startswith("127.") or ip == "::1"):
        raise ClusterJoinTimeout(f"--nodes={nodes}: this node's address resolves to loopback ({ip}), which the "
                                 "other nodes cannot reach; give the node a routable address")
    return ip


def ready_nodes(nodes: list[dict], gpus_per_node: int) -> list[dict]:
    """The alive nodes that report at least gpus_per_node GPUs."""
    return [n for n in nodes if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= gpus_per_node]


def wait_for_cluster(address: str, nodes: int, gpus_per_node: int, timeout_s: float, poll_s: float = 1.0) -> list[dict]:
    """Block until `nodes` nodes with `gpus_per_node` GPUs each are alive in the cluster at `address`."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not _head_reachable(address):
        if time.monotonic() > deadline:
            raise ClusterJoinTimeout(f"--address={address}: the Ray head did not accept connections within "
                                     f"{timeout_s:g} s")
        time.sleep(poll_s)
    refused = token_refused(address)
    if refused:
        raise ClusterJoinTimeout(f"--address={address}: {refused}")
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # ConnectionError, or Ray's AuthenticationError when the token is not shared
        raise ClusterJoinTimeout(f"--address={address}: cannot connect to the Ray head ({quote_exception(e)}); with "
                                 "Ray's token authentication every node needs the head's token "
                                 "(RAY_AUTH_TOKEN_PATH)") from None
    try:
        while True:
            ready = ready_nodes(ray.nodes(), gpus_per_node)
            if len(ready) >= nodes:
                return ready
            if time.monotonic() > deadline:
                hosts = sorted(n.get("NodeManagerAddress", "?") for n in ready)
                raise ClusterJoinTimeout(f"--nodes={nodes}: only {len(ready)} node(s) with >= {gpus_per_node} GPUs "
                                         f"joined the Ray cluster at {address} within {timeout_s:g} s ({hosts})")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_specrl.cluster.ray_join", description=__doc__)
    p.add_argument("--print-head-ip", action="store_true",
                   help="print this node's routable address (as Ray picks it) and exit")
    p.add_argument("--address", help="head IP:port")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.print_head_ip:
        try:
            print(head_ip(args.nodes))
        except ClusterJoinTimeout as e:
            print(f"ray_join: {e}", file=sys.stderr)
            return 3
        return 0
    if not args.address:
        p.error("--address is required")
    try:
        ready = wait_for_cluster(args.address, args.nodes, args.gpus_per_node, args.timeout_s)
    except ClusterJoinTimeout as e:
        print(f"ray_join: {e}", file=sys.stderr)
        return 3
    print(f"ray_join: {len(ready)} node(s) joined with >= {args.gpus_per_node} GPUs each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
