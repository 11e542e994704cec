"""MPS shares a platform team can trust (issue 16, item 2), end to end: a hostile tenant's
``set_default_*``, ``quit`` and file tampering do not change another tenant's caps or break its
mounts.

A simulated hgx-h100 node whose gpu-0 is offered as MPS shares with the largest share at 50 %
(``--mps-share-max-percent=50``: the shared daemon's defaults are 50 % and 40779M) and daemon
supervision every second. Two shares in two namespaces; both containers run the image of the
nvidia-cuda-mps-control TEST DOUBLE (`Driver.mps_daemon_image`: its Python and its control
client, as a CUDA image carries NVIDIA's client), so they reach the daemon through the pipe
directory their CDI spec mounted:

* tenant A tries to remove, rename, create and rewrite files in ``/tmp/nvidia-mps`` (the
  mount is read-only: ``EROFS``; the mount point itself ``EBUSY``), raises the daemon's
  default thread percentage to 100, waits until the plugin set it back, then ``quit``s the
  daemon and waits for the restarted one;
* tenant B prints what it sees through its mount whenever it changes: the pid file, the files,
  the defaults the daemon answers.

With the health monitor on, a daemon whose pod is deleted is restarted in place by the
supervision and reported to the health monitor while it is down: the share device is tainted
(``mps-daemon``) until the restart is done, then not.
"""

from __future__ import annotations

import errno
import re
import textwrap
from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import PLUGIN, Driver
from e2e.health import HEALTH_ARGS, MPS_DAEMON_KEY, taint_keys, wait_resource_health
from e2e.kube import Kube, wait_for
from e2e.mps import daemon_ids, daemon_pid, daemons
from e2e.workloads import delete_pods, wait_running
from gpu_dra.kubelet_plugin.mps import shared_daemon_id
from gpu_dra.kubelet_plugin.mps.events import REASON_RESTARTED, REASON_RESTORED
from tests.doubles.nvidia_cuda_mps_control import PID_FILE, SOCKET, read_state

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = (
    "--mps-shares=0",
    "--mps-share-daemon-warm=off",  # the last share stops its daemon (checked below)
    "--mps-share-max-percent=50",
    "--mps-daemon-check-interval=1",
    *HEALTH_ARGS,
)
DEFAULTS_MIB = 81559 // 2  # 50 % of the simulated H100 80GB's 81559Mi

_PRELUDE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
PIPE = "/tmp/nvidia-mps"
def say(*words):
    print(*words, flush=True)
def ctl(command):
    done = subprocess.run(["/usr/bin/nvidia-cuda-mps-control"], input=command + "\\n",
                          capture_output=True, text=True)
    text = (done.stdout.strip() or done.stderr.strip()).replace("\\n", " ")
    return done.returncode, text
def pid():
    try:
        with open(PIPE + "/nvidia-cuda-mps-control.pid") as handle:
            return handle.read().strip()
    except OSError:
        return ""
"""

ATTACKER = _PRELUDE + textwrap.dedent(
    """
    def attempt(name, action):
        try:
            action()
            say("tamper", name, "ok")
        except OSError as error:
            say("tamper", name, error.errno)
    say("--- start", pid())
    attempt("remove", lambda: os.unlink(PIPE + "/control"))
    attempt("rename", lambda: os.rename(PIPE + "/control", PIPE + "/moved"))
    attempt("create", lambda: open(PIPE + "/evil", "w").close())
    attempt("pidfile", lambda: open(PIPE + "/nvidia-cuda-mps-control.pid", "w").write("1\\n"))
    attempt("rmdir", lambda: os.rmdir(PIPE))
    say("set", *ctl("set_default_active_thread_percentage 100"))
    while ctl("get_default_active_thread_percentage") != (0, "50.0"):
        time.sleep(0.2)
    say("--- restored")
    # The plugin restores the pinned memory limit after the percentage: let it finish (and tell
    # the claims) before the next attack, or the quit lands in the middle of its repair.
    time.sleep(5)
    old = pid()
    say("quit", *ctl("quit"))
    while pid() in ("", old) or ctl("get_default_active_thread_percentage") != (0, "50.0"):
        time.sleep(0.2)
    say("--- restarted", pid())
    while True:
        time.sleep(3600)
    """
)

OBSERVER = _PRELUDE + textwrap.dedent(
    """
    caps = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("CUDA_MPS_"))
    say("env", *caps)
    uuid = os.environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split("=")[0]
    seen = None
    while True:
        try:
            files = ",".join(sorted(os.listdir(PIPE)))
        except OSError as error:
            files = f"error-{error.errno}"
        view = (f"view pid={pid()} files={files} "
                f"threads={ctl('get_default_active_thread_percentage')[1]} "
                f"limit={ctl('get_default_device_pinned_mem_limit ' + uuid)[1]}")
        if view != seen:
            say(view)
            seen = view
        time.sleep(0.3)
    """
)


def tenant_pod(name: str, namespace: str, image: str, script: str) -> dict[str, Any]:
    """A pod of claim ``name`` whose container runs ``script`` with the double image's Python."""
    container = {
        "name": "ctr",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["/usr/bin/python3", "-S", "-c", script],
        "resources": {"claims": [{"name": "gpu"}]},
    }
    return m.pod(name, namespace, [container], [{"name": "gpu", "resourceClaimName": name}])


