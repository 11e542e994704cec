"""The ``resource.nvidia.com/v1beta1`` opaque config API: version, device types, model base.

Users put these objects in ``opaque.parameters`` of a claim's or DeviceClass's config with
``driver: gpu.nvidia.com``. Field names and values match NVIDIA's driver exactly, so manifests
written for it work unchanged (``shared/reference/nvidia-compat.md`` §4).
"""

from __future__ import annotations

import json
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

API_GROUP: Final = "resource.nvidia.com"
API_VERSION: Final = "resource.nvidia.com/v1beta1"

# The `type` attribute of the devices a config kind applies to.
DeviceType = Literal["gpu", "mig"]


class StrictModel(BaseModel):
    """Base of every API object: camelCase JSON names, no unknown fields, no type coercion.

    Python code builds objects by snake_case name (``GpuSharing(strategy="MPS")``); decoding
    accepts only the JSON names (see `gpu_dra.driver.config.decode`). Objects are immutable.
    """

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
        serialize_by_alias=True,
    )

    def __hash__(self) -> int:
        # Pydantic's frozen hash fails on dict fields (per-device limits); hash the canonical JSON,
        # which is equal exactly when the objects are.
        return hash((type(self), json.dumps(self.model_dump(mode="json"), sort_keys=True)))
