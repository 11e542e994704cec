"""Simulated machine profiles: which GPUs a simulated node has and what NVML reports for them.

A profile is a built-in name (`builtin_profile_names`, ``machine_profiles.json``) or the path of a
JSON/YAML file of the same shape (`load_profile`); models come from ``gpu_models.json`` or the
file. GPUs are enumerated in PCI bus order. File format: docs/config.md#simulated-machine-profiles.
"""

from __future__ import annotations

import inspect
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Final, TypeVar

import yaml

from gpu_dra.driver.model import Gpu
from gpu_dra.driver.nvml.interface import (
    NVML_DEVICE_MIG_ENABLE,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_by_name,
    return_code_name,
)
from gpu_dra.driver.nvml.simulated_mig import GpuInstanceProfile, MigGeometry, MigState

_T = TypeVar("_T")
_D = TypeVar("_D")

_UUID_NAMESPACE: Final = uuid.UUID("6f1d4c1e-5a8b-4c53-9a3e-2b7d0c9e4f10")
_NVML_BUS_ID = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4,}:[0-9a-f]{2}$")
_ADDRESSING_MODES: Final = {"None": 0, "HMM": 1, "ATS": 2}
_GPU_FIELDS: Final = frozenset(
    {"model", "busId", "minor", "numaNode", "pcieRoot", "uuid", "migMode", "migDevices"}
    | {"gpuNumaNodeId", "addressingMode", "faults"}
)
_STATIC_MIG_FIELDS: Final = frozenset({"profileId", "start", "computeInstance"})
_MIG_FIELDS: Final = frozenset({"memorySlices", "maxDevices", "gpuInstanceProfiles"})
_GI_PROFILE_FIELDS: Final = {
    "index": "index",
    "id": "id",
    "name": "name",
    "sliceCount": "slice_count",
    "instanceCount": "instance_count",
    "memoryMiB": "memory_mib",
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy_engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegs": "jpegs",
    "ofas": "ofas",
}
_PROFILE_FIELDS: Final = frozenset(
    {"name", "description", "driverVersion", "cudaDriverVersion", "models", "faults", "gpus"}
)
# Calls taking a device, GPU-instance or compute-instance handle get per-GPU faults; the others
# (init, counts, lookups) per profile.
_CALLS: Final = frozenset(name for name in dir(NvmlLibrary) if not name.startswith("_"))
DEVICE_FAULT_CALLS: Final = frozenset(
    name
    for name in _CALLS
    if {"handle", "gpu_instance", "compute_instance"}
    & set(inspect.signature(getattr(NvmlLibrary, name)).parameters)
)
"""`NvmlLibrary` methods whose faults are set per GPU (they take a device, GPU-instance or
compute-instance handle)."""
SYSTEM_FAULT_CALLS: Final = _CALLS - DEVICE_FAULT_CALLS
"""`NvmlLibrary` methods whose faults are set per node (init, counts, lookups)."""


class ProfileError(ValueError):
    """A simulated machine profile is unknown or malformed; the message says what to fix."""


@dataclass(frozen=True)
class GpuModel:
    """What NVML reports for one GPU model."""

    key: str
    name: str
    architecture: int
    brand: int
    cuda_compute_capability: tuple[int, int]
    memory_total_mib: int | None  # None: nvmlDeviceGetMemoryInfo is NotSupported
    pci_device_id: int
    pci_subsystem_id: int
    mig_capable: bool
    mig: MigGeometry | None = None
    """MIG profiles; None for models without MIG or without known profiles."""

    def gpu(
        self,
        index: int = 0,
        *,
        minor: int | None = None,
        uuid: str = "GPU-00000000-0000-0000-0000-000000000000",
        driver_version: str = "580.95.05",
        cuda_driver_version: int = 13000,
        pci_bus_id: str = "0000:1b:00.0",
    ) -> Gpu:
        """A GPU of this model as discovery describes it (MIG off), at NVML index `index`; the
        rest of `Gpu` (PCIe root, NUMA node, addressing mode) is left unset."""
        return Gpu(
            index=index,
            minor=index if minor is None else minor,
            uuid=uuid,
            product_name=self.name,
            brand=self.brand,
            architecture=self.architecture,
            cuda_compute_capability=self.cuda_compute_capability,
            driver_version=driver_version,
            cuda_driver_version=cuda_driver_version,
            pci_bus_id=pci_bus_id,
            pci_device_id=self.pci_device_id,
            memory_bytes=None if self.memory_total_mib is None else self.memory_total_mib * 2**20,
            mig_capable=self.mig_capable,
        )


