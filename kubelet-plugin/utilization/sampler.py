"""One utilization sample of the devices prepared claims hold: NVML read once per device.

Per device (GPU or MIG device, by UUID): memory used and total, the compute processes (with the
pod each runs in, from its cgroup), on full GPUs the utilization rates, on GPUs with MPS shares
each process's SM utilization, and on MIG devices of GPUs with GPM (Hopper and newer) the GPU
instance's SM utilization between this sample and the previous one. NVML reports no utilization
rates and no per-process utilization on MIG devices, and pre-Hopper GPUs no GPM: those values
are absent, not 0. A failed call is a `SampleError` (device, call, return code name) and its
value is absent. Blocking: run it in a thread.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gpu_dra.driver.nvml.interface import (
    GPM_ABSENT,
    DeviceHandle,
    GpmSample,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.utilization.cgroups import pod_uid_of
from gpu_dra.kubelet_plugin.utilization.claims import ClaimDevice


@dataclass(frozen=True)
class ProcessReading:
    pid: int
    pod_uid: str | None
    used_memory_bytes: int | None
    sm_percent: float | None
    """Mean SM utilization of the process's samples since the last sample; None where NVML
    gives none (MIG devices, GPUs without MPS shares: not asked)."""


@dataclass(frozen=True)
class DeviceReading:
    uuid: str
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    gpu_percent: int | None = None
    memory_percent: int | None = None
    processes: tuple[ProcessReading, ...] | None = None
    sm_percent: float | None = None
    """MIG devices with GPM: the GPU instance's SM utilization since the previous sample."""


@dataclass(frozen=True)
class SampleError:
    device: str
    """The device's UUID."""
    call: str
    """The failed `NvmlLibrary` call, or ``cgroup`` for a process's cgroup file."""
    reason: str
    """The NVML return code name (``NVML_ERROR_GPU_IS_LOST``), or the exception's class."""
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    at: float
    """Wall-clock time the sample began (seconds since the epoch)."""
    duration_s: float
    devices: tuple[ClaimDevice, ...]
    readings: Mapping[str, DeviceReading] = field(default_factory=dict)
    errors: tuple[SampleError, ...] = ()


