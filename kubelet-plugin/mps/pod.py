"""The control daemon as a pod on this node: `PodRunner`, the production `DaemonRunner`.

One bare Pod per daemon (``mps-control-daemon-<id>``), bound to the node through the API with
``restartPolicy: Never`` (a daemon that died stays dead until the claim is unprepared), running
``<binary> -f [-M]`` with ``hostPID`` and ``privileged``, the daemon's directory and shm mounted,
and labelled so a restarted plugin finds its node's daemons (`daemon_ids`). No ownerReference:
the daemon outlives the plugin's pod. Deletes carry the pod's UID (`LaunchedDaemon.ref`) as a
precondition, so a stale handle never deletes a newer pod of the same name.
See docs/mps.md#the-daemon-as-a-pod.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from gpu_dra.driver.naming import InvalidNameError
from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.kubeapi import Pod, PodApi
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths, MpsStartError, MpsStopError
from gpu_dra.kubelet_plugin.mps.ids import checked_daemon_id
from gpu_dra.kubelet_plugin.mps.process import LaunchedDaemon, wait_for_daemon_pid

log = logging.getLogger(__name__)

RESOURCE_REQUESTS: Final = {"cpu": "10m", "memory": "64Mi"}
"""Requests only, no limits: the pod is Burstable rather than BestEffort (first to go under
memory pressure), and no limit can OOM-kill the daemon or its MPS server."""

POD_PREFIX: Final = "mps-control-daemon-"
CONTAINER: Final = "mps-control-daemon"
DRIVER_ROOT_MOUNT: Final = "/driver-root"
DEFAULT_BINARY: Final = "nvidia-cuda-mps-control"
MANAGED_BY: Final = ("app.kubernetes.io/managed-by", "gpu-dra-kubelet-plugin")
COMPONENT: Final = ("app.kubernetes.io/component", "mps-control-daemon")
DAEMON_ID_LABEL: Final = "mps.gpu-dra.io/daemon-id"
SELECTOR: Final = f"{MANAGED_BY[0]}={MANAGED_BY[1]},{COMPONENT[0]}={COMPONENT[1]}"
PATH: Final = (
    f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{DRIVER_ROOT_MOUNT}/usr/bin"
)
LD_LIBRARY_PATH: Final = ":".join(
    f"{DRIVER_ROOT_MOUNT}/{d}"
    for d in ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu")
)
FAILED_WAITING: Final = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
"""Container waiting reasons that end a start at once (the kubelet would only retry them)."""
_CHECK_INTERVAL_S: Final = 0.5


def pod_name(daemon_id: str) -> str:
    return POD_PREFIX + checked_daemon_id(daemon_id)


def _uid(pod: Pod) -> str:
    return str(pod.get("metadata", {}).get("uid", ""))


def pod_problem(pod: Pod) -> str | None:
    """Why ``pod`` does not run its daemon (ended, being deleted, container cannot start), or
    None while it runs or is still starting."""
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    name = f"{metadata.get('namespace')}/{metadata.get('name')}"
    if metadata.get("deletionTimestamp"):
        return f"daemon pod {name} is being deleted"
    phase = status.get("phase", "Pending")
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting, terminated = state.get("waiting") or {}, state.get("terminated") or {}
        if waiting.get("reason") in FAILED_WAITING:
            return (
                f"daemon pod {name}: container {waiting['reason']}: "
                f"{waiting.get('message', '')}".rstrip(": ")
            )
        if terminated:
            return (
                f"daemon pod {name} ended ({phase}): container exited with "
                f"{terminated.get('exitCode')} {terminated.get('reason', '')} "
                f"{terminated.get('message', '')}".rstrip()
            )
    if phase in ("Succeeded", "Failed"):
        return f"daemon pod {name} ended ({phase}): {status.get('message', '')}".rstrip(": ")
    return None


class PodRunner:
    """`DaemonRunner` that runs each daemon as a pod bound to this node (see the module doc).
    Without an ``image`` it only checks and removes existing daemon pods (a plugin switched to
    the process runner)."""

    name = "pod"

    def __init__(
        self,
        api: PodApi,
        *,
        namespace: str,
        node_name: str,
        image: str,
        binary: str = DEFAULT_BINARY,
        driver_root: Path = Path("/"),
        image_pull_policy: str = "IfNotPresent",
        grace_period_s: int = 10,
        priority_class: str = "",
        image_pull_secrets: Sequence[str] = (),
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.node_name = node_name
        self.image = image
        self.binary = binary
        self.driver_root = driver_root
        self.image_pull_policy = image_pull_policy
        self.grace_period_s = grace_period_s
        self.priority_class = priority_class
        self.image_pull_secrets = tuple(image_pull_secrets)

    # -- DaemonRunner ----------------------------------------------------------------------

    def launch(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        paths: DaemonPaths,
        timeout_s: float,
    ) -> LaunchedDaemon:
        deadline = time.monotonic() + timeout_s
        daemon_id = paths.root.name
        name = pod_name(daemon_id)
        if not self.image:
            raise MpsStartError(
                "no image for MPS daemon pods (--mps-daemon-image): this runner only checks and "
                "removes the daemon pods of an earlier configuration"
            )
        try:
            created = self.api.create_pod(self.namespace, self.manifest(command, env, paths))
        except errors.ApiError as error:
            raise MpsStartError(
                f"cannot create daemon pod {self.namespace}/{name}: {error}"
            ) from error
        uid = _uid(created)
        log.info("mps daemon pod created pod=%s/%s uid=%s", self.namespace, name, uid)
        try:
            identity = wait_for_daemon_pid(paths, deadline, timeout_s, self._failure(name, uid))
        except BaseException:
            try:
                self.remove(daemon_id, uid, self.grace_period_s + 20.0)
            except MpsStopError as error:
                log.error("mps daemon pod of a failed start not removed: %s", error)
            raise
        return LaunchedDaemon(identity, uid)

    def missing(self, daemon_id: str, ref: str) -> str | None:
        name = pod_name(daemon_id)
        try:
            pod = self.api.get_pod(self.namespace, name)
        except errors.ApiError as error:
            log.warning("mps daemon pod %s/%s not checked: %s", self.namespace, name, error)
            return None  # unknown: the process checks decide
        if pod is None:
            return f"daemon pod {self.namespace}/{name} is gone"
        if ref and _uid(pod) != ref:
            return f"daemon pod {self.namespace}/{name} was replaced (uid {_uid(pod)}, not {ref})"
        problem = pod_problem(pod)
        if problem is not None:
            return problem
        phase = pod.get("status", {}).get("phase", "Pending")
        return None if phase == "Running" else f"daemon pod {self.namespace}/{name} is {phase}"

    def remove(self, daemon_id: str, ref: str | None, timeout_s: float) -> None:
        name = pod_name(daemon_id)
        try:
            pod = self.api.get_pod(self.namespace, name)
            if pod is None:
                return
            uid = _uid(pod)
            if ref is not None and uid != ref:
                log.info("mps daemon pod %s/%s is another daemon's (uid %s), kept",
                         self.namespace, name, uid)  # fmt: skip
                return
            try:
                self.api.delete_pod(
                    self.namespace, name, uid=uid, grace_period_s=self.grace_period_s
                )
            except errors.ConflictError:
                return  # replaced meanwhile: not ours
            deadline = time.monotonic() + timeout_s
            delay = 0.05
            while True:
                pod = self.api.get_pod(self.namespace, name)
                if pod is None or _uid(pod) != uid:
                    log.info("mps daemon pod deleted pod=%s/%s uid=%s", self.namespace, name, uid)
                    return
                if time.monotonic() >= deadline:
                    raise MpsStopError(
                        f"daemon pod {self.namespace}/{name} (uid {uid}) is still there "
                        f"{timeout_s:g}s after its deletion"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        except errors.ApiError as error:
            raise MpsStopError(
                f"cannot delete daemon pod {self.namespace}/{name}: {error}"
            ) from error

    def daemon_ids(self) -> list[str]:
        try:
            pods = self.api.list_pods(
                self.namespace, SELECTOR, field_selector=f"spec.nodeName={self.node_name}"
            )
        except errors.ApiError as error:
            log.warning("mps daemon pods of node %s not listed: %s", self.node_name, error)
            return []
        ids: set[str] = set()
        for pod in pods:
            label = pod.get("metadata", {}).get("labels", {}).get(DAEMON_ID_LABEL, "")
            try:
                ids.add(checked_daemon_id(label))
            except InvalidNameError:
                continue
        return sorted(ids)

    # -- the pod ---------------------------------------------------------------------------

    def manifest(
        self, command: Sequence[str], env: Mapping[str, str], paths: DaemonPaths
    ) -> dict[str, Any]:
        """The daemon's Pod: ``command`` is the manager's ``[binary, "-d", flags...]``; the pod
        runs the image's ``binary`` in the foreground with the same flags. Of ``env`` only the
        ``CUDA_*`` variables are passed (the plugin's own environment stays with it)."""
        daemon_id = paths.root.name
        flags = [arg for arg in command[1:] if arg != "-d"]
        variables = {k: v for k, v in env.items() if k.startswith("CUDA_")}
        variables.update(PATH=PATH, LD_LIBRARY_PATH=LD_LIBRARY_PATH)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(daemon_id),
                "namespace": self.namespace,
                "labels": {
                    MANAGED_BY[0]: MANAGED_BY[1],
                    COMPONENT[0]: COMPONENT[1],
                    DAEMON_ID_LABEL: daemon_id,
                },
            },
            "spec": {
                "nodeName": self.node_name,
                "restartPolicy": "Never",
                "hostPID": True,
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "terminationGracePeriodSeconds": self.grace_period_s,
                "tolerations": [{"operator": "Exists"}],
                **({"priorityClassName": self.priority_class} if self.priority_class else {}),
                **(
                    {"imagePullSecrets": [{"name": name} for name in self.image_pull_secrets]}
                    if self.image_pull_secrets
                    else {}
                ),
                "containers": [
                    {
                        "name": CONTAINER,
                        "image": self.image,
                        "imagePullPolicy": self.image_pull_policy,
                        "command": [self.binary, "-f", *flags],
                        "env": [{"name": k, "value": v} for k, v in sorted(variables.items())],
                        "securityContext": {"privileged": True},
                        "resources": {"requests": dict(RESOURCE_REQUESTS)},
                        "volumeMounts": [
                            {"name": "mps", "mountPath": str(paths.root)},
                            {"name": "shm", "mountPath": "/dev/shm"},
                            {
                                "name": "driver-root",
                                "mountPath": DRIVER_ROOT_MOUNT,
                                "readOnly": True,
                            },
                        ],
                    }
                ],
                "volumes": [
                    {"name": "mps", "hostPath": {"path": str(paths.root), "type": "Directory"}},
                    {"name": "shm", "hostPath": {"path": str(paths.shm), "type": "Directory"}},
                    {
                        "name": "driver-root",
                        "hostPath": {"path": str(self.driver_root), "type": "Directory"},
                    },
                ],
            },
        }

    def _failure(self, name: str, uid: str) -> Callable[[], str | None]:
        """For `wait_for_daemon_pid`: why the pod cannot start, asked at most every 0.5 s."""
        last = time.monotonic()

        def check() -> str | None:
            nonlocal last
            if time.monotonic() - last < _CHECK_INTERVAL_S:
                return None
            last = time.monotonic()
            try:
                pod = self.api.get_pod(self.namespace, name)
            except errors.ApiError as error:
                log.warning("mps daemon pod %s/%s not checked: %s", self.namespace, name, error)
                return None
            if pod is None or _uid(pod) != uid:
                return f"daemon pod {self.namespace}/{name} was deleted during start-up"
            return pod_problem(pod)

        return check
