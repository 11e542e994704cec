"""GPU memory caps of shares enforced by the driver, per container (issue 16, item 3).

Both share tiers use it: MPS shares (`tiers.mps_shares`, where the cap comes on top of MPS's own
pinned limit) and capped shares (`tiers.capped_shares`, published only where it holds). Drivers
of the 615 branch limit the GPU memory of a cgroup (``nvmlDeviceSetMemoryLimits_v1``);
NVIDIA's container toolkit (v1.20.1+) applies ``NVIDIA_GPU_MEMORY_LIMIT`` /
``NVIDIA_GPU_MEMORY_REQUEST`` (MiB) of a container to its own cgroup with the ``createRuntime``
hook ``nvidia-cdi-hook apply-cuda-memory-limits``. The hook fails the container wherever the
driver cannot apply the limit, so `detect` decides once, at start, per offered GPU: the
setting (``--mps-share-memory-limits``), a real node, the driver version, cgroup v2, the hook's
version, and NVML answering ``nvmlDeviceGetMemoryLimits_v1`` for the plugin's own cgroup with
anything but NOT_SUPPORTED / FUNCTION_NOT_FOUND. `MemoryLimitSupport.edits` are the CDI edits of
one share: both variables and the hook where enforced, nothing elsewhere (for an MPS share the
MPS pinned limit, per process and cooperative, stays the only cap). MIG devices offered as
shares are never enforced (a ``MIG-`` UUID, whatever `detect` said: NVML takes no MIG handles).
See docs/shares.md.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Final

from gpu_dra.driver.nvml.interface import (
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_FOUND,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.cdi import ContainerEdits, Hook
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef

HOOK: Final = "apply-cuda-memory-limits"
CREATE_RUNTIME: Final = "createRuntime"
HOOK_ENV: Final = ("NVIDIA_CTK_DEBUG=false",)
LIMIT_ENV: Final = "NVIDIA_GPU_MEMORY_LIMIT"
REQUEST_ENV: Final = "NVIDIA_GPU_MEMORY_REQUEST"
MIN_DRIVER_BRANCH: Final = 615
MIN_TOOLKIT: Final = (1, 20, 1)
MODES: Final = ("auto", "off")
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
SELF_CGROUP: Final = Path("/proc/self/cgroup")
MIG_REASON: Final = (
    "a MIG device: the driver's cgroup memory limits (nvmlDeviceSetMemoryLimits_v1) do not "
    "support MIG handles; the MPS pinned limit within the slice is the only cap"
)
MIG_UUID_PREFIX: Final = "MIG-"
_VERSION: Final = re.compile(r"version\s+v?(\d+)\.(\d+)\.(\d+)", re.IGNORECASE)


class Enforcement(StrEnum):
    DRIVER = "driver"
    """The driver caps the container's cgroup (the hook); MPS's pinned limit stays as well."""
    MPS_CLIENT = "mps-client"
    """Only MPS's pinned limit: per CUDA process, and a process can drop it."""


