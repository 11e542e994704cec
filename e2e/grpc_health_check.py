"""Ask a gRPC health service, as the kubelet's gRPC probe does, from a process of its own.

`python -m e2e.grpc_health_check ADDRESS SERVICE` prints the serving status's name (``SERVING``,
``NOT_SERVING``, ...) or, when the call fails, the gRPC status code's name (``NOT_FOUND``,
``UNAVAILABLE``, ...), and exits 0 either way.

A process of its own because the test process entered the cluster's network namespace with
`setns` on its main thread only: gRPC's own threads, started by earlier tests of the same pytest
run, stay in the host's namespace and would dial the pod address there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.cluster import netns

TIMEOUT_S = 10
REPOSITORY = Path(__file__).resolve().parents[1]


def check(address: str, service: str) -> str:
    """The answer of the health service at `address` (host:port) for `service`, asked from a
    fresh process in the cluster's network namespace."""
    argv = netns.command([sys.executable, "-m", "e2e.grpc_health_check", address, service])
    done = subprocess.run(
        argv, cwd=REPOSITORY, capture_output=True, text=True, timeout=3 * TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"health check of {address} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def main(address: str, service: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        except grpc.RpcError as error:
            print(error.code().name)  # type: ignore[attr-defined]
            return
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


if __name__ == "__main__":
    main(*sys.argv[1:3])
