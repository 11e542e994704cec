"""The opaque config API ``resource.nvidia.com/v1beta1`` (``GpuConfig``, ``MigDeviceConfig``).

Pure: maps JSON values to config objects and config groups; no I/O. The kubelet plugin calls
`resolve_configs` with a claim's allocation, then `pinned_memory_limits` per MPS group once the
group's device UUIDs are known. Errors are `ConfigError`, worded for the claim's author.
"""

from gpu_dra.driver.config.api import API_GROUP, API_VERSION, DeviceType
from gpu_dra.driver.config.decode import KINDS, DeviceConfig, decode_parameters
from gpu_dra.driver.config.errors import ConfigError, ConfigProblem, DomainError
from gpu_dra.driver.config.gpuconfig import GpuConfig
from gpu_dra.driver.config.limits import mps_config, pinned_memory_limits, render_pinned_limit
from gpu_dra.driver.config.migconfig import MigDeviceConfig
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity, quantity_value
from gpu_dra.driver.config.resolve import (
    AllocatedDevice,
    ConfigGroup,
    ConfigOrigin,
    ResolvedConfigs,
    resolve_configs,
    shown_name,
)
from gpu_dra.driver.config.sharing import (
    GpuSharing,
    MigDeviceSharing,
    MpsConfig,
    TimeSlicingConfig,
)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "KINDS",
    "AllocatedDevice",
    "ConfigError",
    "ConfigGroup",
    "ConfigOrigin",
    "ConfigProblem",
    "DeviceConfig",
    "DeviceType",
    "DomainError",
    "GpuConfig",
    "GpuSharing",
    "MigDeviceConfig",
    "MigDeviceSharing",
    "MpsConfig",
    "QuantityError",
    "ResolvedConfigs",
    "TimeSlicingConfig",
    "decode_parameters",
    "mps_config",
    "parse_quantity",
    "pinned_memory_limits",
    "quantity_value",
    "render_pinned_limit",
    "resolve_configs",
    "shown_name",
]
