"""MPS daemons as the e2e tests see them on the node: the nvidia-cuda-mps-control TEST DOUBLE's
processes under the plugin's data dir, their pid files, the daemon pods, and what an MPS client
container printed (`manifests.SHOW_MPS`)."""

from __future__ import annotations

import re
from pathlib import Path

from e2e.driver import Driver
from e2e.kube import Kube, wait_for
from tests.doubles.mps_helpers import daemon_processes_under, processes_under
from tests.doubles.nvidia_cuda_mps_control import PID_FILE

DAEMON_ID_LABEL = "mps.gpu-dra.io/daemon-id"
"""The daemon pods' label naming their daemon id."""
PIPE = "/tmp/nvidia-mps"
"""Where a client container finds its daemon's pipe directory (``CUDA_MPS_PIPE_DIRECTORY``)."""
MPS_CONFIG = {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}
"""The ``mpsConfig`` of the per-claim MPS tests: half the threads, 10Gi pinned memory."""
_SECTION = re.compile(r"^--- (\w+)\n(.*?)(?=^--- )", re.M | re.S)


def daemons(driver: Driver) -> list[int]:
    """PIDs of the double's processes serving a pipe dir under the plugin's data dir, control
    clients in flight included."""
    return processes_under(driver.data_dir / "mps")


def daemon_processes(driver: Driver) -> list[int]:
    """`daemons` but the control clients in flight: the daemon and server processes, as the
    plugin's supervision may send a daemon a command at any time."""
    return daemon_processes_under(driver.data_dir / "mps")


def daemon_ids(driver: Driver) -> dict[int, str]:
    """The daemon id of each daemon or server process under the plugin's data dir: the
    directory its ``CUDA_MPS_PIPE_DIRECTORY`` (``<data dir>/mps/<id>/pipe``) names. Control
    clients (one command the plugin sends, e.g. a warm daemon's settings while it starts) are no
    daemon processes and left out (`daemon_processes_under`)."""
    prefix = f"CUDA_MPS_PIPE_DIRECTORY={driver.data_dir / 'mps'}/".encode()
    found = {}
    for pid in daemon_processes_under(driver.data_dir / "mps"):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        for value in environ:
            if value.startswith(prefix):
                found[pid] = value.removeprefix(prefix).decode().split("/")[0]
    return found


def daemon_pid(driver: Driver, daemon_id: str) -> int:
    """The PID the daemon wrote into its pipe directory."""
    return int((driver.mps_dir / daemon_id / "pipe" / PID_FILE).read_text())


def mps_output(kube: Kube, pod: str, namespace: str) -> dict[str, str]:
    """The SHOW_MPS sections the pod's container printed (env, ls, pid, ...); waits for them."""
    sections: dict[str, str] = {}

    def printed() -> bool:
        log = kube.pod_log(pod, namespace)
        sections.update({k: v.strip() for k, v in _SECTION.findall(log)})
        return "--- end" in log

    wait_for(f"MPS lines in {pod}'s log", printed, 30)
    return sections


def assert_unprepared_without_daemon(driver: Driver, uid: str, daemon_id: str) -> None:
    """Wait until the claim is unprepared; then its daemon is gone: no daemon pod or process,
    no ``mps/<id>/`` directory (pipe, log, shm), no CDI spec of the claim."""
    driver.wait_unprepared(uid)
    assert driver.mps_daemon_pods() == {}
    assert daemons(driver) == []
    assert not (driver.mps_dir / daemon_id).exists()
    assert uid not in driver.cdi_spec_claims()
