"""Runs the kubelet plugin's real-mode code against the NVML mock library, in a process of its own.

pynvml keeps one loaded library per process, so each test runs this as a subprocess:
``python -m tests.e2e_tools.plugin_probe <driver root> <command> [args]``, with the library's
``GPU_DRA_NVML_MOCK_*`` variables in the environment. It prints one JSON document (last line).

Commands (``--sysfs DIR`` reads PCIe roots and NUMA nodes from a sysfs tree there instead of
``/sys``):

- ``publish [--dynamic-mig] [--sysfs DIR]``: the plugin's start-up in real mode (its flags
  parsed with ``--driver-root``, `node_nvml`, `discover`, `node_inventory`): the published devices,
  the counter sets, the static MIG devices found and the GPUs left out.
- ``mig-mode <0|1>``: sets the MIG mode of every GPU (as an administrator's ``nvidia-smi -mig``).
- ``lifecycle <scenario>``: `MigLifecycle` (the plugin's dynamic MIG) on GPUs found by that
  start-up discovery with ``--dynamic-mig``; scenarios in `SCENARIOS`.
- ``capped-shares <hook path> <GPU indexes> <MiB>``: the start-up with ``--capped-shares=<GPU
  indexes>`` and ``--nvidia-cdi-hook-path=<hook path>``, then `memory_caps.capped_shares` (the
  driver's memory-limit detection): per GPU its enforcement and why, the GPUs offered as capped
  shares, and the CDI edits of a share of ``<MiB>`` on the first.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_dra.driver.model import Gpu, MigDevice, MigPartition, NodeDevices
from gpu_dra.driver.nvml.interface import (
    NVML_DEVICE_MIG_DISABLE,
    ComputeInstanceHandle,
    DeviceHandle,
    GpuInstanceHandle,
    NvmlLibrary,
)
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.sysfs import SysfsPciTopology
from gpu_dra.kubelet_plugin.mig import MigError, MigLifecycle
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory, node_nvml
from gpu_dra.kubelet_plugin.startup.memory_caps import capped_shares


def main(argv: list[str]) -> int:
    root, command, *args = argv
    sysfs = None
    if "--sysfs" in args:
        at = args.index("--sysfs")
        sysfs = Path(args[at + 1])
        del args[at : at + 2]
    result: object
    if command == "publish":
        result = publish(Path(root), dynamic_mig="--dynamic-mig" in args, sysfs=sysfs)
    elif command == "mig-mode":
        result = set_mig_mode(RealNvml(Path(root)), int(args[0]))
    elif command == "lifecycle":
        result = SCENARIOS[args[0]](Path(root), *args[1:])
    elif command == "capped-shares":
        result = capped(Path(root), *args)
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result), flush=True)
    return 0


def start(
    root: Path, *, dynamic_mig: bool, sysfs: Path | None = None, flags: Sequence[str] = ()
) -> tuple[NvmlLibrary, NodeDevices, NodeInventory]:
    """What the plugin does at start in real mode with ``--driver-root=<root>`` (and `flags`)."""
    settings = _settings(root, dynamic_mig=dynamic_mig, flags=flags)
    nvml, pci = node_nvml(settings)
    assert isinstance(nvml, RealNvml), "real mode"
    if sysfs is not None:
        pci = SysfsPciTopology(sysfs)
    devices = discover(settings, nvml, pci)
    return nvml, devices, node_inventory(settings, devices)


def _settings(root: Path, *, dynamic_mig: bool, flags: Sequence[str]) -> KubeletPluginSettings:
    base = [f"--driver-root={root}", "--node-name=node-a", "--data-dir=/nonexistent", *flags]
    return KubeletPluginSettings.parse([*base, *(["--dynamic-mig"] if dynamic_mig else [])], {})


def capped(root: Path, hook: str, gpus: str, mib: str) -> dict[str, Any]:
    flags = [f"--capped-shares={gpus}", f"--nvidia-cdi-hook-path={hook}"]
    nvml, _, inventory = start(root, dynamic_mig=False, flags=flags)
    asked = [gpu.uuid for gpu in inventory.capped_shares]
    offered, memory = capped_shares(
        _settings(root, dynamic_mig=False, flags=flags), nvml, inventory, None
    )
    support = memory.support
    first = offered.capped_shares[0].uuid if offered.capped_shares else None
    edits = None if first is None else support.edits(first, int(mib))
    return {
        "enforcement": {u: [support.enforcement(u).value, support.why(u)] for u in asked},
        "offered": [gpu.uuid for gpu in offered.capped_shares],
        "edits": None
        if edits is None
        else {
            "env": dict(edits.env),
            "hooks": [
                {"hookName": h.hook_name, "path": h.path, "args": list(h.args), "env": list(h.env)}
                for h in edits.hooks
            ],
        },
    }


def publish(root: Path, *, dynamic_mig: bool, sysfs: Path | None) -> dict[str, Any]:
    _, devices, inventory = start(root, dynamic_mig=dynamic_mig, sysfs=sysfs)
    return publication(devices, inventory)


def publication(devices: NodeDevices, inventory: NodeInventory) -> dict[str, Any]:
    """What a start-up found and publishes, as JSON values (`tests.e2e_tools.published_diff`
    compares two of them)."""
    return {
        "gpus": [{"uuid": gpu.uuid, "pciBusId": gpu.pci_bus_id} for gpu in devices.gpus],
        "devices": inventory.published_devices(),
        "counterSets": inventory.counter_sets(),
        "migDevices": [mig_json(mig) for mig in devices.mig_devices],
        "problems": [problem.message for problem in devices.problems],
    }


def set_mig_mode(nvml: RealNvml, mode: int) -> list[int]:
    nvml.init()
    try:
        handles = [nvml.device_get_handle_by_index(i) for i in range(nvml.device_get_count())]
        return [nvml.device_set_mig_mode(handle, mode) for handle in handles]
    finally:
        nvml.shutdown()


def mig_json(mig: MigDevice) -> dict[str, Any]:
    return {
        "parent": mig.parent.uuid,
        "uuid": mig.uuid,
        "profile": mig.profile,
        "giProfileId": mig.gi_profile_id,
        "placement": [mig.placement_start, mig.placement_size],
        "giId": mig.gi_id,
        "ciId": mig.ci_id,
    }


def partition(inventory: NodeInventory, gpu: int, profile: str, start: int) -> MigPartition:
    """The published partition of `profile` at `start` on GPU index `gpu`, as a claim gets it."""
    for candidate in inventory.published_devices():
        found = inventory.by_name(candidate["name"])
        if (
            isinstance(found, MigPartition)
            and found.parent.index == gpu
            and found.profile_name == profile
            and found.placement_start == start
        ):
            return found
    raise SystemExit(f"GPU {gpu} publishes no partition {profile} at {start}")


def failure(call: Callable[[], object]) -> dict[str, Any]:
    """The `MigError` `call` raises, as message and retryable flag."""
    try:
        call()
    except MigError as error:
        return {"message": str(error), "retryable": error.retryable}
    raise SystemExit("expected a MigError")


def mig_mode(nvml: NvmlLibrary, gpu: Gpu) -> int:
    nvml.init()
    try:
        return nvml.device_get_mig_mode(nvml.device_get_handle_by_uuid(gpu.uuid))[0]
    finally:
        nvml.shutdown()


def create(root: Path, gpu: str, profile: str, start: str, edits: str = "") -> dict[str, Any]:
    """A MIG device made at a published partition's placement, with ``--edits`` the device
    nodes its CDI spec gets (as a prepare writes them; the root needs the driver's procfs),
    then the GPU's instances and MIG mode."""
    nvml, _, inventory = start_dynamic(root)
    wanted = partition(inventory, int(gpu), profile, int(start))
    lifecycle = MigLifecycle(nvml)
    made = lifecycle.create(wanted.parent, wanted.gi_profile_id, wanted.placement_start)
    nodes = []
    if edits == "--edits":
        made_edits = inventory.container_edits(made, Path("/nonexistent"))  # real: no files
        nodes = [
            {"path": n.path, "type": n.type, "major": n.major, "minor": n.minor}
            for n in made_edits.device_nodes
        ]
    return {
        "partition": {"name": wanted_name(inventory, wanted), "giProfileId": wanted.gi_profile_id},
        "made": mig_json(made),
        "deviceNodes": nodes,
        "instances": instances(lifecycle, wanted.parent),
        "migMode": mig_mode(nvml, wanted.parent),
    }


def start_dynamic(root: Path) -> tuple[NvmlLibrary, NodeDevices, NodeInventory]:
    return start(root, dynamic_mig=True)


def wanted_name(inventory: NodeInventory, wanted: MigPartition) -> str:
    for device in inventory.published_devices():
        if inventory.by_name(device["name"]) == wanted:
            return str(device["name"])
    raise SystemExit("partition not published")


def instances(lifecycle: MigLifecycle, gpu: Gpu) -> list[dict[str, Any]]:
    return [
        {
            "giId": i.gi_id,
            "giProfileId": i.gi_profile_id,
            "placement": [i.placement_start, i.placement_size],
            "ciIds": list(i.ci_ids),
        }
        for i in lifecycle.instances(gpu)
    ]


def occupied(root: Path, gpu: str, profile: str, start: str) -> dict[str, Any]:
    """Creating at a placement another GPU instance overlaps: the error, then the instances."""
    nvml, _, inventory = start_dynamic(root)
    wanted = partition(inventory, int(gpu), profile, int(start))
    lifecycle = MigLifecycle(nvml)
    error = failure(
        lambda: lifecycle.create(wanted.parent, wanted.gi_profile_id, wanted.placement_start)
    )
    return {"error": error, "instances": instances(lifecycle, wanted.parent)}


def destroy(root: Path, gpu: str, profile: str, start: str) -> dict[str, Any]:
    """Destroys the GPU instance at a published partition's placement (twice: the second finds
    none); then the GPU's instances and MIG mode."""
    nvml, _, inventory = start_dynamic(root)
    wanted = partition(inventory, int(gpu), profile, int(start))
    lifecycle = MigLifecycle(nvml)
    first = lifecycle.destroy(wanted.parent, wanted.gi_profile_id, wanted.placement_start)
    second = lifecycle.destroy(wanted.parent, wanted.gi_profile_id, wanted.placement_start)
    return {
        "destroyed": [first, second],
        "instances": instances(lifecycle, wanted.parent),
        "migMode": mig_mode(nvml, wanted.parent),
    }


class _Racing:
    """`RealNvml` with another client's change made (through the same library) just before one
    call: what a process outside gpu-dra can do between the lifecycle's listing and its change."""

    def __init__(self, nvml: RealNvml, before: str, change: Callable[[RealNvml, Any], None]):
        self._nvml = nvml
        self._before = before
        self._change = change
        self.raced = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._nvml, name)
        if name != self._before or self.raced:
            return real

        def racing(*args: Any) -> Any:
            if name != "device_set_mig_mode" or args[1] == NVML_DEVICE_MIG_DISABLE:
                self.raced = True
                self._change(self._nvml, args[0])
            return real(*args)

        return racing


