"""Kueue on the e2e cluster, built from its pinned Go module like every test-bed tool.

`build` builds Kueue's manager from ``e2e/toolchain/kueue`` (Go module ``sigs.k8s.io/kueue`` at
`VERSION`, cached under ``<cache>/tools/kueue-<hash>``). `Kueue.install` runs it the way users
install Kueue: the Helm chart shipped in the module zip (``charts/kueue`` in the Go module
cache, never copied into this repository), release ``kueue`` in ``kueue-system``, from a
minimal image of the static manager binary assembled here (`manager_image`), with the
``DynamicResourceAllocation`` feature gate (alpha) and `DEVICE_CLASS_MAPPINGS` for the catalog
in its Configuration. The manager is a Deployment whose webhooks the apiserver reaches at the
pod's address (``--enable-aggregator-routing``); the one change to the chart's objects is the
apiserver's node address in the manager's environment (the e2e cluster has no kube-proxy for
the service IP).
The builders below (`cluster_queue`, `local_queue`, `job`, ...) make the objects the e2e test
creates. See docs/kueue.md.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import yaml
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from e2e import manifests as m
from e2e.cluster import Cluster, images, versions
from e2e.cluster.paths import ClusterPaths
from e2e.cluster.toolchain import TOOLCHAIN, ToolBuild, build_tool, go_env, run_go
from e2e.kube import Kube, wait_for

Obj = dict[str, Any]

VERSION: Final = "v0.17.0"
"""The Kueue release pinned in ``e2e/toolchain/kueue/go.mod``."""

MODULE: Final = "sigs.k8s.io/kueue"
MANAGER: Final = "kueue"

TOOL: Final = ToolBuild(
    name="kueue",
    outputs=((MANAGER, f"{MODULE}/cmd/kueue"),),
    # What Kueue's Makefile sets, so that the start-up log names the release.
    ldflags=f"-s -w -X {MODULE}/pkg/version.GitVersion={VERSION}",
)

RELEASE: Final = "kueue"
NAMESPACE: Final = "kueue-system"
"""Release and namespace as Kueue's docs install them: the chart's objects are then named as
the manager's internal certificate management expects (``kueue-webhook-service``, ...)."""
IMAGE_REPOSITORY: Final = "localhost/gpu-dra/kueue"
MANAGER_SELECTOR: Final = "control-plane=controller-manager"
CERT_SECRET: Final = f"{RELEASE}-webhook-server-cert"
"""The webhook's certificate, which the manager makes (the chart's internal certificate
management) and the manager pod mounts."""
FEATURE_GATES: Final = {"DynamicResourceAllocation": True}
"""Kueue's DRA quota accounting: alpha since v0.14, off by default (also in v0.17)."""
KUEUE_API: Final = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL: Final = "kueue.x-k8s.io/priority-class"
FLAVOR: Final = "default-flavor"

