"""`python -m e2e.cluster {build,up,down,status,kubectl,crictl,logs}` (run as root)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from e2e import helm, kueue, nvidiactk, nvidiadp, nvmlmock
from e2e.cluster import driverimage, netns, toolchain
from e2e.cluster.lifecycle import Cluster, ClusterError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("kubectl", "crictl"):
        return _exec_tool(Cluster(), argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build (or find cached) pinned binaries and test-bed tools")
    sub.add_parser("up", help="bring the cluster up (idempotent)")
    sub.add_parser("down", help="tear everything down")
    sub.add_parser("status", help="exit 0 if the cluster is up and healthy")
    for tool in ("kubectl", "crictl"):
        cmd = sub.add_parser(tool, help=f"run the pinned {tool} inside the cluster's namespace")
        cmd.add_argument("args", nargs=argparse.REMAINDER)
    logs = sub.add_parser("logs", help="copy component logs to a directory")
    logs.add_argument("destination", type=Path)
    options = parser.parse_args(argv)  # kubectl/crictl never get here (see above)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cluster = Cluster()
    try:
        if options.command == "build":
            print(toolchain.build(cluster.paths))
            print(nvmlmock.build(cluster.paths))
            print(nvidiactk.build(cluster.paths))
            print(nvidiadp.build(cluster.paths))
            print(helm.build(cluster.paths))
            print(kueue.build(cluster.paths))
            print(driverimage.build(cluster.paths).reference)
        elif options.command == "up":
            cluster.up()
            print(f"cluster up; kubeconfig: {cluster.kubeconfig}")
        elif options.command == "down":
            cluster.down()
        elif options.command == "status":
            healthy = cluster.healthy()
            print("healthy" if healthy else "not running")
            return 0 if healthy else 1
        elif options.command == "logs":
            print(cluster.collect_logs(options.destination))
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def _exec_tool(cluster: Cluster, tool: str, args: list[str]) -> int:
    """Replace this process with the pinned kubectl/crictl, inside the cluster's namespace."""
    netns.enter()
    binary = str(cluster.bin_dir / tool)
    extra = (
        [f"--kubeconfig={cluster.kubeconfig}"]
        if tool == "kubectl"
        else ["--runtime-endpoint", f"unix://{cluster.paths.containerd_socket}"]
    )
    os.execv(binary, [binary, *extra, *args])


if __name__ == "__main__":
    sys.exit(main())
