"""DRA device selectors in CEL, evaluated as the Kubernetes scheduler evaluates them.

    selector = compile_selector("device.attributes['gpu.nvidia.com'].type == 'gpu'")
    selector.matches(to_cel_device("gpu.nvidia.com", published_device))
    select(selector, DeviceTable([(driver, published_device), ...]))  # the same results,
    # each group of devices alike on what the selector reads converted and evaluated once

Semantics, engine choice and limits: docs/cel.md. Pure: no I/O.
"""

from gpu_dra.driver.cel.batch import DeviceTable, PublishedDevice, Selection, select
from gpu_dra.driver.cel.device import AttributeValue, DraDevice, to_cel_device
from gpu_dra.driver.cel.errors import CelCompileError, CelError, CelRuntimeError
from gpu_dra.driver.cel.selector import MAX_EXPRESSION_LENGTH, Selector, compile_selector
from gpu_dra.driver.cel.values import CelValueError, Quantity, Semver

__all__ = [
    "MAX_EXPRESSION_LENGTH",
    "AttributeValue",
    "CelCompileError",
    "CelError",
    "CelRuntimeError",
    "CelValueError",
    "DeviceTable",
    "DraDevice",
    "PublishedDevice",
    "Quantity",
    "Selection",
    "Selector",
    "Semver",
    "compile_selector",
    "select",
    "to_cel_device",
]