DEVICE_CLASS_MAPPINGS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    (
        "gpu.nvidia.com/gpu",
        (
            "gpu.nvidia.com",
            "hopper.gpu.nvidia.com",
            "large-memory.gpu.nvidia.com",
            "training.gpu.nvidia.com",
        ),
    ),
    ("gpu.nvidia.com/mig", ("mig.nvidia.com",)),
    ("gpu.nvidia.com/mig-1g", ("mig-1g.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mig-2g", ("mig-2g.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mig-3g", ("mig-3g.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mig-4g", ("mig-4g.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mig-7g", ("mig-7g.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mps", ("mps.gpu.nvidia.com",)),
    ("gpu.nvidia.com/mps-mig", ("mps.mig.nvidia.com",)),
    ("gpu.nvidia.com/capped", ("capped.gpu.nvidia.com",)),
)
"""Kueue's ``resources.deviceClassMappings`` for the catalog (deviceclasses/): the logical
resource a ClusterQueue gives quota of, and the DeviceClasses whose devices count towards it
(Kueue counts devices per class: a whole GPU, a MIG slice, an MPS share each count 1)."""

WHOLE_GPU: Final = "gpu.nvidia.com/gpu"
MIG_1G: Final = "gpu.nvidia.com/mig-1g"
MPS_SHARE: Final = "gpu.nvidia.com/mps"


def build(paths: ClusterPaths) -> Path:
    """The directory holding Kueue's manager (built now unless cached)."""
    return build_tool(paths, TOOL)


def module_dir(paths: ClusterPaths) -> Path:
    """Kueue's module in the Go module cache (its chart, CRDs and config); downloaded by the
    build, or now (``go mod download``) if the cache was emptied since."""
    directory = paths.gomodcache / f"{MODULE}@{VERSION}"
    if not (directory / "charts" / "kueue" / "Chart.yaml").is_file():
        run_go(
            ["go", "mod", "download", f"{MODULE}@{VERSION}"],
            cwd=TOOLCHAIN / TOOL.name,
            env=go_env(paths),
            what="kueue-module",
            logs=paths.cache / "logs",
        )
    return directory


def chart_dir(paths: ClusterPaths) -> Path:
    return module_dir(paths) / "charts" / "kueue"


def manager_image(paths: ClusterPaths) -> images.ImageSpec:
    """The manager as Kueue's own image has it (``/manager``, static, CGO_ENABLED=0), alone."""
    return images.ImageSpec(
        reference=f"{IMAGE_REPOSITORY}:{VERSION}-{TOOL.digest()}",
        files={"manager": build(paths) / MANAGER},
        symlinks={},
        entrypoint=["/manager"],
        cmd=[],
    )


def import_image(cluster: Cluster) -> str:
    """The manager image, written once per build and imported into containerd unless there."""
    spec = manager_image(cluster.paths)
    ctr, socket = cluster.bin_dir / "ctr", cluster.paths.containerd_socket
    if not images.image_present(ctr, socket, spec.reference):
        archive = cluster.paths.images_dir / f"kueue-{spec.reference.rsplit(':', 1)[1]}.tar"
        if not archive.is_file():
            images.write_oci_archive(spec, archive)
        images.import_images(ctr, socket, [archive])
    return spec.reference


def configuration() -> Obj:
    """Kueue's Configuration: the chart's defaults, batch/v1 Jobs as the one integration, and
    the catalog's device class mappings."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": ":8081"},
        "metrics": {"bindAddress": ":8443"},
        "webhook": {"port": 9443},
        "leaderElection": {"leaderElect": True, "resourceName": "c1f6bfd2.kueue.x-k8s.io"},
        "integrations": {"frameworks": ["batch/job"]},
        "resources": {
            "deviceClassMappings": [
                {"name": name, "deviceClassNames": list(classes)}
                for name, classes in DEVICE_CLASS_MAPPINGS
            ]
        },
    }


def chart_values(image: str) -> Obj:
    """The chart's values: the local image, the feature gate, the Configuration, and a
    non-root user id (the image has no ``USER``; the chart asks for ``runAsNonRoot``).
    ``replicas: 0`` until `Kueue.install` has given the manager the apiserver's address."""
    repository, tag = image.rsplit(":", 1)
    return {
        "controllerManager": {
            "replicas": 0,
            "featureGates": [{"name": n, "enabled": on} for n, on in FEATURE_GATES.items()],
            "manager": {
                "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
                "resources": {
                    "requests": {"cpu": "100m", "memory": "128Mi"},
                    "limits": {"cpu": "1", "memory": "512Mi"},
                },
                "podSecurityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 65532,
                    "runAsGroup": 65532,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            },
        },
        "managerConfig": {
            "controllerManagerConfigYaml": yaml.safe_dump(configuration(), sort_keys=False)
        },
    }


APISERVER_ENV: Final = [
    {"name": "KUBERNETES_SERVICE_HOST", "value": versions.NODE_IP},
    {"name": "KUBERNETES_SERVICE_PORT", "value": str(versions.APISERVER_PORT)},
]


class Kueue:
    """Kueue's chart release on the e2e cluster (`install`, `uninstall`)."""

    def __init__(self, cluster: Cluster, kube: Kube, helm: Path) -> None:
        self.cluster = cluster
        self.kube = kube
        self.helm = helm

    def run_helm(self, *args: str) -> str:
        done = subprocess.run(
            [str(self.helm), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)}: {done.stderr}")
        return done.stdout

    def install(self, values_file: Path) -> None:
        """``helm install`` the chart, give the manager the apiserver's node address and one
        replica, restart its pod once the certificate is made (see below), and wait until its
        webhooks answer (a ResourceFlavor is created through them)."""
        values_file.write_text(yaml.safe_dump(chart_values(import_image(self.cluster))))
        self.run_helm(
            "install", RELEASE, str(chart_dir(self.cluster.paths)), f"--namespace={NAMESPACE}",
            "--create-namespace", f"--values={values_file}",
        )  # fmt: skip
        patch = {
            "spec": {
                "replicas": 1,
                "template": {"spec": {"containers": [{"name": "manager", "env": APISERVER_ENV}]}},
            }
        }
        self.cluster.kubectl(
            "patch", "deployment", f"{RELEASE}-controller-manager", f"--namespace={NAMESPACE}",
            "--type=strategic", f"--patch={json.dumps(patch)}",
        )  # fmt: skip
        try:
            wait_for("Kueue's webhook certificate", self._certificate_made, 120, 1)
            if not self.manager_ready():
                # The kubelet refreshes a mounted Secret only every minute or so, and the manager
                # is not ready before it sees its certificate; a new pod mounts it at once.
                for pod in self.manager_pods():
                    self.kube.delete("v1", "Pod", pod["metadata"]["name"], NAMESPACE)
            wait_for("Kueue's manager to be ready", self.manager_ready, 180, 2)
            wait_for("Kueue's webhooks to answer", self._flavor_created, 120, 2)
        except TimeoutError as error:
            raise AssertionError(f"{error}; manager log:\n{self.manager_log()}") from error

    def manager_pods(self) -> list[Obj]:
        return self.kube.list("v1", "Pod", namespace=NAMESPACE, label_selector=MANAGER_SELECTOR)

    def manager_ready(self) -> bool:
        pods = [p for p in self.manager_pods() if "deletionTimestamp" not in p["metadata"]]
        return len(pods) == 1 and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pods[0].get("status", {}).get("conditions", [])
        )

    def manager_log(self, tail: int = 40) -> str:
        return "".join(
            self.cluster.kubectl(
                "logs", f"--namespace={NAMESPACE}", p["metadata"]["name"], f"--tail={tail}",
                check=False,
            )
            for p in self.manager_pods()
        )  # fmt: skip

    def _certificate_made(self) -> bool:
        """Whether the manager's certificate management filled the webhook's Secret."""
        secret = self.kube.get("v1", "Secret", CERT_SECRET, NAMESPACE)
        return bool((secret.get("data") or {}).get("tls.crt"))

    def _flavor_created(self) -> bool:
        try:
            if self.kube.exists(KUEUE_API, "ResourceFlavor", FLAVOR, None):
                return True
            self.kube.create(resource_flavor())
        except ResourceNotFoundError:  # the CRD is not served yet
            return False
        except Exception as error:
            # The webhook does not answer yet (no ready endpoint, no certificate): try again.
            if "failed calling webhook" in str(error) or "no endpoints" in str(error):
                return False
            raise
        return True

    def uninstall(self) -> None:
        """Delete what the test made cluster-wide, then the release and its namespace (the
        chart keeps its CRDs, as Helm does; they are deleted too, so no Kueue object stays)."""
        for kind in ("ClusterQueue", "ResourceFlavor", "WorkloadPriorityClass", "Cohort"):
            # Kueue removes its finalizers (resource-in-use) once nothing uses the object.
            for item in self.kube.list(KUEUE_API, kind):
                self.kube.delete(KUEUE_API, kind, item["metadata"]["name"])
            for item in self.kube.list(KUEUE_API, kind):
                self.kube.wait_gone(KUEUE_API, kind, item["metadata"]["name"], None, timeout=60)
        self.run_helm("uninstall", RELEASE, f"--namespace={NAMESPACE}", "--wait")
        self.kube.delete("v1", "Namespace", NAMESPACE)
        self.kube.wait_gone("v1", "Namespace", NAMESPACE, None, timeout=180)


# ---- the objects the test creates ---------------------------------------------------------------


def resource_flavor(name: str = FLAVOR) -> Obj:
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": name}}


def cluster_queue(
    name: str,
    namespace: str,
    quotas: dict[str, int],
    *,
    cohort: str,
    borrowing_limit: int | None = None,
) -> Obj:
    """ClusterQueue `name` for the jobs of `namespace`: `quotas` (logical resource -> devices)
    in the one flavor, in `cohort`; `borrowing_limit` per resource (None: unlimited). Preemption:
    lower-priority workloads of its own queue, and of the cohort when reclaiming quota it lent."""
    limit = {} if borrowing_limit is None else {"borrowingLimit": str(borrowing_limit)}
    return {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "cohortName": cohort,
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "queueingStrategy": "BestEffortFIFO",
            "preemption": {
                "withinClusterQueue": "LowerPriority",
                "reclaimWithinCohort": "LowerPriority",
            },
            "resourceGroups": [
                {
                    "coveredResources": list(quotas),
                    "flavors": [
                        {
                            "name": FLAVOR,
                            "resources": [
                                {"name": resource, "nominalQuota": str(amount), **limit}
                                for resource, amount in quotas.items()
                            ],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(name: str, namespace: str, cluster_queue_name: str) -> Obj:
    return {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue_name},
    }


def priority_class(name: str, value: int) -> Obj:
    return {
        "apiVersion": KUEUE_API,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
        "description": f"e2e: {name}",
    }


def job(
    name: str,
    namespace: str,
    queue: str,
    templates: Sequence[str],
    *,
    priority: str | None = None,
    command: str = "",
) -> Obj:
    """A batch/v1 Job of one pod for `queue`, whose container uses one claim made from each of
    `templates` (ResourceClaimTemplates, the only claims Kueue counts). Created as users write
    it: Kueue's webhook suspends it (the queue label), Kueue unsuspends it on admission."""
    labels = {QUEUE_LABEL: queue, **({PRIORITY_LABEL: priority} if priority else {})}
    claims = [{"name": f"c{i}", "resourceClaimTemplateName": t} for i, t in enumerate(templates)]
    container = m.container(claims=[{"name": c["name"]} for c in claims])
    if command:
        container["command"] = ["sh", "-c", command]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 2,
                    "containers": [container],
                    "resourceClaims": claims,
                }
            },
        },
    }


def delete_job(kube: Kube, name: str, namespace: str) -> None:
    """Delete Job `name` with its pods (the API's default for Jobs orphans them)."""
    resource = kube.client.resources.get(api_version="batch/v1", kind="Job")
    with contextlib.suppress(NotFoundError):
        resource.delete(name=name, namespace=namespace, body={"propagationPolicy": "Background"})


def workload_of(kube: Kube, job_name: str, namespace: str) -> Obj | None:
    """The Workload Kueue made for Job `job_name` (owned by it), or None yet."""
    owned = [
        w
        for w in kube.list(KUEUE_API, "Workload", namespace=namespace)
        if any(
            o.get("kind") == "Job" and o.get("name") == job_name
            for o in w["metadata"].get("ownerReferences", [])
        )
    ]
    return owned[0] if owned else None


def condition(workload: Obj | None, kind: str) -> Obj:
    for item in (workload or {}).get("status", {}).get("conditions", []):
        if item["type"] == kind:
            return dict(item)
    return {}


def admitted(workload: Obj | None) -> bool:
    return condition(workload, "Admitted").get("status") == "True"


@contextmanager
def created(kube: Kube, objects: Sequence[Obj]) -> Iterator[None]:
    """`objects` (cluster-scoped Kueue objects) for the block, deleted afterwards."""
    for item in objects:
        kube.create(item)
    try:
        yield
    finally:
        for item in reversed(objects):
            kube.delete(item["apiVersion"], item["kind"], item["metadata"]["name"])