def log_lines(kube: Kube, pod: str, namespace: str, until: str, timeout: float) -> list[str]:
    """The container's log lines once a line starts with ``until``."""
    lines: list[str] = []

    def printed() -> bool:
        lines[:] = kube.pod_log(pod, namespace).splitlines()
        return any(line.startswith(until) for line in lines)

    wait_for(f"{until!r} in {namespace}/{pod}'s log", printed, timeout)
    return lines


def event_messages(kube: Kube, namespace: str, name: str, reason: str) -> list[str]:
    return [e["message"] for e in kube.events_for(namespace, name) if e["reason"] == reason]


def test_a_tenants_tampering_changes_neither_another_tenants_caps_nor_its_mounts(
    driver: Driver, kube: Kube, namespace: str, other_namespace: str
) -> None:
    uuid = driver.uuid_of("gpu-0")
    image = driver.mps_daemon_image
    kube.create(m.share_claim("victim", other_namespace, "20Gi", 20))
    kube.create(tenant_pod("victim", other_namespace, image, OBSERVER))
    wait_running(kube, "victim", other_namespace)
    daemon_id = shared_daemon_id(uuid)
    root = driver.mps_dir / daemon_id
    first_pid = daemon_pid(driver, daemon_id)
    [first_pod] = driver.mps_daemon_pods().values()
    directories = {d: (root / d).stat().st_ino for d in ("pipe", "shm")}
    limit = f"{DEFAULTS_MIB}M"
    victim_view = f"view pid={first_pid} files="
    lines = log_lines(kube, "victim", other_namespace, victim_view, 30)
    assert lines[0] == (
        "env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 "
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=20480M CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"
    )
    assert any(line.endswith(f"threads=50.0 limit={limit}") for line in lines), lines

    kube.create(m.share_claim("attacker", namespace, "10Gi", 10))
    kube.create(tenant_pod("attacker", namespace, image, ATTACKER))
    wait_running(kube, "attacker", namespace)

    # File tampering through the read-only pipe mount fails; the control socket still answers.
    attacker = log_lines(kube, "attacker", namespace, "--- restored", 60)
    tampering = dict(line.split()[1:3] for line in attacker if line.startswith("tamper "))
    assert tampering == {
        "remove": str(errno.EROFS),
        "rename": str(errno.EROFS),
        "create": str(errno.EROFS),
        "pidfile": str(errno.EROFS),
        "rmdir": str(errno.EBUSY),
    }, attacker
    # MPS accepts the command (a read-only mount does not stop connect()): it is undone, not
    # prevented.
    assert any(line.startswith("set 0") for line in attacker), attacker
    # ... and the plugin set the default back and told both shares' claims.
    for ns, claim in ((namespace, "attacker"), (other_namespace, "victim")):
        wait_for(
            f"{REASON_RESTORED} on {ns}/{claim}",
            lambda ns=ns, claim=claim: bool(event_messages(kube, ns, claim, REASON_RESTORED)),
            30,
        )
        [message, *_] = event_messages(kube, ns, claim, REASON_RESTORED)
        assert "active thread percentage 100, not 50" in message
    assert read_state(root / "pipe")["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {uuid: limit},
    }

    # The attacker quits the daemon: it is restarted in place, both pods are told.
    attacker = log_lines(kube, "attacker", namespace, "--- restarted", 60)
    assert any(line.startswith("quit 0") for line in attacker), attacker
    new_pid = int(next(line for line in attacker if line.startswith("--- restarted")).split()[2])
    assert new_pid != first_pid
    # One daemon process. Others come and go beside it (supervision's control command, every
    # 1 s here; a server for a client that connects), so wait for them to be gone.
    wait_for(
        f"daemon {new_pid} alone",
        lambda: list(daemon_ids(driver)) == [new_pid],
        15,
    )
    [new_pod] = driver.mps_daemon_pods().values()
    assert new_pod["metadata"]["name"] == first_pod["metadata"]["name"]
    assert new_pod["metadata"]["uid"] != first_pod["metadata"]["uid"]
    for ns, pod in ((namespace, "attacker"), (other_namespace, "victim")):
        wait_for(
            f"{REASON_RESTARTED} on {ns}/{pod}",
            lambda ns=ns, pod=pod: bool(event_messages(kube, ns, pod, REASON_RESTARTED)),
            30,
        )
    # The victim's mount shows the new daemon in the same directory, with the same caps.
    restarted = re.compile(rf"view pid={new_pid} files=(\S+) threads=50\.0 limit={limit}$")
    victim: list[str] = []

    def victim_sees_the_restarted_daemon() -> bool:
        victim[:] = kube.pod_log("victim", other_namespace).splitlines()
        return bool(victim) and restarted.fullmatch(victim[-1]) is not None

    wait_for("the victim to see the restarted daemon", victim_sees_the_restarted_daemon, 30)
    files = restarted.fullmatch(victim[-1])
    assert files is not None
    assert {SOCKET, PID_FILE} <= set(files[1].split(",")), victim[-1]
    assert victim[0] == lines[0]  # its caps: the same environment
    assert {d: (root / d).stat().st_ino for d in ("pipe", "shm")} == directories
    assert read_state(root / "pipe")["defaults"] == {
        "activeThreadPercentage": 50.0,
        "pinnedMemLimits": {uuid: limit},
    }
    for ns, claim in ((namespace, "attacker"), (other_namespace, "victim")):
        uid = kube.get("resource.k8s.io/v1", "ResourceClaim", claim, ns)["metadata"]["uid"]
        assert driver.checkpoint_entry(uid)["phase"] == "PrepareCompleted"

    # The last share stops the daemon and removes its directories.
    delete_pods(kube, namespace, ["attacker"])
    delete_pods(kube, other_namespace, ["victim"])
    wait_for("both shares to be unprepared", lambda: not driver.checkpoint_claims(), 60)
    wait_for("the daemon to stop", lambda: not daemons(driver), 30)
    assert driver.mps_daemon_pods() == {}
    assert not root.exists()


