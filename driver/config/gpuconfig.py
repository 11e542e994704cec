"""``GpuConfig``: the opaque config kind for full GPUs (devices of type ``gpu``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from gpu_dra.driver.config.api import API_VERSION, DeviceType, StrictModel
from gpu_dra.driver.config.sharing import GpuSharing


class GpuConfig(StrictModel):
    """``{apiVersion: resource.nvidia.com/v1beta1, kind: GpuConfig, sharing?: GpuSharing}``.

    Without ``sharing`` the GPU is handed to the claim as is (no time-slice change, no MPS).
    """

    KIND: ClassVar[str] = "GpuConfig"
    DEVICE_TYPE: ClassVar[DeviceType] = "gpu"

    api_version: Literal["resource.nvidia.com/v1beta1"] = API_VERSION
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: GpuSharing | None = None

    def normalized(self) -> GpuConfig:
        """Defaults filled in (`GpuSharing.normalized`); absent sharing stays absent."""
        if self.sharing is None:
            return self
        return self.model_copy(update={"sharing": self.sharing.normalized()})
