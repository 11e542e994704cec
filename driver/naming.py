"""Names the driver publishes or derives: devices, pools, CDI devices and CDI spec files.

Formats are NVIDIA's (``shared/reference/nvidia-compat.md`` §2), so claims and checkpoints written
by either driver keep resolving. Each ``parse_*`` inverts its formatter: ``parse(format(x)) == x``.
Names built from claim data are validated first and rejected with `InvalidNameError`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

DEFAULT_DRIVER_NAME: Final = "gpu.nvidia.com"
CDI_CLASS: Final = "claim"

_LABEL: Final = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL: Final = re.compile(rf"^{_LABEL}$")
_DNS_SUBDOMAIN: Final = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_UID: Final = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_GPU_NAME: Final = re.compile(r"^gpu-(0|[1-9][0-9]*)$")
_MIG_NAME: Final = re.compile(r"^gpu-(0|[1-9][0-9]*)-mig-(.+)-(0|[1-9][0-9]*)-(0|[1-9][0-9]*)$")
_MIG_PROFILE_SLUG: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_UID_LENGTH: Final = 36


class InvalidNameError(ValueError):
    """A name or its parts do not have the required form; the message shows the value and form."""


@dataclass(frozen=True)
class GpuDeviceName:
    """A full GPU: ``gpu-<minor>``."""

    minor: int

    def __post_init__(self) -> None:
        if self.minor < 0:
            raise InvalidNameError(f"GPU minor number must not be negative, got {self.minor}")

    def __str__(self) -> str:
        return f"gpu-{self.minor}"


@dataclass(frozen=True)
class MigDeviceName:
    """A MIG device: ``gpu-<parent minor>-mig-<profile slug>-<GI profile id>-<placement start>``.

    `profile` is the slug of the go-nvlib profile name (`mig_profile_slug`): ``1g10gb-me``.
    """

    parent_minor: int
    profile: str
    gi_profile_id: int
    placement_start: int

    def __post_init__(self) -> None:
        numbers = (self.parent_minor, self.gi_profile_id, self.placement_start)
        if min(numbers) < 0:
            raise InvalidNameError(f"MIG device name numbers must not be negative, got {numbers}")
        if not _MIG_PROFILE_SLUG.match(self.profile):
            raise InvalidNameError(
                f"MIG profile slug {self.profile!r} must be lower-case letters, digits and '-' "
                "(use mig_profile_slug)"
            )
        validate_device_name(str(self))

    @classmethod
    def for_profile(
        cls, parent_minor: int, profile: str, gi_profile_id: int, placement_start: int
    ) -> MigDeviceName:
        """From a go-nvlib profile name such as ``1g.10gb+me``."""
        return cls(parent_minor, mig_profile_slug(profile), gi_profile_id, placement_start)

    def __str__(self) -> str:
        parent, profile = self.parent_minor, self.profile
        return f"gpu-{parent}-mig-{profile}-{self.gi_profile_id}-{self.placement_start}"


DeviceName = GpuDeviceName | MigDeviceName


def gpu_device_name(minor: int) -> str:
    """``gpu-<minor>``."""
    return str(GpuDeviceName(minor))


def mig_device_name(
    parent_minor: int, profile: str, gi_profile_id: int, placement_start: int
) -> str:
    """``gpu-<parent minor>-mig-<profile slug>-<GI profile id>-<placement start>``."""
    return str(MigDeviceName.for_profile(parent_minor, profile, gi_profile_id, placement_start))


# go-nvlib NewMigProfile: G by NVML_GPU_INSTANCE_PROFILE_* index, C by
# NVML_COMPUTE_INSTANCE_PROFILE_* value, "+me" for the media-extension GI profiles (REV1).
_GI_PROFILE_SLICES: Final = {0: 1, 7: 1, 9: 1, 1: 2, 8: 2, 2: 3, 3: 4, 6: 6, 4: 7, 5: 8}
_CI_PROFILE_SLICES: Final = {0: 1, 7: 1, 1: 2, 2: 3, 3: 4, 6: 6, 4: 7, 5: 8}
_MEDIA_EXTENSION_GI_PROFILES: Final = frozenset({7, 8})
_MIB: Final = 1024 * 1024
_GIB: Final = 1024 * 1024 * 1024


def mig_profile_name(
    gi_profile_index: int,
    ci_profile: int | None,
    memory_mib: int,
    device_memory_bytes: int,
    *,
    gi_slices: int | None = None,
    ci_slices: int | None = None,
) -> str:
    """go-nvlib's name of a MIG profile: ``1g.10gb``, ``1g.10gb+me``, ``1c.3g.40gb``.

    `gi_profile_index` is the ``NVML_GPU_INSTANCE_PROFILE_*`` index (not the profile ID),
    `ci_profile` the ``NVML_COMPUTE_INSTANCE_PROFILE_*`` value (None: the full compute instance,
    C == G, as dynamic MIG makes it), `memory_mib` the GI profile's
    ``memorySizeMB`` and `device_memory_bytes` the parent's total memory (the GB figure is the
    memory fraction rounded up to eighths, times the parent's size in whole GiB, so the total
    must be exact to reproduce NVIDIA's names). Profiles go-nvlib does not know (newer NVML
    constants) take their slice counts from `gi_slices` / `ci_slices` (the profile infos'
    ``sliceCount``); without them they are an `InvalidNameError`.
    """
    g = _GI_PROFILE_SLICES.get(gi_profile_index, gi_slices)
    c = g if ci_profile is None else _CI_PROFILE_SLICES.get(ci_profile, ci_slices)
    if g is None or c is None or g <= 0 or c <= 0:
        raise InvalidNameError(
            f"no MIG profile name for GPU-instance profile {gi_profile_index} / compute-instance "
            f"profile {ci_profile}"
        )
    if device_memory_bytes <= 0 or memory_mib <= 0:
        raise InvalidNameError(
            f"no MIG profile name for {memory_mib} MiB of a GPU with {device_memory_bytes} bytes"
        )
    fraction = math.ceil(memory_mib * _MIB / device_memory_bytes * 8) / 8
    total_gb = (device_memory_bytes + _GIB - 1) // _GIB
    gb = math.floor(fraction * total_gb + 0.5)  # Go's math.Round: halves away from zero
    suffix = "+me" if gi_profile_index in _MEDIA_EXTENSION_GI_PROFILES else ""
    return f"{g}g.{gb}gb{suffix}" if c == g else f"{c}c.{g}g.{gb}gb{suffix}"


def mig_profile_slug(profile: str) -> str:
    """NVIDIA's device-name form of a MIG profile: dots dropped, lower-cased, others -> ``-``.

    ``1g.10gb`` -> ``1g10gb``, ``1g.10gb+me`` -> ``1g10gb-me``.
    """
    slug = re.sub(r"[^a-z0-9-]", "-", profile.replace(".", "").lower())
    if not _MIG_PROFILE_SLUG.match(slug):
        raise InvalidNameError(f"MIG profile {profile!r} gives no usable device name part")
    return slug


def parse_device_name(name: str) -> DeviceName:
    """Inverse of ``str(GpuDeviceName)`` and ``str(MigDeviceName)``."""
    if match := _GPU_NAME.match(name):
        return GpuDeviceName(int(match[1]))
    if match := _MIG_NAME.match(name):
        return MigDeviceName(int(match[1]), match[2], int(match[3]), int(match[4]))
    raise InvalidNameError(
        f"device name {name!r} is neither gpu-<minor> nor "
        "gpu-<minor>-mig-<profile>-<profile id>-<placement start>"
    )


def validate_device_name(name: str) -> str:
    """`name` if it is a DNS label (what ResourceSlices allow as device names)."""
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise InvalidNameError(
            f"device name {name!r} is not a DNS label (at most 63 lower-case letters, digits "
            "and '-', starting and ending with a letter or digit)"
        )
    return name


def validate_claim_uid(uid: str) -> str:
    """`uid` if it is a Kubernetes object UID (lower-case UUID)."""
    if not _UID.match(uid):
        raise InvalidNameError(
            f"claim UID {uid!r} is not a lower-case UUID like 0b4e1b48-8a2c-4d2f-9a51-3c1f2d3e4f50"
        )
    return uid


def validate_driver_name(driver_name: str) -> str:
    """`driver_name` if it is a DNS subdomain of at most 63 characters."""
    if len(driver_name) > 63 or not _DNS_SUBDOMAIN.match(driver_name):
        raise InvalidNameError(
            f"driver name {driver_name!r} is not a DNS subdomain of at most 63 characters"
        )
    return driver_name


def pool_name(node_name: str) -> str:
    """One pool per node, named after it."""
    if len(node_name) > 253 or not _DNS_SUBDOMAIN.match(node_name):
        raise InvalidNameError(f"node name {node_name!r} is not a DNS subdomain")
    return node_name


def cdi_vendor(driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """``k8s.<driver name>``."""
    return f"k8s.{validate_driver_name(driver_name)}"


def cdi_kind(driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """``k8s.gpu.nvidia.com/claim``: the ``kind`` of the driver's CDI specs."""
    return f"{cdi_vendor(driver_name)}/{CDI_CLASS}"


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    """``<claim UID>-<device name>``: one CDI device per claim and allocated device."""
    return f"{validate_claim_uid(claim_uid)}-{validate_device_name(device_name)}"