def test_a_dead_share_daemon_is_restarted_in_place_and_its_taint_goes_with_it(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    uuid = driver.uuid_of("gpu-0")
    daemon_id = shared_daemon_id(uuid)
    kube.create(m.share_claim("share", namespace, "10Gi", 10))
    kube.create(m.gpu_pod("share", namespace, claim="share", command=m.SHOW_MPS))
    wait_running(kube, "share", namespace)
    [first] = driver.mps_daemon_pods().values()
    log = driver.cluster.paths.logs / f"{PLUGIN}.log"
    offset = log.stat().st_size

    kube.delete("v1", "Pod", first["metadata"]["name"], first["metadata"]["namespace"])

    def restarted() -> bool:
        pods = list(driver.mps_daemon_pods().values())
        return len(pods) == 1 and pods[0]["metadata"]["uid"] != first["metadata"]["uid"]

    wait_for("the daemon pod to be started again", restarted, 60)
    wait_for(
        f"{REASON_RESTARTED} on {namespace}/share",
        lambda: bool(event_messages(kube, namespace, "share", REASON_RESTARTED)),
        30,
    )

    def plugin_log() -> str:
        with log.open("rb") as text:
            text.seek(offset)
            return text.read().decode(errors="replace")

    # The health monitor was told while the daemon was down, and again once it ran.
    down = f"health: MPS daemon of GPU {uuid} not running: {daemon_id}"
    back = f"health: MPS daemon of GPU {uuid} is no longer judged dead"
    wait_for("the health monitor to see the daemon back", lambda: back in plugin_log(), 30)
    text = plugin_log()
    assert down in text
    assert text.index(down) < text.index(back)
    wait_for("the share device to be untainted", lambda: not taint_keys(driver, "gpu-0"), 30)
    assert MPS_DAEMON_KEY not in taint_keys(driver, "gpu-0")
    wait_resource_health(kube, "share", namespace, "Healthy")
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "share", namespace)["metadata"]["uid"]
    assert driver.checkpoint_entry(uid)["phase"] == "PrepareCompleted"
    delete_pods(kube, namespace, ["share"])
    wait_for("the share to be unprepared", lambda: not driver.checkpoint_claims(), 60)
