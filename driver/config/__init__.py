"""The opaque config API ``resource.nvidia.com/v1beta1`` (``GpuConfig``, ``MigDeviceConfig``).

Pure: maps JSON values to config objects; no I/O. Errors are `ConfigError`, worded for the
claim's author.
"""

from gpu_dra.driver.config.api import API_GROUP, API_VERSION, DeviceType
from gpu_dra.driver.config.decode import KINDS, DeviceConfig, decode_parameters
from gpu_dra.driver.config.errors import ConfigError, ConfigProblem, DomainError
from gpu_dra.driver.config.gpuconfig import GpuConfig
from gpu_dra.driver.config.migconfig import MigDeviceConfig
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity, quantity_value
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
    "ConfigError",
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
    "TimeSlicingConfig",
    "decode_parameters",
    "parse_quantity",
    "quantity_value",
]