def parse_cdi_device_name(name: str) -> tuple[str, str]:
    """(claim UID, device name) of `cdi_device_name`'s result."""
    uid, separator, device = name[:_UID_LENGTH], name[_UID_LENGTH:][:1], name[_UID_LENGTH + 1 :]
    if separator != "-":
        raise InvalidNameError(f"CDI device name {name!r} is not <claim UID>-<device name>")
    return validate_claim_uid(uid), validate_device_name(device)


def qualified_cdi_device(
    claim_uid: str, device_name: str, driver_name: str = DEFAULT_DRIVER_NAME
) -> str:
    """``k8s.gpu.nvidia.com/claim=<claim UID>-<device name>``, as returned to the kubelet."""
    return f"{cdi_kind(driver_name)}={cdi_device_name(claim_uid, device_name)}"


def cdi_spec_file_name(claim_uid: str, driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """``k8s.gpu.nvidia.com-claim_<claim UID>.yaml``: the claim's transient CDI spec file."""
    return f"{cdi_vendor(driver_name)}-{CDI_CLASS}_{validate_claim_uid(claim_uid)}.yaml"


def parse_cdi_spec_file_name(file_name: str, driver_name: str = DEFAULT_DRIVER_NAME) -> str:
    """The claim UID in a `cdi_spec_file_name` result of this driver."""
    prefix = f"{cdi_vendor(driver_name)}-{CDI_CLASS}_"
    if not (file_name.startswith(prefix) and file_name.endswith(".yaml")):
        raise InvalidNameError(f"{file_name!r} is not a CDI spec file name like {prefix}<UID>.yaml")
    return validate_claim_uid(file_name[len(prefix) : -len(".yaml")])