@dataclass(frozen=True)
class MemoryLimitSupport:
    """What `detect` found: the GPUs the driver caps, and why the others are not."""

    hook_path: str = ""
    """Host path of ``nvidia-cdi-hook`` (``--nvidia-cdi-hook-path``)."""
    driver_root: str = "/"
    """The driver root as the host sees it: the hook's ``--driver-root``."""
    enforced: frozenset[str] = frozenset()
    """UUIDs of the GPUs whose shares get the hook."""
    reasons: Mapping[str, str] = field(default_factory=dict)
    """Why a GPU's shares do not get it, by UUID."""
    default_reason: str = "no GPU is offered as MPS shares"
    """Why, for a GPU `detect` was not asked about."""

    def without_mig(self, uuids: Collection[str]) -> MemoryLimitSupport:
        """This support, with the MIG devices ``uuids`` (offered as shares) never enforced:
        ``nvmlDeviceSetMemoryLimits_v1`` does not take MIG handles, and the hook refuses them."""
        reasons = {**self.reasons, **dict.fromkeys(uuids, MIG_REASON)}
        return replace(self, enforced=self.enforced - set(uuids), reasons=reasons)

    def capped(self, uuid: str) -> bool:
        """Whether the driver caps the shares of ``uuid``: never a MIG device's."""
        return uuid in self.enforced and not uuid.startswith(MIG_UUID_PREFIX)

    def enforcement(self, uuid: str) -> Enforcement:
        return Enforcement.DRIVER if self.capped(uuid) else Enforcement.MPS_CLIENT

    def why(self, uuid: str) -> str:
        """Why the GPU's shares are (not) capped by the driver."""
        if uuid.startswith(MIG_UUID_PREFIX):
            return MIG_REASON
        if uuid in self.enforced:
            return f"driver cgroup limit through {PurePosixPath(self.hook_path).name} {HOOK}"
        return self.reasons.get(uuid, self.default_reason)

    def edits(self, uuid: str, mib: int) -> ContainerEdits:
        """The CDI edits that make the driver cap each container of a share of ``uuid`` at
        ``mib`` MiB (request = limit); empty where the driver does not enforce."""
        if not self.capped(uuid):
            return ContainerEdits()
        if mib <= 0:
            raise ValueError(f"memory limit of a share must be positive, got {mib} MiB")
        base = PurePosixPath(self.hook_path).name
        fixed = (base, "hook") if base == "nvidia-ctk" else (base,)
        hook = Hook(
            hook_name=CREATE_RUNTIME,
            path=self.hook_path,
            args=(*fixed, HOOK, "--driver-root", self.driver_root, "--gpu-id", uuid),
            env=HOOK_ENV,
        )
        return ContainerEdits(env={LIMIT_ENV: str(mib), REQUEST_ENV: str(mib)}, hooks=(hook,))


@dataclass(frozen=True)
class ShareMemory:
    """What the MPS share tier needs: `MemoryLimitSupport` and where to report each share's
    enforcement (a Kubernetes Event on its claim; None: only logged)."""

    support: MemoryLimitSupport
    report: Callable[[ClaimRef, str], None] | None = None
    watchdog: str = ""
    """What checks the memory of a share the driver does not cap, for its message: the memory
    watchdog's policy and interval, or that it is off (`watchdog_note`); empty: not said."""


def watchdog_note(policy: str, interval_s: float) -> str:
    """How the memory watchdog treats a share the driver does not cap (``--mps-memory-watchdog``,
    ``--mps-memory-watchdog-interval``), as the share's message says it."""
    if policy == "off":
        return "no memory watchdog checks it (--mps-memory-watchdog=off)"
    return (
        f"the memory watchdog checks its processes every {interval_s:g}s and acts on an overrun "
        f"after the fact (--mps-memory-watchdog={policy})"
    )


def hook_version(path: str, *, timeout_s: float = 5.0) -> tuple[int, int, int] | None:
    """``<path> --version`` parsed (``NVIDIA CDI Hook version 1.20.1``); None when it cannot
    be run or says no version."""
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION.search(done.stdout + done.stderr)
    if done.returncode != 0 or match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3])


