"""What simulated GPUs do, set from outside the plugin: ``<data-dir>/simulated-utilization.json``.

On a simulated node the plugin reads the file before every utilization sample (when it changed)
and hands it to `SimulatedNvml`: the whole picture at once, so a device the file does not name
is idle, and a missing file means every device is. A file that cannot be used is logged and the
previous picture kept. Keys: a GPU's NVML index, UUID or device name (``gpu-<minor>``), or a MIG
device's UUID. Form (docs/metrics.md#simulated-utilization)::

    {"devices": {"gpu-0": {"gpu": 85, "memory": 40, "memoryUsedBytes": 21474836480},
                 "gpu-1": {"processes": [{"pid": 4242, "sm": 30, "usedMemoryBytes": 1073741824}]}}}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_utilization import (
    DeviceActivity,
    SimulatedProcess,
    UtilizationError,
)

log = logging.getLogger(__name__)

SIMULATED_UTILIZATION_FILE: Final = "simulated-utilization.json"


def write_utilization(path: Path, devices: Mapping[str, Mapping[str, Any]]) -> None:
    """Write the file atomically (the plugin never reads half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=path.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        json.dump({"devices": {key: dict(value) for key, value in devices.items()}}, file)
    Path(temporary).chmod(0o644)
    Path(temporary).replace(path)


def parse_utilization(text: str) -> dict[str, DeviceActivity]:
    """The activities by device key; raises `UtilizationError` naming what is wrong."""
    try:
        document = json.loads(text)
    except ValueError as error:
        raise UtilizationError(f"not JSON: {error}") from error
    devices = document.get("devices") if isinstance(document, dict) else None
    if not isinstance(devices, dict):
        raise UtilizationError('the file is a JSON object with a "devices" object')
    found = {}
    for key, value in devices.items():
        if not isinstance(value, dict):
            raise UtilizationError(f"device {key!r}: not an object")
        try:
            found[key] = DeviceActivity(
                gpu_percent=_int(value, "gpu", 0),
                memory_percent=_int(value, "memory", 0),
                memory_used_bytes=_optional_int(value, "memoryUsedBytes"),
                processes=tuple(_process(item) for item in _list(value, "processes")),
            )
        except UtilizationError as error:
            raise UtilizationError(f"device {key!r}: {error}") from error
    return found


class SimulatedUtilizationFile:
    """Applies the file to `nvml` when it changed (`apply`, before every sample)."""

    def __init__(self, path: Path, nvml: SimulatedNvml) -> None:
        self.path = path
        self._nvml = nvml
        self._seen: tuple[int, int] | None = None

    def apply(self) -> None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            if self._seen != (0, 0):
                self._nvml.utilization.replace({})
                self._seen = (0, 0)
            return
        key = (stat.st_mtime_ns, stat.st_ino)
        if key == self._seen:
            return
        self._seen = key
        try:
            activities = parse_utilization(self.path.read_text(encoding="utf-8"))
            by_uuid = {self._uuid(device): activity for device, activity in activities.items()}
        except (OSError, UtilizationError) as error:
            log.error("simulated utilization %s refused (kept the last): %s", self.path, error)
            return
        self._nvml.utilization.replace(by_uuid)
        log.info("simulated utilization from %s: %d device(s)", self.path, len(by_uuid))

    def _uuid(self, device: str) -> str:
        if device.startswith("MIG-"):
            return device
        gpus = self._nvml.profile.gpus
        by_name = {f"gpu-{gpu.minor}": gpu.uuid for gpu in gpus}
        if device in by_name:
            return by_name[device]
        try:
            return gpus[self._nvml.gpu_index(device)].uuid
        except ValueError as error:
            raise UtilizationError(str(error)) from error


def _process(value: object) -> SimulatedProcess:
    if not isinstance(value, dict):
        raise UtilizationError(f"a process is an object with a pid, got {value!r}")
    pid = _optional_int(value, "pid")
    if pid is None:
        raise UtilizationError("a process needs its 'pid'")
    return SimulatedProcess(
        pid=pid,
        used_memory_bytes=_int(value, "usedMemoryBytes", 0),
        sm_percent=_int(value, "sm", 0),
        memory_percent=_int(value, "memory", 0),
    )


def _list(value: Mapping[str, object], key: str) -> list[object]:
    found = value.get(key, [])
    if not isinstance(found, list):
        raise UtilizationError(f"{key!r} must be a list")
    return found


def _int(value: Mapping[str, object], key: str, default: int) -> int:
    found = _optional_int(value, key)
    return default if found is None else found


def _optional_int(value: Mapping[str, object], key: str) -> int | None:
    found = value.get(key)
    if found is None:
        return None
    if not isinstance(found, int) or isinstance(found, bool):
        raise UtilizationError(f"{key!r} must be a whole number, got {found!r}")
    return found