@dataclass(frozen=True)
class StaticMigDevice:
    """A GPU instance (and, unless `compute_instance` is False, its full CI) present at start."""

    profile_id: int
    start: int
    compute_instance: bool = True


@dataclass(frozen=True)
class SimulatedGpu:
    """One GPU of a simulated machine, at NVML index `index`."""

    index: int
    model: GpuModel
    uuid: str
    minor: int
    bus_id: str  # NVML form, 00000000:1B:00.0
    numa_node: int | None
    pcie_root: str | None
    mig_mode: tuple[int, int]
    gpu_numa_node_id: int | None
    addressing_mode: int | None
    faults: tuple[tuple[str, int], ...] = ()
    mig_devices: tuple[StaticMigDevice, ...] = ()

    def fault(self, call: str) -> int | None:
        """The NVML return code injected for `call`, if any."""
        return dict(self.faults).get(call)


@dataclass(frozen=True)
class MachineProfile:
    """A simulated node: system facts and its GPUs in NVML index order."""

    name: str
    description: str
    node_name: str
    driver_version: str
    cuda_driver_version: int
    gpus: tuple[SimulatedGpu, ...]
    faults: tuple[tuple[str, int], ...] = ()

    def fault(self, call: str) -> int | None:
        """The NVML return code injected for the system-level `call`, if any."""
        return dict(self.faults).get(call)


def builtin_models() -> dict[str, GpuModel]:
    """The models of ``gpu_models.json`` by key (e.g. ``H100-SXM5-80GB``)."""
    return dict(_builtin_models())


def builtin_profile_names() -> list[str]:
    """Names accepted by `load_profile` besides file paths."""
    return sorted(_builtin_profiles())


