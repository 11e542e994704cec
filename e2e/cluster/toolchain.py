"""Builds the cluster's binaries and the test bed's tools from pinned Go modules, once.

Cluster binaries (`BUILDS`) land in ``<cache>/bin/<hash>``, the hash taken over their modules'
go.mod/go.sum/source files; each further tool (`ToolBuild`: the NVML mock library, NVIDIA's
container toolkit) lands in ``<cache>/tools/<name>-<hash of its own module>``, so adding or
changing a tool never rebuilds Kubernetes. An unchanged pin is never rebuilt. GOMODCACHE and
GOCACHE live in the same cache, which keeps warm CI runs fast. Go's own output goes to a log
file per build (``<cache>/logs``); the console gets one line per step ("building kubelet, 3 of
6"), a heartbeat with the modules downloaded so far, and the log's tail when a build fails.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from e2e.cluster import versions
from e2e.cluster.paths import REPO_ROOT, ClusterPaths

log = logging.getLogger(__name__)

TOOLCHAIN = REPO_ROOT / "e2e" / "toolchain"

HEARTBEAT_S = 30.0
"""How often a running Go build reports that it is still going."""

STALE_TOOL_AGE_S = 24 * 3600
"""Older builds of a test-bed tool are removed when at least this old: worktrees sharing one
cache build different versions of the same tool at the same time."""


@dataclass(frozen=True)
class GoBuild:
    module_dir: str
    packages: tuple[str, ...]
    ldflags: str = "-s -w"


def _kubernetes_ldflags() -> str:
    version = versions.KUBERNETES_VERSION
    major, minor = version.lstrip("v").split(".")[:2]
    pkgs = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    flags = ["-s", "-w"]
    for pkg in pkgs:
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(flags)


BUILDS = (
    GoBuild(
        "kubernetes",
        (
            *tuple(
                f"k8s.io/kubernetes/cmd/{name}"
                for name in (
                    "kube-apiserver",
                    "kube-controller-manager",
                    "kube-scheduler",
                    "kubelet",
                )
            ),
            "k8s.io/kubernetes/cmd/kubectl",
        ),
        _kubernetes_ldflags(),
    ),
    GoBuild(
        "containerd",
        (
            "github.com/containerd/containerd/v2/cmd/containerd",
            "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "github.com/containerd/containerd/v2/cmd/ctr",
        ),
    ),
    GoBuild("crictl", ("sigs.k8s.io/cri-tools/cmd/crictl",)),
    GoBuild("pause", (".",)),
)

BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "crictl",
    "pause",
)


def _digest_files(digest: hashlib._Hash, module_dir: str) -> None:
    for path in sorted((TOOLCHAIN / module_dir).rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(TOOLCHAIN)).encode())
            digest.update(path.read_bytes())


def toolchain_digest() -> str:
    """Hash of every file that decides what the cluster binaries are (pins and sources)."""
    digest = hashlib.sha256()
    for module_dir in sorted(item.module_dir for item in BUILDS):
        _digest_files(digest, module_dir)
    digest.update(_kubernetes_ldflags().encode())
    return digest.hexdigest()[:12]


def bin_dir(paths: ClusterPaths) -> Path:
    return paths.cache / "bin" / toolchain_digest()


def missing_binaries(paths: ClusterPaths) -> list[str]:
    directory = bin_dir(paths)
    return [name for name in BINARIES if not (directory / name).is_file()]


def go_env(paths: ClusterPaths, *, cgo: bool = False) -> dict[str, str]:
    """The environment of every Go build from pinned modules: the module and build caches in
    the cluster cache, the installed toolchain only, the pins exactly as written (no go.mod
    updates), no cgo unless asked for. bench/cel builds its reference program with it too."""
    return dict(
        os.environ,
        GOMODCACHE=str(paths.gomodcache),
        GOCACHE=str(paths.gocache),
        GOFLAGS="-modcacherw -mod=readonly",
        CGO_ENABLED="1" if cgo else "0",
        GOTOOLCHAIN="local",
    )


class GoBuildError(RuntimeError):
    """A Go build or generator failed; the message carries the log's last lines."""


def run_go(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], what: str, logs: Path
) -> None:
    """Run one Go command with its output in ``<logs>/<what>.log`` instead of the console.

    Logs a heartbeat every `HEARTBEAT_S` seconds (elapsed time, modules downloaded so far) and
    the duration at the end; raises `GoBuildError` with the log's last lines on failure.
    """
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{what.replace(' ', '-').replace('/', '-')}.log"
    started = time.monotonic()
    with log_path.open("wb") as output:
        process = subprocess.Popen(
            list(command), cwd=cwd, env=dict(env), stdout=output, stderr=subprocess.STDOUT
        )
        while True:
            try:
                returncode = process.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                log.info(
                    "toolchain: still building %s (%.0f s, %d modules downloaded; log %s)",
                    what,
                    time.monotonic() - started,
                    _downloads(log_path),
                    log_path,
                )
    if returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise GoBuildError(
            f"building {what} failed (exit {returncode}); the last lines of {log_path}:\n"
            + "\n".join(tail)
        )
    log.info("toolchain: built %s in %.0f s", what, time.monotonic() - started)


