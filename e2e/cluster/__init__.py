"""A real single-node Kubernetes for gpu-dra's e2e tests and demo (see docs/e2e-cluster.md)."""

from e2e.cluster.lifecycle import Cluster, ClusterError
from e2e.cluster.paths import ClusterPaths

__all__ = ["Cluster", "ClusterError", "ClusterPaths"]