def load_profile(spec: str, node_name: str) -> MachineProfile:
    """The profile named `spec` (built-in) or stored at path `spec` (.json, .yaml, .yml).

    UUIDs not given by the profile are derived from (profile name, `node_name`, index): stable
    across restarts and different on every node.
    """
    if not node_name:
        raise ProfileError("a node name is required to derive the simulated GPU UUIDs")
    builtins = _builtin_profiles()
    if spec in builtins:
        return parse_profile(builtins[spec], name=spec, node_name=node_name)
    path = Path(spec)
    if path.suffix not in (".json", ".yaml", ".yml") and "/" not in spec:
        raise ProfileError(
            f"unknown simulated machine profile {spec!r}: use one of "
            f"{', '.join(builtin_profile_names())} or the path of a .json/.yaml profile file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ProfileError(f"cannot read simulated machine profile {spec!r}: {error}") from error
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ProfileError(f"simulated machine profile {spec!r} is not valid: {error}") from error
    if not isinstance(data, dict):
        raise ProfileError(f"simulated machine profile {spec!r} must be a mapping")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{spec}: name must be a non-empty string")
    return parse_profile(data, name=name, node_name=node_name)


def parse_profile(data: dict[str, object], *, name: str, node_name: str) -> MachineProfile:
    """Validate a decoded profile document (see the module docstring for its shape)."""
    where = f"profile {name!r}"
    unknown = sorted(key for key in set(data) - _PROFILE_FIELDS if not key.startswith("_"))
    if unknown:
        raise ProfileError(f"{where}: unknown fields {unknown}; known: {sorted(_PROFILE_FIELDS)}")
    models = dict(_builtin_models())
    extra = _optional(data, "models", dict, where, {})
    for key, raw in extra.items():
        models[str(key)] = _parse_model(str(key), raw, f"{where}: models.{key}")
    raw_gpus = _field(data, "gpus", list, where)
    parsed = [_parse_gpu(raw, models, f"{where}: gpus[{i}]") for i, raw in enumerate(raw_gpus)]
    parsed.sort(key=_bus_sort_key)
    gpus = tuple(_place(gpu, index, name, node_name) for index, gpu in enumerate(parsed))
    _check_unique(gpus, where)
    version = _field(data, "driverVersion", str, where)
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", version):
        raise ProfileError(f"{where}: driverVersion {version!r} is not like 580.95.05")
    return MachineProfile(
        name=name,
        description=_optional(data, "description", str, where, ""),
        node_name=node_name,
        driver_version=version,
        cuda_driver_version=_field(data, "cudaDriverVersion", int, where),
        gpus=gpus,
        faults=_parse_faults(data.get("faults", {}), SYSTEM_FAULT_CALLS, where),
    )


def nvml_bus_id(bus_id: str) -> str:
    """Canonical NVML form ``%08X:%02X:%02X.%X`` of a PCI bus id given in either form."""
    match = _NVML_BUS_ID.match(bus_id)
    if match is None:
        raise ProfileError(f"PCI bus id {bus_id!r} is not like 00000000:1B:00.0")
    domain, bus, device, function = (int(part, 16) for part in match.groups())
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def _bus_sort_key(gpu: SimulatedGpu) -> tuple[int, ...]:
    return tuple(int(part, 16) for part in re.split(r"[:.]", gpu.bus_id))


def _place(gpu: SimulatedGpu, index: int, profile: str, node: str) -> SimulatedGpu:
    """Give a parsed GPU its NVML index and the defaults that depend on it."""
    derived = f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{profile}/{node}/{index}')}"
    return replace(
        gpu,
        index=index,
        uuid=gpu.uuid or derived,
        minor=index if gpu.minor < 0 else gpu.minor,
    )


def _parse_gpu(raw: object, models: dict[str, GpuModel], where: str) -> SimulatedGpu:
    """A GPU entry; index is 0, and minor -1 / uuid "" when left to `_place`."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: must be a mapping")
    unknown = sorted(set(raw) - _GPU_FIELDS)
    if unknown:
        raise ProfileError(f"{where}: unknown fields {unknown}; known: {sorted(_GPU_FIELDS)}")
    key = _field(raw, "model", str, where)
    if key not in models:
        raise ProfileError(f"{where}: unknown model {key!r}; known models: {sorted(models)}")
    model = models[key]
    numa = _optional(raw, "numaNode", int, where, -1)
    root = _optional(raw, "pcieRoot", str, where, None)
    if root is not None and not _PCIE_ROOT.match(root):
        raise ProfileError(f"{where}: pcieRoot {root!r} is not like pci0000:64")
    gpu_uuid = _optional(raw, "uuid", str, where, "")
    if gpu_uuid and not _GPU_UUID.match(gpu_uuid):
        raise ProfileError(f"{where}: uuid {gpu_uuid!r} is not like GPU-<lower-case UUID>")
    mode = _optional(raw, "addressingMode", str, where, None)
    if mode is not None and mode not in _ADDRESSING_MODES:
        raise ProfileError(f"{where}: addressingMode must be one of {list(_ADDRESSING_MODES)}")
    mig_mode = (0, 0)
    if "migMode" in raw:
        mig_mode = _parse_mig_mode(raw["migMode"], model, where)
    mig_devices = _parse_static_mig(raw.get("migDevices", []), model, where)
    if mig_devices:
        if "migMode" not in raw:
            mig_mode = (NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE)
        elif mig_mode[0] != NVML_DEVICE_MIG_ENABLE:
            raise ProfileError(f"{where}: migDevices need MIG on: migMode must be [1, 0|1]")
    return SimulatedGpu(
        index=0,
        model=model,
        uuid=gpu_uuid,
        minor=_non_negative(_optional(raw, "minor", int, where, -1), "minor", where, allow=-1),
        bus_id=_reword(nvml_bus_id, _field(raw, "busId", str, where), where),
        numa_node=numa if numa >= 0 else None,
        pcie_root=root,
        mig_mode=mig_mode,
        gpu_numa_node_id=_optional(raw, "gpuNumaNodeId", int, where, None),
        addressing_mode=None if mode is None else _ADDRESSING_MODES[mode],
        faults=_parse_faults(raw.get("faults", {}), DEVICE_FAULT_CALLS, where),
        mig_devices=mig_devices,
    )


def _parse_static_mig(raw: object, model: GpuModel, where: str) -> tuple[StaticMigDevice, ...]:
    """Static MIG devices, checked by creating them on a scratch copy of the GPU's MIG state."""
    if not isinstance(raw, list):
        raise ProfileError(f"{where}: migDevices must be a list")
    if raw and model.mig is None:
        raise ProfileError(f"{where}: migDevices given but {model.key} has no MIG profiles")
    state = MigState(model.mig, (NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_ENABLE), "")
    devices = []
    for i, entry in enumerate(raw):
        at = f"{where}: migDevices[{i}]"
        if not isinstance(entry, dict):
            raise ProfileError(f"{at}: must be a mapping like {{profileId: 9, start: 4}}")
        unknown = sorted(set(entry) - _STATIC_MIG_FIELDS)
        if unknown:
            raise ProfileError(
                f"{at}: unknown fields {unknown}; known: {sorted(_STATIC_MIG_FIELDS)}"
            )
        device = StaticMigDevice(
            profile_id=_field(entry, "profileId", int, at),
            start=_field(entry, "start", int, at),
            compute_instance=_optional(entry, "computeInstance", bool, at, True),
        )
        profile = model.mig.by_id(device.profile_id) if model.mig is not None else None
        if profile is None:
            known = sorted(f"{p.id} ({p.name})" for p in model.mig.profiles) if model.mig else []
            raise ProfileError(
                f"{at}: {model.key} has no GPU-instance profile ID {device.profile_id}; "
                f"known: {', '.join(known)}"
            )
        try:
            state.create_gpu_instance(device.profile_id, (device.start, profile.placement_size))
        except NVMLError as error:
            code = return_code(error)
            raise ProfileError(
                f"{at}: {profile.name} (ID {profile.id}) cannot start at memory slice "
                f"{device.start} ({return_code_name(code if code is not None else -1)}); "
                f"possible starts {list(profile.placement_starts)}, and GPU instances must "
                "not overlap"
            ) from None
        devices.append(device)
    return tuple(devices)


def _parse_mig_geometry(raw: object, where: str) -> MigGeometry:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: must be a mapping")
    unknown = sorted(set(raw) - _MIG_FIELDS)
    if unknown:
        raise ProfileError(f"{where}: unknown fields {unknown}; known: {sorted(_MIG_FIELDS)}")
    slices = _field(raw, "memorySlices", int, where)
    rows = _field(raw, "gpuInstanceProfiles", list, where)
    profiles = tuple(
        _parse_gi_profile(row, slices, f"{where}.gpuInstanceProfiles[{i}]")
        for i, row in enumerate(rows)
    )
    for label, values in (("index", [p.index for p in profiles]), ("id", [p.id for p in profiles])):
        if len(set(values)) != len(values):
            raise ProfileError(f"{where}: GPU-instance profile {label}es must be unique")
    return MigGeometry(slices, _field(raw, "maxDevices", int, where), profiles)


def _parse_gi_profile(raw: object, memory_slices: int, where: str) -> GpuInstanceProfile:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: must be a mapping")
    known = set(_GI_PROFILE_FIELDS) | {"placements"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown fields {unknown}; known: {sorted(known)}")
    values: dict[str, object] = {
        attr: _field(raw, key, str if key == "name" else int, where)
        for key, attr in _GI_PROFILE_FIELDS.items()
    }
    placements = _field(raw, "placements", dict, where)
    starts = _field(placements, "starts", list, where)
    size = _field(placements, "size", int, where)
    if not starts or not all(
        isinstance(s, int) and s >= 0 and s + size <= memory_slices for s in starts
    ):
        raise ProfileError(f"{where}: placements must lie within the {memory_slices} slices")
    return GpuInstanceProfile(
        **values,  # type: ignore[arg-type]
        placement_starts=tuple(starts),
        placement_size=size,
    )


def _parse_mig_mode(raw: object, model: GpuModel, where: str) -> tuple[int, int]:
    if not model.mig_capable:
        raise ProfileError(f"{where}: migMode given but {model.key} has no MIG support")
    if (
        not isinstance(raw, list)
        or len(raw) != 2
        or not all(isinstance(v, int) and v in (0, 1) for v in raw)
    ):
        raise ProfileError(f"{where}: migMode must be [current, pending], each 0 or 1")
    return (raw[0], raw[1])


def _parse_faults(raw: object, calls: frozenset[str], where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: faults must map call names to NVML errors")
    faults = []
    for call, error in raw.items():
        if call not in calls:
            raise ProfileError(f"{where}: faults: unknown call {call!r}; known: {sorted(calls)}")
        if isinstance(error, bool) or not isinstance(error, int | str):
            raise ProfileError(f"{where}: faults.{call} must be an NVML error name or code")
        try:
            code = error if isinstance(error, int) else return_code_by_name(error)
        except KeyError:
            raise ProfileError(
                f"{where}: faults.{call}: unknown NVML error {error!r} (e.g. NOT_SUPPORTED)"
            ) from None
        faults.append((str(call), code))
    return tuple(faults)


def _parse_model(key: str, raw: object, where: str) -> GpuModel:
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: must be a mapping")
    cc = _field(raw, "cudaComputeCapability", list, where)
    if len(cc) != 2 or not all(isinstance(v, int) for v in cc):
        raise ProfileError(f"{where}: cudaComputeCapability must be [major, minor]")
    memory = _optional(raw, "memoryTotalMiB", int, where, None)
    mig_capable = _field(raw, "migCapable", bool, where)
    mig = None
    if raw.get("mig") is not None:
        if not mig_capable:
            raise ProfileError(f"{where}: mig profiles given but migCapable is false")
        mig = _parse_mig_geometry(raw["mig"], f"{where}: mig")
    return GpuModel(
        key=key,
        name=_field(raw, "name", str, where),
        architecture=_field(raw, "architecture", int, where),
        brand=_field(raw, "brand", int, where),
        cuda_compute_capability=(cc[0], cc[1]),
        memory_total_mib=memory,
        pci_device_id=_reword(_hex32, _field(raw, "pciDeviceId", str, where), where),
        pci_subsystem_id=_reword(_hex32, _field(raw, "pciSubSystemId", str, where), where),
        mig_capable=mig_capable,
        mig=mig,
    )


def _check_unique(gpus: tuple[SimulatedGpu, ...], where: str) -> None:
    for label, values in (
        ("busId", [gpu.bus_id for gpu in gpus]),
        ("uuid", [gpu.uuid for gpu in gpus]),
        ("minor", [str(gpu.minor) for gpu in gpus]),
    ):
        duplicates = sorted({value for value in values if values.count(value) > 1})
        if duplicates:
            raise ProfileError(f"{where}: duplicate {label}: {', '.join(duplicates)}")


def _field(raw: dict[str, object], key: str, kind: type[_T], where: str) -> _T:
    """The required field `key`, checked to be a `kind` (bool never passes for int)."""
    if key not in raw:
        raise ProfileError(f"{where}: missing field {key!r}")
    return _checked(raw[key], key, kind, where)


def _optional(raw: dict[str, object], key: str, kind: type[_T], where: str, default: _D) -> _T | _D:
    """The optional field `key`; `default` when absent or null."""
    value = raw.get(key)
    return default if value is None else _checked(value, key, kind, where)


def _checked(value: object, key: str, kind: type[_T], where: str) -> _T:
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    names = {dict: "a mapping", list: "a list", str: "a string", int: "an integer"}
    raise ProfileError(f"{where}: {key} must be {names.get(kind, kind.__name__)}, not {value!r}")


def _reword(parse: Callable[[str], _T], value: str, where: str) -> _T:
    try:
        return parse(value)
    except ValueError as error:
        raise ProfileError(f"{where}: {error}") from error


def _hex32(value: str) -> int:
    if not re.fullmatch(r"0x[0-9a-fA-F]{8}", value):
        raise ValueError(f"{value!r} is not a 32-bit hex id like 0x233010DE")
    return int(value, 16)


def _non_negative(value: int, key: str, where: str, allow: int = 0) -> int:
    if value < 0 and value != allow:
        raise ProfileError(f"{where}: {key} must not be negative")
    return value


def _builtin_profiles() -> dict[str, dict[str, object]]:
    data = _package_json("machine_profiles.json")
    return {key: value for key, value in data.items() if not key.startswith("_")}


def _builtin_models() -> dict[str, GpuModel]:
    data = _package_json("gpu_models.json")
    return {
        key: _parse_model(key, raw, f"gpu_models.json: {key}")
        for key, raw in data.items()
        if not key.startswith("_")
    }


def _package_json(file_name: str) -> dict[str, dict[str, object]]:
    text = resources.files(__package__).joinpath(file_name).read_text(encoding="utf-8")
    data: dict[str, dict[str, object]] = json.loads(text)
    return data
