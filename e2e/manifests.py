"""Builders for the manifests the e2e tests create (plain dicts, shaped like users write them)."""

from __future__ import annotations

from typing import Any

from e2e.cluster import versions

Obj = dict[str, Any]

# Prints what the container received from gpu-dra, then stays up (its log can be read) until
# SIGTERM, which it honours at once so that deleting pods and namespaces is quick.
SHOW_GPUS = (
    "trap 'exit 0' TERM; env | grep ^GPU_DRA_ | sort; "
    "cat /run/gpu-dra/devices/*.json 2>/dev/null; sleep 3600 & wait"
)

# Prints what an MPS client container sees: the CUDA_MPS_* environment and the pipe directory
# mounted at /tmp/nvidia-mps (the daemon's files, its PID), between markers; then as SHOW_GPUS.
SHOW_MPS = (
    "trap 'exit 0' TERM; echo '--- env'; env | grep ^CUDA_MPS_ | sort; "
    "echo '--- ls'; ls -a /tmp/nvidia-mps; "
    "echo '--- pid'; cat /tmp/nvidia-mps/nvidia-cuda-mps-control.pid; echo '--- end'; "
    "sleep 3600 & wait"
)


def container(name: str = "ctr", command: str = SHOW_GPUS, claims: list[Obj] | None = None) -> Obj:
    spec: Obj = {
        "name": name,
        "image": versions.TEST_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
    }
    if claims is not None:
        spec["resources"] = {"claims": claims}
    return spec


def device_plugin_pod(
    name: str, namespace: str, limits: dict[str, str], command: str = SHOW_GPUS
) -> Obj:
    """A pod as written for NVIDIA's device plugin: extended resources in its limits, no claim."""
    ctr = container(command=command)
    ctr["resources"] = {"limits": dict(limits)}
    return pod(name, namespace, [ctr])


def resource_quota(name: str, namespace: str, hard: dict[str, str]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"hard": dict(hard)},
    }


def class_quota(device_class: str) -> str:
    """The ResourceQuota resource counting the devices a namespace holds through a class."""
    return f"{device_class}.deviceclass.resource.k8s.io/devices"


def pod(
    name: str,
    namespace: str,
    containers: list[Obj],
    resource_claims: list[Obj] | None = None,
) -> Obj:
    spec: Obj = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": containers,
    }
    if resource_claims:
        spec["resourceClaims"] = resource_claims
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def gpu_pod(
    name: str,
    namespace: str,
    *,
    template: str | None = None,
    claim: str | None = None,
    command: str = SHOW_GPUS,
) -> Obj:
    """One container using pod claim `gpu`, from a template or an existing claim."""
    source = {"resourceClaimTemplateName": template} if template else {"resourceClaimName": claim}
    return pod(
        name,
        namespace,
        [container(command=command, claims=[{"name": "gpu"}])],
        [{"name": "gpu", **source}],
    )


def request(
    name: str = "gpu",
    device_class: str = "gpu.nvidia.com",
    selectors: list[str] | None = None,
    count: int | None = None,
) -> Obj:
    exactly: Obj = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if count is not None:
        exactly["count"] = count
    return {"name": name, "exactly": exactly}


def share_claim(
    name: str,
    namespace: str,
    memory: str | None,
    compute: int | None,
    *,
    device_class: str = "mps.gpu.nvidia.com",
    selectors: list[str] | None = None,
) -> Obj:
    """A claim of one share: ``memory`` and ``compute`` (percent of the SMs) of a device of
    ``device_class`` offered as shares (the class carries the config), request ``share``; an
    amount given as None is not named (the request policy's default: 1/N of the device)."""
    share = request("share", device_class=device_class, selectors=selectors)
    amounts = {"memory": memory, "compute": None if compute is None else str(compute)}
    named = {key: value for key, value in amounts.items() if value is not None}
    if named:
        share["exactly"]["capacity"] = {"requests": named}
    return claim(name, namespace, claim_spec([share]))


def claim_spec(requests: list[Obj], config: list[Obj] | None = None) -> Obj:
    devices: Obj = {"requests": requests}
    if config:
        devices["config"] = config
    return {"devices": devices}


def claim(name: str, namespace: str, spec: Obj) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def claim_template(name: str, namespace: str, spec: Obj) -> Obj:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": spec},
    }


def gpu_config(parameters: Obj, requests: list[str] | None = None) -> Obj:
    entry: Obj = {
        "opaque": {
            "driver": "gpu.nvidia.com",
            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", **parameters},
        }
    }
    if requests:
        entry["requests"] = requests
    return entry


def mps_sharing(config_kind: str = "GpuConfig", **mps_config: Any) -> Obj:
    """`GpuConfig` (or `MigDeviceConfig`) parameters with `sharing.strategy: MPS` and the given
    `mpsConfig` fields."""
    sharing: Obj = {"strategy": "MPS"}
    if mps_config:
        sharing["mpsConfig"] = mps_config
    return {"kind": config_kind, "sharing": sharing}


def deployment(name: str, namespace: str, *, template: str, command: str = SHOW_GPUS) -> Obj:
    """One replica of a pod (label ``app: <name>``) whose container uses pod claim `gpu`, made
    from ResourceClaimTemplate `template`: each pod the controller makes gets a claim of its
    own."""
    pod_spec = gpu_pod(name, namespace, template=template, command=command)["spec"]
    pod_spec["restartPolicy"] = "Always"  # the only one a Deployment takes
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