def _downloads(log_path: Path) -> int:
    return sum(
        1 for line in log_path.read_text(errors="replace").splitlines() if "downloading" in line
    )


@dataclass(frozen=True)
class ToolBuild:
    """A test-bed tool built from the module in ``e2e/toolchain/<name>``.

    `outputs` maps each file name in the tool's directory to the package it is built from
    (``"."`` for the module itself); `buildmode` is ``go build -buildmode`` (``c-shared`` for a
    C-ABI library, which needs `cgo`).
    """

    name: str
    outputs: tuple[tuple[str, str], ...]
    cgo: bool = False
    buildmode: str | None = None
    ldflags: str = "-s -w"

    def digest(self) -> str:
        digest = hashlib.sha256()
        _digest_files(digest, self.name)
        digest.update(repr(self).encode())
        return digest.hexdigest()[:12]


def tool_dir(paths: ClusterPaths, tool: ToolBuild) -> Path:
    return paths.cache / "tools" / f"{tool.name}-{tool.digest()}"


def tool_built(paths: ClusterPaths, tool: ToolBuild) -> bool:
    """Whether every output of `tool` is in its cache directory."""
    directory = tool_dir(paths, tool)
    return all((directory / name).is_file() for name, _ in tool.outputs)


def build_tool(
    paths: ClusterPaths, tool: ToolBuild, *, env: Mapping[str, str] | None = None
) -> Path:
    """Build `tool` unless its cached outputs exist; return the directory holding them.

    `env` adds to the build's environment (e.g. ``CGO_CFLAGS``); it is not part of the cache
    key, so it must only say where things are, never what is built. Older builds of the same
    tool (other hashes) are removed once the new one is complete, if more than a day old.
    """
    directory = tool_dir(paths, tool)
    if tool_built(paths, tool):
        return directory
    if shutil.which("go") is None:
        raise RuntimeError(f"Go is needed to build {tool.name}; install Go >= 1.26")
    staging = directory.with_name(directory.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    build_env = go_env(paths, cgo=tool.cgo) | dict(env or {})
    todo = [(name, package) for name, package in tool.outputs if not (staging / name).is_file()]
    for step, (name, package) in enumerate(todo, start=1):
        log.info("toolchain: building %s (%s, %d of %d)", name, tool.name, step, len(todo))
        command = ["go", "build", "-trimpath", "-ldflags", tool.ldflags]
        if tool.buildmode is not None:
            command.append(f"-buildmode={tool.buildmode}")
        command += ["-o", str(staging / name), package]
        run_go(
            command, cwd=TOOLCHAIN / tool.name, env=build_env, what=name, logs=paths.cache / "logs"
        )
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    for stale in directory.parent.glob(f"{tool.name}-*"):
        if stale == directory or stale.name.endswith(".partial"):
            continue
        # A build less than a day old may belong to another checkout sharing the cache.
        if time.time() - stale.stat().st_mtime > STALE_TOOL_AGE_S:
            shutil.rmtree(stale, ignore_errors=True)
    return directory


def build(paths: ClusterPaths) -> Path:
    """Build whatever is missing; return the directory holding all binaries."""
    directory = bin_dir(paths)
    if not missing_binaries(paths):
        log.info("toolchain: cached binaries in %s", directory)
        return directory
    if shutil.which("go") is None:
        raise RuntimeError("Go is needed to build the e2e cluster binaries; install Go ≥ 1.26")
    staging = directory.with_name(directory.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    env = go_env(paths)
    todo = [
        (item, [Path(p).name if p != "." else item.module_dir for p in item.packages])
        for item in BUILDS
    ]
    todo = [
        (item, wanted) for item, wanted in todo if not all((staging / n).is_file() for n in wanted)
    ]
    for step, (item, wanted) in enumerate(todo, start=1):
        log.info(
            "toolchain: building %s (%d of %d)%s",
            ", ".join(wanted),
            step,
            len(todo),
            "; about 10 minutes on 2 cores" if item.module_dir == "kubernetes" else "",
        )
        run_go(
            [
                "go",
                "build",
                "-trimpath",
                "-ldflags",
                item.ldflags,
                "-o",
                str(staging) + "/",
                *list(item.packages),
            ],
            cwd=TOOLCHAIN / item.module_dir,
            env=env,
            what=item.module_dir,
            logs=paths.cache / "logs",
        )
        if item.packages == (".",):
            # A single-package build names the binary after the module path's last element.
            built = staging / "pause"
            if not built.is_file():
                raise RuntimeError(f"expected {built} after building {item.module_dir}")
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    for stale in directory.parent.iterdir():
        if stale != directory:
            shutil.rmtree(stale, ignore_errors=True)
    return directory