class UtilizationSampler:
    """Reads NVML for the devices of `ClaimDevice`s; keeps the last process-sample time per GPU."""

    def __init__(
        self,
        nvml: NvmlLibrary,
        *,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.time,
        process_utilization: bool = True,
    ) -> None:
        """``process_utilization`` False: never ask NVML for per-process SM utilization nor
        GPM (the MPS memory watchdog needs only the processes and their memory)."""
        self._nvml = nvml
        self._per_process = process_utilization
        self._proc_root = proc_root
        self._clock = clock
        self._last_seen_us: dict[str, int] = {}
        self._gpm: dict[str, GpmSample] = {}
        """MIG device UUID -> its GPU instance's previous GPM sample."""
        self._gpm_support: dict[str, bool] = {}
        """MIG device UUID -> whether its GPU offers GPM."""
        self._initialized = False

    def close(self) -> None:
        """Release NVML (``shutdown``) if a sample initialised it, and the GPM samples kept."""
        if self._initialized:
            self._free_gpm(set(self._gpm))
            self._initialized = False
            self._nvml.shutdown()

    def sample(self, devices: Iterable[ClaimDevice]) -> Sample:
        """Read every device `devices` name once; NVML is initialised by the first sample (an
        init error is the sample's one error, device ``""``, and the next sample tries again)."""
        at = self._clock()
        started = time.perf_counter()
        held = tuple(devices)
        if not self._initialized:
            try:
                self._nvml.init()
            except Exception as error:  # pynvml errors
                failed = (_error("", "init", error),)
                return Sample(at, time.perf_counter() - started, held, {}, failed)
            self._initialized = True
        with_shares = {d.uuid for d in held if d.tier == "mps-share" and d.uuid}
        if not self._per_process:
            with_shares = set()
        readings: dict[str, DeviceReading] = {}
        errors: list[SampleError] = []
        for uuid in sorted({d.uuid for d in held if d.uuid}):
            readings[uuid] = self._read(uuid, uuid in with_shares, errors)
        for gone in set(self._last_seen_us) - with_shares:
            del self._last_seen_us[gone]
        self._free_gpm(set(self._gpm) - set(readings))
        for gone in set(self._gpm_support) - set(readings):
            del self._gpm_support[gone]
        return Sample(at, time.perf_counter() - started, held, readings, tuple(errors))

    def _read(self, uuid: str, shares: bool, errors: list[SampleError]) -> DeviceReading:
        def call(name: str, *args: object) -> object | None:
            try:
                result: object = getattr(self._nvml, name)(*args)
            except Exception as error:  # pynvml errors; anything else is reported alike
                errors.append(_error(uuid, name, error))
                return None
            return result

        handle: DeviceHandle | None = call("device_get_handle_by_uuid", uuid)
        if handle is None:
            return DeviceReading(uuid)
        memory = call("device_get_memory_info", handle)
        used = getattr(memory, "used", None)
        total = getattr(memory, "total", None)
        gpu_percent = memory_percent = None
        mig = uuid.startswith("MIG-")
        if not mig:
            rates = call("device_get_utilization_rates", handle)
            gpu_percent = getattr(rates, "gpu", None)
            memory_percent = getattr(rates, "memory", None)
        sm_percent = self._gpm_sm_percent(uuid, handle, call) if mig and self._per_process else None
        listed = call("device_get_compute_running_processes", handle)
        sm = self._process_utilization(uuid, handle, call) if shares and not mig else None
        processes = None
        if isinstance(listed, list):
            processes = tuple(
                ProcessReading(
                    pid=int(info.pid),
                    pod_uid=self._pod(uuid, int(info.pid), errors),
                    used_memory_bytes=info.usedGpuMemory,
                    sm_percent=None if sm is None else sm.get(int(info.pid), 0.0),
                )
                for info in listed
            )
        return DeviceReading(uuid, used, total, gpu_percent, memory_percent, processes, sm_percent)

    def _gpm_sm_percent(
        self, uuid: str, handle: DeviceHandle, call: Callable[..., object | None]
    ) -> float | None:
        """The MIG device's GPU instance's SM utilization since the previous sample (None the
        first time, without GPM, or when a call failed)."""
        parent = call("device_get_device_handle_from_mig_device_handle", handle)
        gi_id = call("device_get_gpu_instance_id", handle)
        if parent is None or not isinstance(gi_id, int):
            return None
        if uuid not in self._gpm_support:
            try:
                self._gpm_support[uuid] = bool(self._nvml.gpm_query_device_support(parent))
            except Exception as error:  # pynvml errors
                if return_code(error) not in GPM_ABSENT:
                    call("gpm_query_device_support", parent)  # report it as the call's error
                    return None
                self._gpm_support[uuid] = False
        if not self._gpm_support[uuid]:
            return None
        newer = call("gpm_mig_sample_get", parent, gi_id)
        if newer is None:
            self._free_gpm({uuid})
            return None
        older = self._gpm.get(uuid)
        self._gpm[uuid] = newer
        if older is None:
            return None
        percent = call("gpm_sm_utilization", older, newer)
        with contextlib.suppress(Exception):  # a sample NVML cannot free is lost, not fatal
            self._nvml.gpm_sample_free(older)
        return float(percent) if isinstance(percent, int | float) else None

    def _free_gpm(self, uuids: set[str]) -> None:
        for uuid in uuids:
            sample = self._gpm.pop(uuid, None)
            if sample is not None:
                with contextlib.suppress(Exception):
                    self._nvml.gpm_sample_free(sample)

    def _process_utilization(
        self, uuid: str, handle: DeviceHandle, call: Callable[..., object | None]
    ) -> dict[int, float] | None:
        samples = call("device_get_process_utilization", handle, self._last_seen_us.get(uuid, 0))
        if not isinstance(samples, list):
            return None
        by_pid: dict[int, list[int]] = defaultdict(list)
        for sample in samples:
            by_pid[int(sample.pid)].append(int(sample.smUtil))
            self._last_seen_us[uuid] = max(self._last_seen_us.get(uuid, 0), int(sample.timeStamp))
        return {pid: sum(values) / len(values) for pid, values in by_pid.items()}

    def _pod(self, uuid: str, pid: int, errors: list[SampleError]) -> str | None:
        try:
            return pod_uid_of(pid, self._proc_root)
        except OSError as error:
            errors.append(SampleError(uuid, "cgroup", type(error).__name__, f"pid {pid}: {error}"))
            return None


def _error(uuid: str, call: str, error: Exception) -> SampleError:
    code = return_code(error)
    reason = type(error).__name__ if code is None else return_code_name(code)
    return SampleError(uuid, call, reason, str(error))