def _full_ci(nvml: RealNvml, gi: GpuInstanceHandle) -> ComputeInstanceHandle:
    """A compute instance spanning `gi` (profile index 0 = 1 slice on a 1-slice GI)."""
    info = nvml.gpu_instance_get_compute_instance_profile_info(gi, 0, 0)
    return nvml.gpu_instance_create_compute_instance(gi, info.id)


def in_use(root: Path, gpu: str, profile: str, start: str, race: str) -> dict[str, Any]:
    """Destroying the MIG device at a published partition while another client makes a compute
    instance in its GPU instance (``race=compute-instance``: IN_USE from
    ``nvmlGpuInstanceDestroy``) or a GPU instance elsewhere on the GPU (``race=gpu-instance``:
    IN_USE from turning MIG mode off); then the GPU's instances and MIG mode."""
    real, _, inventory = start_dynamic(root)
    assert isinstance(real, RealNvml)
    wanted = partition(inventory, int(gpu), profile, int(start))

    def add_compute_instance(nvml: RealNvml, gi: GpuInstanceHandle) -> None:
        _full_ci(nvml, gi)

    def add_gpu_instance(nvml: RealNvml, handle: DeviceHandle) -> None:
        placement = nvml.device_get_gpu_instance_possible_placements(handle, wanted.gi_profile_id)
        free = next(p for p in placement if p.start != wanted.placement_start)
        _full_ci(
            nvml,
            nvml.device_create_gpu_instance_with_placement(handle, wanted.gi_profile_id, free),
        )

    racing = (
        _Racing(real, "gpu_instance_destroy", add_compute_instance)
        if race == "compute-instance"
        else _Racing(real, "device_set_mig_mode", add_gpu_instance)
    )
    lifecycle = MigLifecycle(racing)
    error = failure(
        lambda: lifecycle.destroy(wanted.parent, wanted.gi_profile_id, wanted.placement_start)
    )
    assert racing.raced
    return {
        "error": error,
        "instances": instances(MigLifecycle(real), wanted.parent),
        "migMode": mig_mode(real, wanted.parent),
    }


def ampere_mig_off(root: Path, gpu: str) -> dict[str, Any]:
    """Dynamic MIG on an Ampere GPU with MIG mode off: not partitionable, and the lifecycle
    refuses to switch its MIG mode (a reset would be needed)."""
    nvml, devices, inventory = start_dynamic(root)
    parent = next(g for g in devices.gpus if g.index == int(gpu))
    profile = next(iter(devices.mig_profiles[0].profiles))
    error = failure(
        lambda: MigLifecycle(nvml).create(
            parent, profile.gi_profile_id, profile.placement_starts[0]
        )
    )
    return {
        "partitionable": [g.index for g in inventory.partitionable_gpus()],
        "error": error,
        "migMode": mig_mode(nvml, parent),
    }


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "create": create,
    "occupied": occupied,
    "destroy": destroy,
    "in-use": in_use,
    "ampere-mig-off": ampere_mig_off,
}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
