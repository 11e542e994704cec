"""This node's devices: what gets published, and what a container receives for each.

Devices are whole GPUs (MIG mode off) and static MIG devices, or with dynamic MIG
(`dynamic_mig`) partitionable GPUs in partitionable form (`gpu_dra.driver.partitions`), whose
`MigPartition`s prepare makes into MIG devices. A real GPU or MIG device gets the device nodes
that let a process open it (common edits: `nvidia_userspace.CommonEdits`); a simulated one gets
per-device environment variables and a read-only fact file instead. Both carry the per-device
environment, so workloads and tests see which GPU or slice they got.
See docs/architecture.md#what-a-container-gets and docs/real-nodes.md#what-a-container-gets.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gpu_dra.driver import attributes, partitions, shares, slices
from gpu_dra.driver.health import DeviceScope
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import MigPolicy
from gpu_dra.driver.model import Gpu, MigCapableGpu, MigDevice, MigPartition, NodeDevices
from gpu_dra.driver.naming import gpu_device_name, mig_device_name
from gpu_dra.driver.resourceapi import CounterSet, Device, DeviceTaint
from gpu_dra.kubelet_plugin.cdi import ContainerEdits, DeviceNode, Mount
from gpu_dra.kubelet_plugin.nvidia_driver_root import HOST_INSTALLED_DRIVER, DriverRoot
from gpu_dra.kubelet_plugin.nvidia_userspace import (
    DEFAULT_CDI_HOOK_PATH,
    gpu_device_edits,
    mig_capability_nodes,
)
from gpu_dra.kubelet_plugin.simulated_facts import SharedFactFiles

# Where simulated devices' fact files appear inside containers.
CONTAINER_DEVICE_DIR = "/run/gpu-dra/devices"

InventoryDevice = Gpu | MigDevice
"""What a container can be given: a whole GPU or an existing (static or made) MIG device."""

PublishedDevice = Gpu | MigDevice | MigPartition
"""What `NodeInventory.by_name` hands out: a whole GPU, a static MIG device, or (dynamic MIG) a
partition, which the prepare step turns into a MIG device before handing it out."""

MigCapabilityLookup = Callable[[int, int, int | None], int]
"""(parent GPU minor, GI id, CI id or None for the GI itself) -> minor of its nvidia-cap node."""

_DEVICE_FILE_MINOR: Final = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


class MigCapabilityError(OSError):
    """A MIG device's capability device node cannot be found; the message says where we looked.

    An `OSError`: the preparer reports it as a claim failure the kubelet retries.
    """


def device_env_prefix(device_name: str) -> str:
    """`gpu-3` -> `GPU_DRA_GPU_3`: per-device variables never collide in one container."""
    return "GPU_DRA_" + device_name.upper().replace("-", "_")


def device_name(device: PublishedDevice) -> str:
    """The published name: ``gpu-<minor>`` or ``gpu-<minor>-mig-<profile>-<id>-<start>``."""
    if isinstance(device, MigPartition):
        return partitions.partition_device_name(device)
    if isinstance(device, MigDevice):
        return mig_device_name(
            device.parent.minor, device.profile, device.gi_profile_id, device.placement_start
        )
    return gpu_device_name(device.minor)


class ProcMigCapabilities:
    """`MigCapabilityLookup` from the NVIDIA driver's procfs, as the container toolkit does it.

    The capability of GPU instance `g` on GPU `m` is
    ``<proc>/driver/nvidia/capabilities/gpu<m>/mig/gi<g>/access`` (a compute instance's adds
    ``/ci<c>``); its ``DeviceFileMinor:`` line is N of ``/dev/nvidia-caps/nvidia-cap<N>``.
    Drivers that do not print it are answered from ``<proc>/driver/nvidia-caps/mig-minors``
    (lines like ``gpu0/gi1/ci0/access 13``). Roots are tried in order; the first answer wins.
    """

    def __init__(self, proc_roots: Sequence[Path] = (Path("/proc"),)) -> None:
        self.proc_roots = tuple(dict.fromkeys(proc_roots))

    def __call__(self, parent_minor: int, gi_id: int, ci_id: int | None) -> int:
        capability = f"gpu{parent_minor}/mig/gi{gi_id}" + ("" if ci_id is None else f"/ci{ci_id}")
        legacy = f"gpu{parent_minor}/gi{gi_id}" + ("" if ci_id is None else f"/ci{ci_id}")
        looked = []
        for root in self.proc_roots:
            access = root / "driver/nvidia/capabilities" / capability / "access"
            looked.append(str(access))
            minor = _read_minor(access)
            if minor is not None:
                return minor
            minors_file = root / "driver/nvidia-caps/mig-minors"
            looked.append(f"{minors_file} ({legacy}/access)")
            minor = _mig_minors(minors_file).get(f"{legacy}/access")
            if minor is not None:
                return minor
        what = f"GPU instance {gi_id}" + ("" if ci_id is None else f", compute instance {ci_id}")
        raise MigCapabilityError(
            f"cannot find the MIG capability device of GPU {parent_minor} {what}: looked in "
            f"{', '.join(looked)}; is the MIG device still there and the driver's procfs "
            "visible to the plugin?"
        )


def _read_minor(access: Path) -> int | None:
    try:
        text = access.read_text()
    except OSError:
        return None
    match = _DEVICE_FILE_MINOR.search(text)
    return None if match is None else int(match[1])


def _mig_minors(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    minors = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            minors[parts[0]] = int(parts[1])
    return minors


@dataclass(frozen=True)
class NodeInventory:
    """The devices of this node, by device name, and how they are handed to containers.

    `gpus` are all GPUs (those in MIG mode included: they are never published whole);
    `mig_devices` the static MIG devices discovered on them. `driver` is where real devices'
    nodes are found (its ``/dev`` root, sysfs for DRM nodes) and what host paths they get;
    `cdi_hook_path` / `disabled_cdi_hooks` shape the hook that makes DRM by-path links.
    `mig_capabilities` finds the capability nodes of real MIG devices (default: the driver's
    procfs under the driver root, then ``/proc``). With `dynamic_mig`, the GPUs of
    `mig_profiles` that `partitions.is_partitionable` accepts under `mig_policy` are published
    in partitionable form (their static MIG devices are not published), their partitions limited
    to the profiles `mig_policy` offers; without it `mig_profiles` is ignored.
    """

    gpus: tuple[Gpu, ...]
    simulated: bool
    driver: DriverRoot = HOST_INSTALLED_DRIVER
    mig_devices: tuple[MigDevice, ...] = ()
    mig_capabilities: MigCapabilityLookup | None = None
    dynamic_mig: bool = False
    mig_profiles: tuple[MigCapableGpu, ...] = ()
    mig_policy: MigPolicy = DEFAULT_MIG_POLICY
    mps_shares: tuple[Gpu, ...] = ()
    """Whole GPUs offered as MPS shares (`shares.ShareSelection.select`); with dynamic MIG only
    GPUs it does not partition."""
    capped_shares: tuple[Gpu, ...] = ()
    """Whole GPUs offered as capped time-sliced shares (``--capped-shares``, only where the
    driver caps memory per container: `tiers.capped_shares`); never also in `mps_shares`."""
    mig_mps_shares: tuple[MigDevice, ...] = ()
    """Static MIG devices offered as MPS shares (`shares.MigShareSelection.select`); with
    dynamic MIG only those of GPUs it does not partition."""
    partition_shares: tuple[MigPartition, ...] = ()
    """Dynamic MIG partitions offered as MPS shares (`shares.PartitionShareSelection.select`):
    the MIG device is made for the first share and destroyed after the last."""
    share_replicas: int = shares.DEFAULT_SHARE_REPLICAS
    """``--mps-share-replicas``: an amount a share does not name is 1/N of its device
    (`shares.default_share`), for every kind of offered device."""
    cdi_hook_path: str = DEFAULT_CDI_HOOK_PATH
    disabled_cdi_hooks: frozenset[str] = frozenset()
    fact_files: SharedFactFiles | None = field(default=None, compare=False, repr=False)
    """Simulated only: where the fact files of the node's own devices are kept, mounted by
    every claim of them (`simulated_facts`); without it each claim gets a file of its own."""
    _by_name: dict[str, PublishedDevice] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )
    _partitioned: partitions.PartitionedNode | None = field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        names = [gpu_device_name(gpu.minor) for gpu in self.gpus]
        if len(set(names)) != len(names):
            raise ValueError(f"two GPUs share a minor number: {sorted(names)}")
        uuids = {gpu.uuid for gpu in self.gpus}
        both = sorted({g.uuid for g in self.mps_shares} & {g.uuid for g in self.capped_shares})
        if both:
            raise shares.ShareSelectionError(
                f"GPU {', '.join(both)} is selected by both --mps-shares and --capped-shares; "
                "a GPU is offered one way: name it in one of the two"
            )
        if self.dynamic_mig:
            partitioned = partitions.partitioned_node(
                self.gpus, self.mig_devices, self.mig_profiles, self.mig_policy
            )
            object.__setattr__(self, "_partitioned", partitioned)
        by_name = self._by_name
        for device in self._offered():
            name = device_name(device)
            if not isinstance(device, Gpu) and device.parent.uuid not in uuids:
                raise ValueError(f"MIG device {name}: parent GPU {device.parent.uuid} is unknown")
            if name in by_name:
                raise ValueError(
                    f"two devices share the name {name}: {_describe(by_name[name])} and "
                    f"{_describe(device)} (two compute instances in one GPU instance?)"
                )
            by_name[name] = device

    @classmethod
    def from_discovery(
        cls,
        devices: NodeDevices,
        *,
        simulated: bool,
        driver: DriverRoot = HOST_INSTALLED_DRIVER,
        mig_capabilities: MigCapabilityLookup | None = None,
        dynamic_mig: bool = False,
        mig_policy: MigPolicy = DEFAULT_MIG_POLICY,
        mps_shares: shares.ShareSelection | None = None,
        capped_shares: shares.ShareSelection | None = None,
        mps_shares_on_mig: shares.MigShareSelection | None = None,
        mps_shares_on_dynamic_mig: shares.PartitionShareSelection | None = None,
        share_replicas: int = shares.DEFAULT_SHARE_REPLICAS,
        cdi_hook_path: str = DEFAULT_CDI_HOOK_PATH,
        disabled_cdi_hooks: frozenset[str] = frozenset(),
        fact_files: SharedFactFiles | None = None,
    ) -> NodeInventory:
        """The inventory of what `discover_devices` found (with ``mig_profiles=dynamic_mig``);
        `mps_shares` picks the GPUs offered as MPS shares, `capped_shares` those offered as
        capped shares, before the driver's support is checked (`shares.ShareSelectionError` when
        one names a GPU that is not there, or one dynamic MIG partitions, or both one GPU);
        `mps_shares_on_mig` the static MIG devices offered as MPS shares,
        `mps_shares_on_dynamic_mig` the partitions (`shares.ShareSelectionError` when it
        selects any without dynamic MIG); `share_replicas` the equal part a share's unnamed
        amounts are."""
        selection = mps_shares or shares.ShareSelection()
        capped = capped_shares or shares.ShareSelection(flag="--capped-shares")
        on_mig = mps_shares_on_mig or shares.MigShareSelection()
        partitioned = (
            {
                mig_gpu.gpu.uuid
                for mig_gpu in devices.mig_profiles
                if partitions.is_partitionable(mig_gpu, mig_policy)
            }
            if dynamic_mig
            else set()
        )
        on_partitions = mps_shares_on_dynamic_mig or shares.PartitionShareSelection()
        if not on_partitions.empty and not dynamic_mig:
            raise shares.ShareSelectionError(
                "--mps-shares-on-dynamic-mig offers dynamic MIG partitions as shares, but "
                "--dynamic-mig is off: turn it on, or offer static MIG devices with "
                "--mps-shares-on-mig"
            )
        offered_partitions = [
            partition
            for mig_gpu in devices.mig_profiles
            if mig_gpu.gpu.uuid in partitioned
            for partition in partitions.offered_partitions(mig_gpu, mig_policy)
        ]
        return cls(
            devices.gpus,
            simulated=simulated,
            driver=driver,
            mig_devices=devices.mig_devices,
            mig_capabilities=mig_capabilities,
            dynamic_mig=dynamic_mig,
            mig_profiles=devices.mig_profiles,
            mig_policy=mig_policy,
            mps_shares=selection.select(devices.gpus, partitioned=partitioned),
            capped_shares=capped.select(devices.gpus, partitioned=partitioned),
            mig_mps_shares=on_mig.select(devices.mig_devices, partitioned=partitioned),
            partition_shares=on_partitions.select(offered_partitions),
            share_replicas=share_replicas,
            cdi_hook_path=cdi_hook_path,
            disabled_cdi_hooks=disabled_cdi_hooks,
            fact_files=fact_files,
        )

    def _offered(self) -> list[PublishedDevice]:
        offered: list[PublishedDevice]
        if self._partitioned is not None:
            whole = {gpu_device_name(gpu.minor): gpu for gpu in self.gpus}
            static = {device_name(mig): mig for mig in self.mig_devices}
            partitioned = {device_name(p): p for p in self._partitioned.partitions}
            offered = []
            for device in self._partitioned.devices:
                name = device["name"]
                found = partitioned.get(name) or static.get(name) or whole.get(name)
                if found is None:  # a bug in partitions.partitioned_node
                    raise ValueError(f"published device {name} is not in the inventory")
                offered.append(found)
            return offered
        offered = [gpu for gpu in self.gpus if not gpu.mig_enabled]
        offered.extend(self.mig_devices)
        return offered

    def by_name(self, device_name: str) -> PublishedDevice | None:
        """The published device with this name; None for unknown names and MIG-mode parents.

        With dynamic MIG, a partition's name gives its `MigPartition` (parent GPU, profile,
        placement); the MIG device it becomes exists only while a claim holds it.
        """
        return self._by_name.get(device_name)

    def shared_gpu(self, device_name: str) -> shares.OfferedDevice | None:
        """The GPU, static MIG device or dynamic MIG partition named ``device_name`` if it is
        offered as MPS shares."""
        device = self._by_name.get(device_name)
        if isinstance(device, Gpu):
            return device if device in self.mps_shares else None
        if isinstance(device, MigDevice):
            return device if device in self.mig_mps_shares else None
        return device if device in self.partition_shares else None

    @property
    def shared_devices(self) -> tuple[shares.SharedDevice, ...]:
        """Every device offered as MPS shares: the whole GPUs, then the static MIG devices."""
        return (*self.mps_shares, *self.mig_mps_shares)

    def capped_gpu(self, device_name: str) -> Gpu | None:
        """The GPU named ``device_name`` if it is offered as capped shares."""
        device = self._by_name.get(device_name)
        return device if isinstance(device, Gpu) and device in self.capped_shares else None

    def published_devices(self) -> list[Device]:
        """Devices in PCI bus order, MIG devices by placement (NVIDIA's publishing order); with
        dynamic MIG, each partitionable GPU's devices by name; GPUs, MIG devices and partitions
        offered as MPS shares, and GPUs offered as capped shares, with their consumable
        capacities (`shares.with_shares`; defaults 1/`share_replicas`)."""
        if self._partitioned is not None:
            published = list(self._partitioned.devices)
        else:
            published = attributes.published_devices(self.gpus, self.mig_devices)
        offered = (*self.shared_devices, *self.partition_shares)
        return shares.with_shares(
            published, offered, self.capped_shares, replicas=self.share_replicas
        )

    def partitionable_gpus(self) -> tuple[Gpu, ...]:
        """The GPUs published in partitionable form, in PCI bus order: dynamic MIG makes and
        destroys their MIG devices. None without dynamic MIG."""
        if self._partitioned is None:
            return ()
        parents = {p.parent.uuid: p.parent for p in self._partitioned.partitions}
        return tuple(sorted(parents.values(), key=lambda gpu: gpu.pci_bus_id))

    def counter_sets(self) -> list[CounterSet]:
        """The counter sets the published devices consume (dynamic MIG only; else none)."""
        return [] if self._partitioned is None else list(self._partitioned.counter_sets)

    def desired_pool(
        self,
        driver: str,
        node_name: str,
        layout: slices.SliceLayout = slices.SliceLayout.SPLIT,
        taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    ) -> slices.DesiredPool:
        """The node's pool: counter sets in their own slices (`SliceLayout.SPLIT`, Kubernetes
        1.35+) or with the devices that consume them (`SliceLayout.COMBINED`, 1.34); the
        devices named in `taints` (health) carry those taints."""
        return slices.build_pool(
            driver,
            node_name,
            node_name,
            self.published_devices(),
            self.counter_sets(),
            order=slices.DeviceOrder.GIVEN,
            layout=layout,
            taints=taints,
        )

    def health_scopes(self) -> list[DeviceScope]:
        """Each published device with the GPU whose health it shares (a static MIG device also
        with its GPU and compute instance ids, a partition with its GI profile ID and placement
        start), in publishing order."""
        scopes = []
        for device in self.published_devices():
            found = self._by_name[device["name"]]
            if isinstance(found, MigDevice):
                mig = (found.gi_id, found.ci_id)
                scopes.append(DeviceScope(device["name"], found.parent.uuid, mig))
            elif isinstance(found, MigPartition):
                placement = (found.gi_profile_id, found.placement_start)
                scopes.append(DeviceScope(device["name"], found.parent.uuid, placement=placement))
            else:
                scopes.append(DeviceScope(device["name"], found.uuid))
        return scopes

    def _discovered(self, device: InventoryDevice) -> bool:
        """Whether ``device`` is one the node had at start (not a MIG device made since)."""
        if isinstance(device, Gpu):
            return True
        return any(static.uuid == device.uuid for static in self.mig_devices)

    def container_edits(self, device: InventoryDevice, claim_dir: Path) -> ContainerEdits:
        """Edits for one device; simulated ones get their fact file mounted: the shared one of
        `fact_files` for a device of the node's own, else one written to `claim_dir` (made
        when missing; no other device puts a file there).

        Real devices get their own device nodes only (those missing under the ``/dev`` root are
        left out and logged); the driver's common edits are `nvidia_userspace.CommonEdits`.
        Raises `MigCapabilityError` for a real MIG device whose capability nodes are not found,
        `nvidia_driver_root.DriverUserspaceError` when the ``nvidia-caps`` major is unknown.
        """
        name = device_name(device)
        prefix = device_env_prefix(name)
        if isinstance(device, MigDevice):
            gpu = device.parent
            env = {
                f"{prefix}_UUID": device.uuid,
                f"{prefix}_PARENT_UUID": gpu.uuid,
                f"{prefix}_PROFILE": device.profile,
                f"{prefix}_PRODUCT": gpu.product_name,
            }
        else:
            gpu = device
            env = {f"{prefix}_UUID": gpu.uuid, f"{prefix}_PRODUCT": gpu.product_name}
        if self.simulated:
            text = json.dumps(_facts(device), indent=2, sort_keys=True) + "\n"
            if self.fact_files is not None and self._discovered(device):
                facts = self.fact_files.path(name, text)
            else:
                claim_dir.mkdir(parents=True, exist_ok=True)
                claim_dir.chmod(0o755)
                facts = claim_dir / f"{name}.json"
                facts.write_text(text)
                facts.chmod(0o644)
            return ContainerEdits(
                env={**env, f"{prefix}_SIMULATED": "true"},
                mounts=(
                    Mount(
                        host_path=str(facts),
                        container_path=f"{CONTAINER_DEVICE_DIR}/{name}.json",
                        options=("ro", "nosuid", "nodev", "bind"),
                    ),
                ),
            )
        # A MIG device gets its parent's DRM nodes only if its profile has graphics (+gfx).
        with_drm = not isinstance(device, MigDevice) or "gfx" in device.profile.split("+")[1:]
        nodes = gpu_device_edits(
            self.driver,
            gpu.minor,
            gpu.pci_bus_id,
            with_drm=with_drm,
            hook_path=self.cdi_hook_path,
            disabled_hooks=self.disabled_cdi_hooks,
        )
        caps: tuple[DeviceNode, ...] = ()
        if isinstance(device, MigDevice):
            lookup = self.mig_capabilities or ProcMigCapabilities(self.driver.proc_roots())
            minors = [lookup(gpu.minor, device.gi_id, ci_id) for ci_id in (None, device.ci_id)]
            caps = mig_capability_nodes(self.driver, minors)
        return ContainerEdits(env=env, device_nodes=nodes.device_nodes + caps, hooks=nodes.hooks)


def _describe(device: PublishedDevice) -> str:
    if isinstance(device, MigPartition):
        return f"a partition of {device.parent.uuid}"
    return device.uuid


def _facts(device: InventoryDevice) -> dict[str, object]:
    if isinstance(device, MigDevice):
        return {
            "name": device_name(device),
            "uuid": device.uuid,
            "parentUUID": device.parent.uuid,
            "parentMinor": device.parent.minor,
            "profile": device.profile,
            "productName": device.parent.product_name,
            "pciBusID": device.parent.pci_bus_id,
            "memoryBytes": device.memory_bytes,
            "gpuInstanceProfileId": device.gi_profile_id,
            "placement": {"start": device.placement_start, "size": device.placement_size},
            "gpuInstanceId": device.gi_id,
            "computeInstanceId": device.ci_id,
        }
    return {
        "name": gpu_device_name(device.minor),
        "uuid": device.uuid,
        "productName": device.product_name,
        "pciBusID": device.pci_bus_id,
        "memoryBytes": device.memory_bytes,
        "minor": device.minor,
    }
