"""`RecordingDeviceClassApi`: a `DeviceClassApi` that records applies and can refuse some."""

from __future__ import annotations

import copy
import threading

from gpu_dra.controller.catalog import DeviceClass
from gpu_dra.kube import errors


class RecordingDeviceClassApi:
    def __init__(self, refuse: dict[str, errors.ApiError] | None = None) -> None:
        self.refuse = dict(refuse or {})
        self.applied: list[DeviceClass] = []
        self.stored: dict[str, DeviceClass] = {}
        self._lock = threading.Lock()

    def apply(self, device_class: DeviceClass) -> None:
        name = device_class["metadata"]["name"]
        with self._lock:
            if name in self.refuse:
                raise self.refuse[name]
            self.applied.append(copy.deepcopy(device_class))
            self.stored[name] = copy.deepcopy(device_class)
