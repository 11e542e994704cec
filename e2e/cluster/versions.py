"""Pinned versions and fixed addresses of the e2e cluster (see docs/e2e-cluster.md)."""

from __future__ import annotations

from typing import Final

KUBERNETES_VERSION: Final = "v1.37.1"
CONTAINERD_VERSION: Final = "v2.2.3"
CRICTL_VERSION: Final = "v1.36.0"

# Debian packages the test bed needs on the host (etcd 3.4 works with a 1.37 apiserver).
HOST_PACKAGES: Final = (
    "runc",
    "containernetworking-plugins",
    "etcd-server",
    "iproute2",
    "iptables",
    "openssl",
    "busybox-static",
    "util-linux",
    # The driver image without a Docker engine (driverimage.py).
    "mmdebstrap",
    "buildah",
)

NETNS: Final = "gpu-dra-e2e"
NODE_NAME: Final = "gpu-dra-node"
NODE_INTERFACE: Final = "gpudra0"
NODE_IP: Final = "10.200.0.2"
NODE_PREFIX: Final = 24
POD_CIDR: Final = "10.201.0.0/24"
SERVICE_CIDR: Final = "10.96.0.0/24"
SERVICE_IP: Final = "10.96.0.1"
APISERVER_PORT: Final = 6443

# Where containerd looks for CDI specs (and where the driver writes its per-claim specs).
CDI_SPEC_DIRS: Final = ("/etc/cdi", "/var/run/cdi")

TEST_IMAGE: Final = "localhost/gpu-dra/busybox:e2e"
PAUSE_IMAGE: Final = "localhost/gpu-dra/pause:e2e"

# DRA features gpu-dra uses; each component gets the ones its binary knows (GA-locked gates are
# not listed by the binaries and need no flag).
WANTED_FEATURE_GATES: Final = (
    "DRAPartitionableDevices",
    "DRAConsumableCapacity",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRAExtendedResource",
    "DRAPrioritizedList",
    "DRAAdminAccess",
    "DRAResourceClaimDeviceStatus",
    # Device health in pod status (kubelet; beta and on by default in 1.37, named so that the
    # health e2e does not depend on defaults): the plugin's DRAResourceHealth stream.
    "ResourceHealthStatus",
    "ResourceHealthStatusMessage",
)
