"""Discovery: NVML and PCI topology in, `Gpu` and `MigDevice` values out.

Pure apart from the calls on the injected `NvmlLibrary` and `PciTopology`. An NVML error is never
taken for an empty answer: a node-wide failure raises `DiscoveryError`; a failure on one GPU
leaves that GPU out as a `GpuProblem` in `NodeDevices.problems` (`discover_gpus` raises the first
as `DiscoveryError`). Static MIG devices are walked as NVIDIA's driver walks them; with
``mig_profiles=True`` the GPU-instance profiles and placements of MIG-capable GPUs are read too.
See docs/real-nodes.md#nvml-errors (which return codes mean "absent"), docs/mig.md#static-mig
and docs/mig.md#dynamic-mig-publication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any, Final, TypeVar

from gpu_dra.driver.model import (
    Gpu,
    GpuProblem,
    MigCapableGpu,
    MigDevice,
    MigProfile,
    MigResources,
    NodeDevices,
)
from gpu_dra.driver.naming import InvalidNameError, mig_profile_name
from gpu_dra.driver.nvml.interface import (
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT,
    NVML_DEVICE_MIG_ENABLE,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_GPU_INSTANCE_PROFILE_COUNT,
    NVML_INIT_FLAG_NO_GPUS,
    DeviceHandle,
    GpuInstanceHandle,
    GpuInstanceProfileInfo,
    NVMLError,
    NvmlLibrary,
    PciTopology,
    return_code,
    return_code_name,
    short_pci_bus_id,
)

_T = TypeVar("_T")

# "This GPU or this libnvidia-ml cannot answer": the fact is omitted, as NVIDIA's driver does.
_ABSENT = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND})
# A profile index this GPU (or GPU instance) does not have, when scanning profiles as go-nvlib does.
_NO_SUCH_PROFILE = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT})
_GI_PROFILE_INFO: Final = "nvmlDeviceGetGpuInstanceProfileInfo"
_MIB = 1024 * 1024

UNUSABLE_ANSWER: Final = "UNUSABLE_ANSWER"
"""`GpuProblem.reason` when every NVML call succeeded but the answers cannot be used."""


class DiscoveryError(RuntimeError):
    """NVML could not describe the node's GPUs; the message names the GPU and the failed call.

    `gpu_index` is None for node-wide failures; `call` and `return_code` name the NVML function
    and its return code when one failed (`return_code` None: answers that cannot be used).
    """

    def __init__(
        self,
        message: str,
        *,
        gpu_index: int | None = None,
        call: str | None = None,
        return_code: int | None = None,
        pci_bus_id: str | None = None,
        uuid: str | None = None,
    ) -> None:
        super().__init__(message)
        self.gpu_index = gpu_index
        self.call = call
        self.return_code = return_code
        self.pci_bus_id = pci_bus_id
        self.uuid = uuid


def discover_gpus(nvml: NvmlLibrary, pci: PciTopology) -> list[Gpu]:
    """All GPUs NVML sees, in NVML index (PCI bus) order; MIG devices are not walked.

    Initialises NVML with ``NVML_INIT_FLAG_NO_GPUS`` (a node without GPUs yields ``[]``) and shuts
    it down again; NVML counts initialisations, so callers may hold their own. Strict: a GPU that
    cannot be read raises `DiscoveryError` (`discover_devices` reports it and goes on).
    """
    found = _discover(nvml, pci, with_mig=False, with_profiles=False)
    if found.problems:
        first, *others = found.problems
        more = f" (and {len(others)} more GPU(s) that cannot be read)" if others else ""
        raise DiscoveryError(f"{first.message}{more}", gpu_index=first.index, call=first.call)
    return list(found.gpus)


def discover_devices(
    nvml: NvmlLibrary, pci: PciTopology, *, mig_profiles: bool = False
) -> NodeDevices:
    """All GPUs (as `discover_gpus`) and the existing MIG devices of those in MIG mode.

    With `mig_profiles` (dynamic MIG), also the GPU-instance profiles and placements of every
    MIG-capable GPU. A GPU NVML cannot describe is left out of every field and listed in
    `NodeDevices.problems`; node-wide failures raise `DiscoveryError`.
    """
    return _discover(nvml, pci, with_mig=True, with_profiles=mig_profiles)


def _discover(
    nvml: NvmlLibrary, pci: PciTopology, *, with_mig: bool, with_profiles: bool
) -> NodeDevices:
    try:
        nvml.init_with_flags(NVML_INIT_FLAG_NO_GPUS)
    except NVMLError as error:
        raise DiscoveryError(
            f"cannot initialise NVML: {_describe(error)}; check that the NVIDIA driver is loaded "
            "and that the driver root setting points at its installation",
            call="nvmlInitWithFlags",
            return_code=return_code(error),
        ) from error
    try:
        devices = _read_devices(nvml, pci, with_mig=with_mig, with_profiles=with_profiles)
    except BaseException:
        with contextlib.suppress(NVMLError):  # the error being raised says what went wrong
            nvml.shutdown()
        raise
    try:
        nvml.shutdown()
    except NVMLError as error:
        raise DiscoveryError(
            f"cannot shut NVML down: {_describe(error)}",
            call="nvmlShutdown",
            return_code=return_code(error),
        ) from error
    return devices


def _read_devices(
    nvml: NvmlLibrary, pci: PciTopology, *, with_mig: bool, with_profiles: bool
) -> NodeDevices:
    driver_version = _system(nvml.system_get_driver_version, "nvmlSystemGetDriverVersion")
    cuda_version = _system(nvml.system_get_cuda_driver_version, "nvmlSystemGetCudaDriverVersion")
    count = _system(nvml.device_get_count, "nvmlDeviceGetCount")
    gpus = []
    mig_devices: list[MigDevice] = []
    mig_capable: list[MigCapableGpu] = []
    problems: list[GpuProblem] = []
    for index in range(count):
        try:
            handle, gpu = _read_gpu(nvml, pci, index, driver_version, cuda_version)
            walk = _MigWalk(nvml, handle, gpu)  # one per GPU: its profile scan is cached
            devices = walk.devices() if with_mig and gpu.mig_enabled else []
            profiles = walk.offered_profiles() if with_profiles and gpu.mig_capable else ()
        except DiscoveryError as error:
            if error.gpu_index != index:
                raise
            problems.append(_problem(index, error))
            continue
        gpus.append(gpu)
        mig_devices.extend(devices)
        if profiles:
            mig_capable.append(MigCapableGpu(gpu, profiles))
    return NodeDevices(tuple(gpus), tuple(mig_devices), tuple(mig_capable), tuple(problems))


def _problem(index: int, error: DiscoveryError) -> GpuProblem:
    code = error.return_code
    return GpuProblem(
        index=index,
        pci_bus_id=error.pci_bus_id,
        uuid=error.uuid,
        call=error.call,
        reason=UNUSABLE_ANSWER if code is None else return_code_name(code),
        message=str(error),
    )


def _read_gpu(
    nvml: NvmlLibrary, pci: PciTopology, index: int, driver_version: str, cuda_version: int
) -> tuple[DeviceHandle, Gpu]:
    where = f"GPU {index}"
    handle = _device(
        where, index, "nvmlDeviceGetHandleByIndex", lambda: nvml.device_get_handle_by_index(index)
    )
    pci_info = _device(
        where, index, "nvmlDeviceGetPciInfo", lambda: nvml.device_get_pci_info(handle)
    )
    bus_id = short_pci_bus_id(pci_info.busId)
    where = f"GPU {index} ({bus_id})"
    uuid: str | None = None

    def required(call: str, getter: Callable[[DeviceHandle], _T]) -> _T:
        return _device(where, index, call, lambda: getter(handle), pci_bus_id=bus_id, uuid=uuid)

    def optional(call: str, getter: Callable[[DeviceHandle], _T]) -> _T | None:
        try:
            return getter(handle)
        except NVMLError as error:
            if return_code(error) in _ABSENT:
                return None
            raise _gpu_error(where, index, call, error, pci_bus_id=bus_id, uuid=uuid) from error

    uuid = required("nvmlDeviceGetUUID", nvml.device_get_uuid)
    memory = optional("nvmlDeviceGetMemoryInfo", nvml.device_get_memory_info)
    mig_mode = optional("nvmlDeviceGetMigMode", nvml.device_get_mig_mode)
    return handle, Gpu(
        index=index,
        minor=required("nvmlDeviceGetMinorNumber", nvml.device_get_minor_number),
        uuid=uuid,
        product_name=required("nvmlDeviceGetName", nvml.device_get_name),
        brand=required("nvmlDeviceGetBrand", nvml.device_get_brand),
        architecture=required("nvmlDeviceGetArchitecture", nvml.device_get_architecture),
        cuda_compute_capability=required(
            "nvmlDeviceGetCudaComputeCapability", nvml.device_get_cuda_compute_capability
        ),
        driver_version=driver_version,
        cuda_driver_version=cuda_version,
        pci_bus_id=bus_id,
        pci_device_id=pci_info.pciDeviceId,
        pcie_root=pci.pcie_root(bus_id),
        numa_node=pci.numa_node(bus_id),
        memory_bytes=None if memory is None else memory.total,
        addressing_mode=optional("nvmlDeviceGetAddressingMode", nvml.device_get_addressing_mode),
        mig_capable=mig_mode is not None,
        mig_enabled=mig_mode is not None and mig_mode[0] == NVML_DEVICE_MIG_ENABLE,
        mig_pending_enabled=mig_mode is not None and mig_mode[1] == NVML_DEVICE_MIG_ENABLE,
    )


def describe_mig_device(
    nvml: NvmlLibrary, handle: DeviceHandle, gpu: Gpu, mig: DeviceHandle
) -> MigDevice:
    """The `MigDevice` of MIG device handle `mig` of `gpu` (device handle `handle`), described
    as static discovery describes it (dynamic MIG uses it for the instances it creates). NVML
    must be initialised; raises `DiscoveryError`."""
    return _MigWalk(nvml, handle, gpu).device(mig)


def gpu_instance_profiles(
    nvml: NvmlLibrary, handle: DeviceHandle, gpu: Gpu
) -> dict[int, tuple[int, GpuInstanceProfileInfo]]:
    """(profile index, info) of every GPU-instance profile of `gpu`, by profile ID; raises
    `DiscoveryError`, also when no profile index answers (never an empty dict)."""
    return _MigWalk(nvml, handle, gpu).gi_profiles()


class _MigWalk:
    """One MIG-capable GPU's MIG devices and profiles; every failure names the GPU and call."""

    def __init__(self, nvml: NvmlLibrary, handle: DeviceHandle, gpu: Gpu) -> None:
        self.nvml = nvml
        self.handle = handle
        self.gpu = gpu
        self.where = f"GPU {gpu.index} ({gpu.pci_bus_id})"
        self._gi_profiles: dict[int, tuple[int, GpuInstanceProfileInfo]] | None = None
        self._gi_profile_answers: list[int] = []
        """The return code of each profile index that answered "no such profile"."""

    def call(self, name: str, getter: Callable[[], _T]) -> _T:
        return _device(
            self.where,
            self.gpu.index,
            name,
            getter,
            pci_bus_id=self.gpu.pci_bus_id,
            uuid=self.gpu.uuid,
        )

    def profile_or_code(self, name: str, getter: Callable[[], _T]) -> _T | int:
        """`getter`'s profile info, or the return code for a profile index the GPU or GI does
        not have (NOT_SUPPORTED, INVALID_ARGUMENT); other errors raise."""
        try:
            return getter()
        except NVMLError as error:
            code = return_code(error)
            if code is not None and code in _NO_SUCH_PROFILE:
                return code
            raise self.nvml_error(name, error) from error

    def nvml_error(self, call: str, error: Exception) -> DiscoveryError:
        return _gpu_error(
            self.where,
            self.gpu.index,
            call,
            error,
            pci_bus_id=self.gpu.pci_bus_id,
            uuid=self.gpu.uuid,
        )

    def error(
        self, message: str, *, call: str | None = None, code: int | None = None
    ) -> DiscoveryError:
        return DiscoveryError(
            f"{self.where}: {message}",
            gpu_index=self.gpu.index,
            call=call,
            return_code=code,
            pci_bus_id=self.gpu.pci_bus_id,
            uuid=self.gpu.uuid,
        )

    def total_memory(self, state: str) -> int:
        """The GPU's memory size, which MIG profile names (``1g.10gb``) are derived from."""
        if self.gpu.memory_bytes is None:
            raise self.error(
                f"{state} but nvmlDeviceGetMemoryInfo is not supported "
                f"({return_code_name(NVML_ERROR_NOT_SUPPORTED)}); MIG profile names "
                "(e.g. 1g.10gb) are derived from the GPU's total memory",
                call="nvmlDeviceGetMemoryInfo",
                code=NVML_ERROR_NOT_SUPPORTED,
            )
        return self.gpu.memory_bytes

    def devices(self) -> list[MigDevice]:
        """The GPU's MIG devices; its GPU-instance profiles are read first, also when it has
        none, so that MIG state NVML cannot answer is an error, not "no MIG devices"."""
        nvml, handle = self.nvml, self.handle
        self.total_memory("MIG is on")
        self.gi_profiles()
        count = self.call(
            "nvmlDeviceGetMaxMigDeviceCount", lambda: nvml.device_get_max_mig_device_count(handle)
        )
        devices = []
        for mig_index in range(count):
            try:
                mig = nvml.device_get_mig_device_handle_by_index(handle, mig_index)
            except NVMLError as error:
                if return_code(error) == NVML_ERROR_NOT_FOUND:
                    continue  # an empty index
                raise self.nvml_error("nvmlDeviceGetMigDeviceHandleByIndex", error) from error
            devices.append(self.device(mig))
        return sorted(devices, key=lambda d: (d.placement_start, d.gi_id, d.ci_id))

    def offered_profiles(self) -> tuple[MigProfile, ...]:
        """Every GPU-instance profile of the GPU with its possible placements, by profile index.

        Empty on a GPU with MIG off whose profile indexes all answer "no such profile" (it stays
        a whole GPU); on one with MIG on, that, or no placement at all, is a `DiscoveryError`.
        """
        total_memory = self.total_memory("the GPU has MIG")
        if not self.scan_gi_profiles() and not self.gpu.mig_enabled:
            return ()
        profiles = []
        placements_call = "nvmlDeviceGetGpuInstancePossiblePlacements"
        for profile_id, (index, info) in self.gi_profiles().items():
            placements = self.call(
                placements_call,
                partial(
                    self.nvml.device_get_gpu_instance_possible_placements, self.handle, profile_id
                ),
            )
            if not placements:
                continue
            sizes = {placement.size for placement in placements}
            if len(sizes) != 1:
                raise self.error(
                    f"GPU-instance profile {profile_id} has placements of different sizes "
                    f"{sorted(sizes)}; one size per profile is expected",
                    call=placements_call,
                )
            try:
                name = mig_profile_name(
                    index, None, info.memorySizeMB, total_memory, gi_slices=info.sliceCount
                )
            except InvalidNameError as error:
                raise self.error(f"GPU-instance profile {profile_id}: {error}") from error
            profiles.append(
                MigProfile(
                    name=name,
                    gi_profile_id=profile_id,
                    gi_profile_index=index,
                    slice_count=info.sliceCount,
                    placement_starts=tuple(sorted(p.start for p in placements)),
                    placement_size=sizes.pop(),
                    **mig_resources(info),
                )
            )
        if not profiles and self.gpu.mig_enabled:
            raise self.error(
                f"MIG mode is on but {placements_call} lists no placement for any of its "
                f"{len(self.gi_profiles())} GPU-instance profile(s): the GPU can be offered "
                "neither whole nor in MIG slices",
                call=placements_call,
            )
        return tuple(profiles)

    def scan_gi_profiles(self) -> dict[int, tuple[int, GpuInstanceProfileInfo]]:
        """(profile index, info) of every GPU-instance profile of the GPU, by profile ID; empty
        when every index answers "no such profile" (`gi_profiles` makes that an error)."""
        if self._gi_profiles is None:
            found: dict[int, tuple[int, GpuInstanceProfileInfo]] = {}
            for index in range(NVML_GPU_INSTANCE_PROFILE_COUNT):
                info = self.profile_or_code(
                    _GI_PROFILE_INFO,
                    partial(self.nvml.device_get_gpu_instance_profile_info, self.handle, index),
                )
                if isinstance(info, int):
                    self._gi_profile_answers.append(info)
                else:
                    found.setdefault(info.id, (index, info))
            self._gi_profiles = found
        return self._gi_profiles

    def gi_profiles(self) -> dict[int, tuple[int, GpuInstanceProfileInfo]]:
        """`scan_gi_profiles`, never empty: a GPU that answers no profile index is an error
        (NVML lists at least one profile on every MIG-capable GPU; NOT_SUPPORTED for all of
        them means its MIG state cannot be read)."""
        profiles = self.scan_gi_profiles()
        if not profiles:
            codes = sorted(set(self._gi_profile_answers))
            names = " / ".join(return_code_name(code) for code in codes)
            raise self.error(
                f"{_GI_PROFILE_INFO} answered {names} for every GPU-instance profile index "
                f"(0..{NVML_GPU_INSTANCE_PROFILE_COUNT - 1}): the GPU's MIG profiles cannot "
                "be read",
                call=_GI_PROFILE_INFO,
                code=codes[0] if codes else None,
            )
        return profiles

    def ci_slices(self, gi: GpuInstanceHandle, ci_profile_id: int) -> int | None:
        """``sliceCount`` of the GI's compute-instance profile `ci_profile_id`, if listed."""
        for index in range(NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            info = self.profile_or_code(
                "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                partial(
                    self.nvml.gpu_instance_get_compute_instance_profile_info,
                    gi,
                    index,
                    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                ),
            )
            if not isinstance(info, int) and info.id == ci_profile_id:
                return info.sliceCount
        return None

    def device(self, mig: DeviceHandle) -> MigDevice:
        nvml, call = self.nvml, self.call
        total_memory = self.total_memory("the GPU has a MIG device")
        uuid = call("nvmlDeviceGetUUID", lambda: nvml.device_get_uuid(mig))
        gi_id = call("nvmlDeviceGetGpuInstanceId", lambda: nvml.device_get_gpu_instance_id(mig))
        ci_id = call(
            "nvmlDeviceGetComputeInstanceId", lambda: nvml.device_get_compute_instance_id(mig)
        )
        gi = call(
            "nvmlDeviceGetGpuInstanceById",
            lambda: nvml.device_get_gpu_instance_by_id(self.handle, gi_id),
        )
        gi_info = call("nvmlGpuInstanceGetInfo", lambda: nvml.gpu_instance_get_info(gi))
        ci = call(
            "nvmlGpuInstanceGetComputeInstanceById",
            lambda: nvml.gpu_instance_get_compute_instance_by_id(gi, ci_id),
        )
        ci_info = call("nvmlComputeInstanceGetInfo", lambda: nvml.compute_instance_get_info(ci))
        found = self.gi_profiles().get(gi_info.profileId)
        if found is None:
            raise self.error(
                f"MIG device {uuid}: GPU instance {gi_id} has profile ID {gi_info.profileId}, "
                f"which no {_GI_PROFILE_INFO} index returns",
                call=_GI_PROFILE_INFO,
            )
        gi_profile_index, gi_profile = found
        try:
            profile = mig_profile_name(
                gi_profile_index,
                ci_info.profileId,
                gi_profile.memorySizeMB,
                total_memory,
                gi_slices=gi_profile.sliceCount,
                ci_slices=self.ci_slices(gi, ci_info.profileId),
            )
        except InvalidNameError as error:
            raise self.error(f"MIG device {uuid}: {error}") from error
        return MigDevice(
            parent=self.gpu,
            profile=profile,
            gi_profile_id=gi_info.profileId,
            placement_start=gi_info.placement.start,
            placement_size=gi_info.placement.size,
            gi_id=gi_info.id,
            ci_id=ci_info.id,
            ci_profile_id=ci_info.profileId,
            uuid=uuid,
            **mig_resources(gi_profile),
        )


