"""`InMemoryPodApi`: a `PodApi` with a small kubelet inside, for tests of the MPS pod runner.

The API part behaves like the apiserver where the runner can tell: UIDs, AlreadyExists on a taken
name, label and ``spec.nodeName`` selectors, deletes with a UID precondition (409 on a mismatch,
404 is no error), ``deletionTimestamp`` while the pod terminates.

The kubelet part runs each pod's single container as a real host process: ``command[0]`` is
looked up in ``binaries`` (the image's programs; tests map ``nvidia-cuda-mps-control`` to the
test double), the container's ``env`` is its whole environment (plus ``extra_env``), and it
starts in a session of its own. Phases follow the process: ``Running`` once started,
``Succeeded``/``Failed`` with a ``terminated`` state when it exits. A delete sends SIGTERM,
SIGKILL after the grace period, then removes the object, in a thread (as the kubelet does,
asynchronously). An image in ``unpullable`` stays ``Pending`` with ``ErrImagePull``.

Tests control, as "someone else": `kill_container` (the daemon dies), `remove_object` (a pod
deleted behind the plugin's back) and `fail_next` (an injected API error).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpu_dra.kube import errors
from gpu_dra.kubelet_plugin.kubeapi import Pod


class InMemoryPodApi:
    def __init__(
        self,
        binaries: Mapping[str, Path],
        *,
        extra_env: Mapping[str, str] | None = None,
        unpullable: frozenset[str] = frozenset(),
    ) -> None:
        self.binaries = dict(binaries)
        self.extra_env = dict(extra_env or {})
        self.unpullable = unpullable
        self.pods: dict[tuple[str, str], Pod] = {}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.created: list[Pod] = []
        self._failures: list[errors.ApiError] = []
        self._lock = threading.RLock()
        self._threads: list[threading.Thread] = []
        self._versions = itertools.count(1)

    # -- PodApi ------------------------------------------------------------------------------

    def create_pod(self, namespace: str, pod: Pod) -> Pod:
        self._maybe_fail()
        name = pod["metadata"]["name"]
        with self._lock:
            if (namespace, name) in self.pods:
                raise errors.AlreadyExistsError(
                    f'pods "{name}" already exists', status=409, reason="AlreadyExists"
                )
            stored = copy.deepcopy(pod)
            stored["metadata"].update(namespace=namespace, uid=str(uuid.uuid4()))
            stored["status"] = {"phase": "Pending"}
            self.pods[(namespace, name)] = stored
            self.created.append(copy.deepcopy(stored))
            self._run(stored)
            return copy.deepcopy(stored)

    def get_pod(self, namespace: str, name: str) -> Pod | None:
        self._maybe_fail()
        with self._lock:
            pod = self.pods.get((namespace, name))
            return copy.deepcopy(pod) if pod is not None else None

    def list_pods(self, namespace: str, label_selector: str, field_selector: str = "") -> list[Pod]:
        self._maybe_fail()
        labels = dict(term.split("=", 1) for term in label_selector.split(",") if term)
        fields = dict(term.split("=", 1) for term in field_selector.split(",") if term)
        if set(fields) - {"spec.nodeName"}:
            raise errors.InvalidError(f"field selector {field_selector!r} not supported", 400)
        with self._lock:
            return [
                copy.deepcopy(pod)
                for (ns, _), pod in sorted(self.pods.items())
                if ns == namespace
                and all(pod["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
                and all(pod["spec"].get("nodeName") == v for v in fields.values())
            ]

    def delete_pod(
        self, namespace: str, name: str, *, uid: str | None, grace_period_s: int | None = None
    ) -> None:
        self._maybe_fail()
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                return
            if uid is not None and pod["metadata"]["uid"] != uid:
                raise errors.ConflictError(
                    f"Precondition failed: UID in precondition: {uid}, "
                    f"UID in object meta: {pod['metadata']['uid']}",
                    status=409,
                    reason="Conflict",
                )
            if pod["metadata"].get("deletionTimestamp"):
                return
            pod["metadata"]["deletionTimestamp"] = "now"
            grace = grace_period_s
            if grace is None:
                grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        thread = threading.Thread(target=self._terminate, args=(pod, float(grace)), daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- test controls -----------------------------------------------------------------------

    def fail_next(self, error: errors.ApiError) -> None:
        self._failures.append(error)

    def kill_container(self, namespace: str, name: str) -> None:
        """The container's process dies (SIGKILL); the pod ends as Failed."""
        pod = self.pods[(namespace, name)]
        process = self.processes[pod["metadata"]["uid"]]
        os.killpg(process.pid, signal.SIGKILL)
        self._wait_phase(pod, ("Failed", "Succeeded"))

    def remove_object(self, namespace: str, name: str) -> None:
        """The pod object goes at once (force delete); its container is killed."""
        with self._lock:
            pod = self.pods.pop((namespace, name))
        self._kill(pod["metadata"]["uid"])

    def close(self) -> None:
        """Kill every container still running and wait for the kubelet threads."""
        with self._lock:
            uids = list(self.processes)
        for uid in uids:
            self._kill(uid)
        for thread in self._threads:
            thread.join(timeout=15)

    # -- the kubelet -------------------------------------------------------------------------

    def _run(self, pod: Pod) -> None:
        (container,) = pod["spec"]["containers"]
        if container["image"] in self.unpullable:
            pod["status"]["containerStatuses"] = [
                {
                    "name": container["name"],
                    "state": {
                        "waiting": {
                            "reason": "ErrImagePull",
                            "message": f"failed to pull image {container['image']!r}: not found",
                        }
                    },
                }
            ]
            return
        command = list(container["command"])
        program = self.binaries.get(command[0])
        if program is None:
            pod["status"]["phase"] = "Failed"
            pod["status"]["containerStatuses"] = [
                {
                    "name": container["name"],
                    "state": {
                        "terminated": {
                            "exitCode": 128,
                            "reason": "StartError",
                            "message": f'exec: "{command[0]}": executable file not found in $PATH',
                        }
                    },
                }
            ]
            return
        env = {item["name"]: item["value"] for item in container.get("env", [])}
        env.update(self.extra_env)
        process = subprocess.Popen(
            [str(program), *command[1:]],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        uid = pod["metadata"]["uid"]
        self.processes[uid] = process
        pod["status"] = {
            "phase": "Running",
            "containerStatuses": [{"name": container["name"], "state": {"running": {}}}],
        }
        thread = threading.Thread(target=self._reap, args=(pod, process), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _reap(self, pod: Pod, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        with self._lock:
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            pod["status"]["containerStatuses"][0]["state"] = {
                "terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}
            }
            self.processes.pop(pod["metadata"]["uid"], None)

    def _terminate(self, pod: Pod, grace_s: float) -> None:
        uid = pod["metadata"]["uid"]
        process = self.processes.get(uid)
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                self._kill(uid)
        with self._lock:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            if self.pods.get(key) is pod:
                del self.pods[key]

    def _kill(self, uid: str) -> None:
        process = self.processes.get(uid)
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def _wait_phase(self, pod: Pod, phases: tuple[str, ...], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while pod["status"].get("phase") not in phases:
            if time.monotonic() > deadline:
                raise AssertionError(f"pod never reached {phases}: {pod['status']}")
            time.sleep(0.01)

    def _maybe_fail(self) -> None:
        if self._failures:
            raise self._failures.pop(0)


def container_env(pod: Pod) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return {item["name"]: item["value"] for item in container.get("env", [])}
