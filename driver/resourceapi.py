"""Typed shapes of the `resource.k8s.io/v1` JSON objects the driver produces and reads.

These are the raw API dictionaries (camelCase keys, as the apiserver serves them), typed with
``TypedDict`` so that the pure core can build them and the edges can send them without conversion.
Only the fields gpu-dra uses are declared. Field meanings: `shared/reference/resource-api.md` §3-5.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

API_GROUP = "resource.k8s.io"
API_VERSION = "resource.k8s.io/v1"

# Standard attribute domain shared by drivers (pciBusID, pcieRoot, numaNode).
STANDARD_ATTRIBUTE_DOMAIN = "resource.kubernetes.io"


class DeviceAttribute(TypedDict, total=False):
    """Exactly one of the keys is set."""

    int: int
    bool: bool
    string: str
    version: str


class CapacityRequestPolicyRange(TypedDict, total=False):
    min: str
    max: str
    step: str


class CapacityRequestPolicy(TypedDict, total=False):
    default: str
    validValues: list[str]
    validRange: CapacityRequestPolicyRange


class DeviceCapacity(TypedDict):
    value: str  # a Kubernetes quantity, e.g. "80Gi"
    requestPolicy: NotRequired[CapacityRequestPolicy]


class Counter(TypedDict):
    value: str


class CounterSet(TypedDict):
    name: str
    counters: dict[str, Counter]


class DeviceCounterConsumption(TypedDict):
    counterSet: str
    counters: dict[str, Counter]


class DeviceTaint(TypedDict):
    key: str
    value: NotRequired[str]
    effect: str  # None, NoSchedule or NoExecute
    timeAdded: NotRequired[str]  # RFC 3339; the apiserver sets it when absent


class Device(TypedDict):
    name: str
    attributes: NotRequired[dict[str, DeviceAttribute]]
    capacity: NotRequired[dict[str, DeviceCapacity]]
    consumesCounters: NotRequired[list[DeviceCounterConsumption]]
    allowMultipleAllocations: NotRequired[bool]
    taints: NotRequired[list[DeviceTaint]]


class ResourcePool(TypedDict):
    name: str
    generation: int
    resourceSliceCount: int


class ResourceSliceSpec(TypedDict):
    driver: str
    pool: ResourcePool
    nodeName: NotRequired[str]
    devices: NotRequired[list[Device]]
    sharedCounters: NotRequired[list[CounterSet]]