def own_cgroup(proc_self_cgroup: Path = SELF_CGROUP, cgroup_root: Path = CGROUP_ROOT) -> str | None:
    """The full sysfs path of this process's cgroup v2 (the ``0::`` line), or None."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            relative = line[3:].strip().lstrip("/")
            return str(cgroup_root / relative) if relative else str(cgroup_root)
    return None


def detect(
    nvml: NvmlLibrary,
    gpus: Sequence[str],
    *,
    mode: str,
    simulated: bool,
    hook_path: str,
    driver_root: str,
    hook_candidates: Collection[Path],
    disabled_hooks: Collection[str] = (),
    cgroup_root: Path = CGROUP_ROOT,
    proc_self_cgroup: Path = SELF_CGROUP,
    version_of: Callable[[str], tuple[int, int, int] | None] = hook_version,
) -> MemoryLimitSupport:
    """Which of ``gpus`` (UUIDs of the GPUs offered as shares) get the hook, and why not (see
    the module doc). ``hook_candidates`` are where the plugin may see ``hook_path`` (its host
    path, or under a mounted root); the first that runs is asked its version."""
    base = MemoryLimitSupport(hook_path=hook_path, driver_root=driver_root)
    if not gpus:
        return base

    def nowhere(reason: str) -> MemoryLimitSupport:
        return MemoryLimitSupport(
            hook_path=hook_path, driver_root=driver_root, default_reason=reason,
            reasons=dict.fromkeys(gpus, reason),
        )  # fmt: skip

    if mode == "off":
        return nowhere("turned off (--mps-share-memory-limits=off)")
    if "all" in disabled_hooks or HOOK in disabled_hooks:
        return nowhere("nvidia-cdi-hook hooks are turned off (--disable-cdi-hooks)")
    if simulated:
        return nowhere("simulated GPUs: no driver to apply a cgroup limit")
    if not (cgroup_root / "cgroup.controllers").is_file():
        return nowhere(f"{cgroup_root} is not cgroup v2 (the driver limits cgroup v2 only)")
    cgroup = own_cgroup(proc_self_cgroup, cgroup_root)
    if cgroup is None:
        return nowhere(f"no cgroup v2 entry in {proc_self_cgroup} to ask NVML about")
    version = next((v for c in hook_candidates if (v := version_of(str(c))) is not None), None)
    if version is None:
        return nowhere(
            f"{hook_path} cannot be run from the plugin to check it has {HOOK} (seen at: "
            f"{', '.join(map(str, hook_candidates)) or 'nowhere'})"
        )
    if version < MIN_TOOLKIT:
        return nowhere(
            f"{hook_path} is version {'.'.join(map(str, version))}; {HOOK} needs NVIDIA "
            f"container toolkit {'.'.join(map(str, MIN_TOOLKIT))} or newer"
        )
    try:
        nvml.init()
    except NVMLError as error:
        return nowhere(f"NVML cannot be initialised: {error}")
    try:
        return _probe(nvml, gpus, cgroup, base, nowhere)
    finally:
        with contextlib.suppress(NVMLError):
            nvml.shutdown()


def _probe(
    nvml: NvmlLibrary,
    gpus: Sequence[str],
    cgroup: str,
    base: MemoryLimitSupport,
    nowhere: Callable[[str], MemoryLimitSupport],
) -> MemoryLimitSupport:
    try:
        driver = nvml.system_get_driver_version()
    except NVMLError as error:
        return nowhere(f"the driver version cannot be read: {error}")
    branch = driver.split(".", 1)[0]
    if not branch.isdigit() or int(branch) < MIN_DRIVER_BRANCH:
        return nowhere(
            f"driver {driver} has no per-cgroup GPU memory limits (branch "
            f"{MIN_DRIVER_BRANCH} or newer)"
        )
    enforced: set[str] = set()
    reasons: dict[str, str] = {}
    for uuid in gpus:
        try:
            nvml.device_get_memory_limits(nvml.device_get_handle_by_uuid(uuid), cgroup)
        except NVMLError as error:
            code = return_code(error)
            if code == NVML_ERROR_FUNCTION_NOT_FOUND:
                return nowhere(f"driver {driver}'s NVML has no nvmlDeviceGetMemoryLimits_v1")
            if code != NVML_ERROR_NOT_FOUND:  # NOT_FOUND: no limit set, which is fine
                name = return_code_name(code) if code is not None else str(error)
                reasons[uuid] = f"NVML answers {name} for memory limits of {uuid} ({cgroup})"
                continue
        enforced.add(uuid)
    return MemoryLimitSupport(
        hook_path=base.hook_path,
        driver_root=base.driver_root,
        enforced=frozenset(enforced),
        reasons=reasons,
        default_reason="not offered as MPS shares at start",
    )