def mig_resources(info: GpuInstanceProfileInfo) -> dict[str, Any]:
    """The `MigResources` fields of a GPU-instance profile, for a `MigDevice` or `MigProfile`."""
    return asdict(
        MigResources(
            memory_bytes=info.memorySizeMB * _MIB,
            multiprocessors=info.multiprocessorCount,
            copy_engines=info.copyEngineCount,
            decoders=info.decoderCount,
            encoders=info.encoderCount,
            jpeg_engines=info.jpegCount,
            ofa_engines=info.ofaCount,
        )
    )


def _system(getter: Callable[[], _T], call: str) -> _T:
    try:
        return getter()
    except NVMLError as error:
        raise DiscoveryError(
            f"{call} failed: {_describe(error)}", call=call, return_code=return_code(error)
        ) from error


def _device(
    where: str,
    index: int,
    call: str,
    getter: Callable[[], _T],
    *,
    pci_bus_id: str | None = None,
    uuid: str | None = None,
) -> _T:
    try:
        return getter()
    except NVMLError as error:
        raise _gpu_error(where, index, call, error, pci_bus_id=pci_bus_id, uuid=uuid) from error


def _gpu_error(
    where: str,
    index: int,
    call: str,
    error: Exception,
    *,
    pci_bus_id: str | None = None,
    uuid: str | None = None,
) -> DiscoveryError:
    return DiscoveryError(
        f"{where}: {call} failed: {_describe(error)}",
        gpu_index=index,
        call=call,
        return_code=return_code(error),
        pci_bus_id=pci_bus_id,
        uuid=uuid,
    )


def _describe(error: Exception) -> str:
    code = return_code(error)
    text = str(error) if code is None else f"{error} ({return_code_name(code)})"
    notes = getattr(error, "__notes__", None)
    return f"{text}; {'; '.join(notes)}" if notes else text
