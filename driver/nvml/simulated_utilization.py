"""What the simulated GPUs are doing: utilization per GPU and MIG device, and their processes.

`SimulatedNvml` answers ``device_get_utilization_rates``, ``device_get_compute_running_processes``,
``device_get_process_utilization`` and the ``used`` memory of ``device_get_memory_info`` from one
`UtilizationModel`, set by tests, or by the kubelet plugin from a file of the data dir
(docs/metrics.md#simulated-utilization). Devices are keyed by UUID (``GPU-...`` or ``MIG-...``);
nothing set means idle: 0 %, no processes, no memory used.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


class UtilizationError(ValueError):
    """A utilization setting that cannot hold; the message says which value and why."""


@dataclass(frozen=True)
class SimulatedProcess:
    """One process with a compute context on a simulated device."""

    pid: int
    used_memory_bytes: int = 0
    sm_percent: int = 0
    """Its share of the device's SMs, in percent of the sample period."""
    memory_percent: int = 0
    """Its share of the device's memory bandwidth, in percent."""

    def __post_init__(self) -> None:
        if self.pid <= 0:
            raise UtilizationError(f"process pid must be positive, got {self.pid}")
        if self.used_memory_bytes < 0:
            raise UtilizationError(f"process {self.pid}: used memory must not be negative")
        for name, value in (("sm", self.sm_percent), ("memory", self.memory_percent)):
            if not 0 <= value <= 100:
                raise UtilizationError(f"process {self.pid}: {name} {value} is not 0..100")


@dataclass(frozen=True)
class DeviceActivity:
    """What one GPU or MIG device does: utilization rates, memory used, processes.

    `memory_used_bytes` None: the processes' memory summed."""

    gpu_percent: int = 0
    memory_percent: int = 0
    memory_used_bytes: int | None = None
    processes: tuple[SimulatedProcess, ...] = field(default=())

    def __post_init__(self) -> None:
        for name, value in (("gpu", self.gpu_percent), ("memory", self.memory_percent)):
            if not 0 <= value <= 100:
                raise UtilizationError(f"{name} utilization {value} is not 0..100")
        if self.memory_used_bytes is not None and self.memory_used_bytes < 0:
            raise UtilizationError("memory used must not be negative")
        pids = [process.pid for process in self.processes]
        if len(set(pids)) != len(pids):
            raise UtilizationError(f"a pid is listed twice: {sorted(pids)}")

    def used_bytes(self, total_bytes: int) -> int:
        """Memory used, at most `total_bytes`."""
        used = self.memory_used_bytes
        if used is None:
            used = sum(process.used_memory_bytes for process in self.processes)
        return min(used, total_bytes)


IDLE = DeviceActivity()


class UtilizationModel:
    """Activity by device UUID; thread-safe. `replace` swaps the whole picture at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._devices: dict[str, DeviceActivity] = {}

    def set(self, uuid: str, activity: DeviceActivity) -> None:
        with self._lock:
            self._devices[uuid] = activity

    def replace(self, devices: Mapping[str, DeviceActivity]) -> None:
        with self._lock:
            self._devices = dict(devices)

    def get(self, uuid: str) -> DeviceActivity:
        with self._lock:
            return self._devices.get(uuid, IDLE)

    def uuids(self) -> Iterable[str]:
        with self._lock:
            return tuple(self._devices)
