"""Raw ``resource.k8s.io/v1`` objects as the apiserver serves them, for the cluster model, `gpu-dra
explain` / ``inventory`` and the controller's inventory gauges: slices of L4 / A100 GPUs,
DeviceClasses, claims with their allocation."""

from __future__ import annotations

from typing import Any

DRIVER = "gpu.nvidia.com"
Obj = dict[str, Any]

GPU_CLASS_CEL = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"
MIG_CLASS_CEL = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'mig'"


def gpu(
    name: str,
    product: str = "NVIDIA L4",
    *,
    memory: str = "23034Mi",
    driver_version: str = "580.65.6",
    kind: str = "gpu",
    **extra: Any,
) -> Obj:
    device: Obj = {
        "name": name,
        "attributes": {
            "type": {"string": kind},
            "productName": {"string": product},
            "driverVersion": {"version": driver_version},
            "uuid": {"string": f"GPU-{name}"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    device.update(extra)
    return device


def l4(name: str) -> Obj:
    return gpu(name, "NVIDIA L4")


def a100(name: str) -> Obj:
    return gpu(name, "NVIDIA A100 80GB PCIe", memory="80Gi")


def resource_slice(
    node: str | None,
    devices: list[Obj],
    *,
    pool: str | None = None,
    generation: int = 1,
    count: int = 1,
    name: str | None = None,
    driver: str = DRIVER,
    shared_counters: list[Obj] | None = None,
) -> Obj:
    spec: Obj = {
        "driver": driver,
        "pool": {
            "name": pool or node or "cluster",
            "generation": generation,
            "resourceSliceCount": count,
        },
        "devices": devices,
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    if shared_counters is not None:
        spec["sharedCounters"] = shared_counters
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name or f"{pool or node}-{generation}-{len(devices)}"},
        "spec": spec,
    }


def device_class(name: str, *expressions: str) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": e}} for e in expressions]},
    }


def standard_classes() -> list[Obj]:
    return [
        device_class("gpu.nvidia.com", GPU_CLASS_CEL),
        device_class("mig.nvidia.com", MIG_CLASS_CEL),
    ]


def exactly(
    name: str = "gpu",
    device_class: str = "gpu.nvidia.com",
    *selectors: str,
    count: int | None = None,
    **extra: Any,
) -> Obj:
    spec: Obj = {"deviceClassName": device_class}
    if selectors:
        spec["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if count is not None:
        spec["count"] = count
    spec.update(extra)
    return {"name": name, "exactly": spec}


def claim(
    namespace: str,
    name: str,
    requests: list[Obj] | None = None,
    *,
    constraints: list[Obj] | None = None,
    allocated: list[tuple[str, str]] | None = None,
    pool: str = "node-a",
    results: list[Obj] | None = None,
) -> Obj:
    """A claim; `allocated` = [(request, device)] in `pool`, or full `results` entries."""
    devices: Obj = {"requests": requests if requests is not None else [exactly()]}
    if constraints:
        devices["constraints"] = constraints
    obj: Obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"devices": devices},
    }
    entries = list(results or [])
    entries += [
        {"request": request, "driver": DRIVER, "pool": pool, "device": device}
        for request, device in allocated or []
    ]
    if entries:
        obj["status"] = {
            "allocation": {"devices": {"results": entries}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": "u"}],
        }
    return obj


def mixed_node(node: str = "node-a") -> Obj:
    """The e2e cluster's "mixed" profile: 2x A100 80GB, 2x L4."""
    return resource_slice(node, [a100("gpu-0"), a100("gpu-1"), l4("gpu-2"), l4("gpu-3")])


# ---- tests -------------------------------------------------------------------------------------
