"""``MigDeviceConfig``: the opaque config kind for MIG devices (devices of type ``mig``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from gpu_dra.driver.config.api import API_VERSION, DeviceType, StrictModel
from gpu_dra.driver.config.sharing import MigDeviceSharing


class MigDeviceConfig(StrictModel):
    """``{apiVersion: resource.nvidia.com/v1beta1, kind: MigDeviceConfig, sharing?}``.

    Time-slicing a MIG device is accepted but changes nothing on the device.
    """

    KIND: ClassVar[str] = "MigDeviceConfig"
    DEVICE_TYPE: ClassVar[DeviceType] = "mig"

    api_version: Literal["resource.nvidia.com/v1beta1"] = API_VERSION
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigDeviceSharing | None = None

    def normalized(self) -> MigDeviceConfig:
        """Defaults filled in (`MigDeviceSharing.normalized`); absent sharing stays absent."""
        if self.sharing is None:
            return self
        return self.model_copy(update={"sharing": self.sharing.normalized()})
