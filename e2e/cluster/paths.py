"""Where the e2e cluster keeps its cache (survives `down`) and its state (removed by `down`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ClusterPaths:
    """Layout: `cache` holds built binaries and Go caches; `state` is the running cluster."""

    cache: Path
    state: Path

    @classmethod
    def from_env(cls) -> ClusterPaths:
        cache = os.environ.get("GPU_DRA_CACHE", str(Path.home() / ".cache" / "gpu-dra"))
        state = os.environ.get("GPU_DRA_E2E_STATE", "/var/lib/gpu-dra-e2e")
        return cls(cache=Path(cache), state=Path(state))

    # cache
    @property
    def images_dir(self) -> Path:
        return self.cache / "images"

    @property
    def buildah_dir(self) -> Path:
        """The driver image's buildah storage (layer cache), e2e/cluster/driverimage.py."""
        return self.cache / "buildah"

    @property
    def gomodcache(self) -> Path:
        return self.cache / "go" / "mod"

    @property
    def gocache(self) -> Path:
        return self.cache / "go" / "build"

    # state
    @property
    def pki(self) -> Path:
        return self.state / "pki"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def run(self) -> Path:
        return self.state / "run"

    @property
    def kubelet_root(self) -> Path:
        return self.state / "kubelet"

    @property
    def plugins_registry(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.kubelet_root / "plugins"

    @property
    def containerd_root(self) -> Path:
        return self.state / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state / "admin.kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.state / "cluster.json"
