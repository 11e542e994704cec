"""Warm shared MPS daemons end to end (issue 16 item 6, docs/mps.md "Warm daemons"): with the
default ``--mps-share-daemon-warm=always`` the daemon of a GPU offered as shares runs before its
first share, the first share after a plugin start joins it, a fresh one is started at once after
the last share left, and a plugin killed with SIGKILL leaves it to the restarted one, which
adopts it. The leak check (`no_mps_daemon_left`) allows one process per warm daemon; the control
commands the plugin sends are no daemon processes (`e2e.mps.daemon_ids`).

A simulated hgx-h100 node whose gpu-0 is offered as MPS shares (``--mps-shares=0``); daemons run
as pods of the nvidia-cuda-mps-control TEST DOUBLE's image, as in e2e/test_mps_shares.py."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from e2e import manifests as m
from e2e.driver import PLUGIN, Driver
from e2e.kube import Kube, wait_for
from e2e.mps import daemon_ids, daemons, mps_output
from e2e.workloads import delete_pods, wait_running
from gpu_dra.kubelet_plugin.mps import shared_daemon_id

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_mps_daemon_left")]

SIMULATED_PROFILE = "hgx-h100"
PLUGIN_ARGS = ("--mps-shares=0",)  # warm daemons: the default
FRESH_WITHIN_S = 6.0
"""The fresh warm daemon is started right after the last share left: well within the warmer's
10 s interval (a pass one interval later would take over 10 s plus the start)."""
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


def warm_pod(driver: Driver, daemon_id: str) -> dict[str, Any]:
    """The daemon pod of ``daemon_id``, once it runs (a warm daemon may be starting)."""
    name = f"mps-control-daemon-{daemon_id}"

    def running() -> bool:
        pod = driver.mps_daemon_pods().get(name)
        return pod is not None and pod["status"].get("phase") == "Running"

    wait_for(f"the warm daemon pod {name} to run", running, 60, interval=0.2)
    return driver.mps_daemon_pods()[name]


def recorded_pid(driver: Driver, daemon_id: str) -> int | None:
    """The PID the daemon's ``daemon.json`` records: written once its start finished (settings
    set and read back); None before."""
    try:
        return int(json.loads((driver.mps_dir / daemon_id / "daemon.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def warm_pid(driver: Driver, daemon_id: str) -> int:
    """The one daemon process of ``daemon_id``, once its start finished (``daemon.json`` names
    it): a plugin killed before that leaves a daemon whose settings were never verified, which
    the restarted plugin rightly replaces."""

    def started() -> bool:
        pids = [pid for pid, i in daemon_ids(driver).items() if i == daemon_id]
        return len(pids) == 1 and recorded_pid(driver, daemon_id) == pids[0]

    wait_for(f"one recorded process of daemon {daemon_id}", started, 30, interval=0.2)
    (pid,) = [pid for pid, i in daemon_ids(driver).items() if i == daemon_id]
    return pid


def logged_at(log: str, line: str) -> float:
    """When the first log line containing ``line`` was written (the plugin's local clock)."""
    index = log.index(line)
    start = log.rfind("\n", 0, index) + 1
    match = _STAMP.match(log, start)
    assert match is not None, log[start : index + len(line)]
    return datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def created_at(pod: dict[str, Any]) -> float:
    stamp = pod["metadata"]["creationTimestamp"]
    if isinstance(stamp, datetime):
        return stamp.timestamp()
    return datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def plugin_log(driver: Driver) -> str:
    return (driver.cluster.paths.logs / f"{PLUGIN}.log").read_text(errors="replace")


def test_the_first_share_after_a_plugin_start_finds_its_daemon_running(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    daemon_id = shared_daemon_id(driver.uuid_of("gpu-0"))
    assert driver.warm_daemon_ids() == {daemon_id}  # gpu-0 only: gpu-1 is not offered

    driver.stop_plugin()
    driver.remove_mps_daemons()  # a plugin start on a node without daemons
    offset = len(plugin_log(driver))
    driver.start_plugin()  # registers after the first warm pass

    # Before any claim: the warm daemon runs, recorded by no claim, with the shares' defaults.
    daemon_pod = warm_pod(driver, daemon_id)
    pid = warm_pid(driver, daemon_id)
    assert driver.checkpoint_claims() == set()
    assert (driver.mps_dir / daemon_id / "daemon.json").exists()
    before_prepare = time.time()
    assert created_at(daemon_pod) <= before_prepare

    kube.create(m.share_claim("first", namespace, "10Gi", 10))
    kube.create(m.gpu_pod("first", namespace, claim="first", command=m.SHOW_MPS))
    wait_running(kube, "first", namespace)

    # The share joined that daemon: same pod (UID), same process, started before the prepare.
    uid = kube.get("resource.k8s.io/v1", "ResourceClaim", "first", namespace)["metadata"]["uid"]
    (handle,) = driver.checkpoint_entry(uid)["state"]["mpsDaemons"]
    assert handle["daemonId"] == daemon_id
    assert handle["pid"] == pid
    assert handle["runnerRef"] == daemon_pod["metadata"]["uid"]
    assert mps_output(kube, "first", namespace)["pid"] == str(pid)
    assert (
        driver.mps_daemon_pods()[daemon_pod["metadata"]["name"]]["metadata"]["uid"]
        == (daemon_pod["metadata"]["uid"])
    )
    log = plugin_log(driver)[offset:]
    assert f"mps warm daemon started daemon_id={daemon_id}" in log
    assert f"mps shared daemon warm, joined daemon_id={daemon_id} pid={pid}" in log
    assert "mps shared daemon started" not in log  # no daemon started by the prepare

    # The first share's join had the supervisor check the daemon beside it, so a second share
    # joins without reading its settings back in its prepare.
    kube.create(m.share_claim("second", namespace, "10Gi", 10))
    kube.create(m.gpu_pod("second", namespace, claim="second", command=m.SHOW_MPS))
    wait_running(kube, "second", namespace)
    second = kube.get("resource.k8s.io/v1", "ResourceClaim", "second", namespace)["metadata"]
    (handle,) = driver.checkpoint_entry(second["uid"])["state"]["mpsDaemons"]
    assert handle["pid"] == pid
    log = plugin_log(driver)[offset:]
    assert (
        f"mps shared daemon live, joined daemon_id={daemon_id} pid={pid} (settings checked beside)"
        in log
    ), log[-3000:]

    # The last share leaves: its daemon goes, a fresh warm one (new pod, new process) comes at
    # once, not one warmer interval later.
    delete_pods(kube, namespace, ["first", "second"])
    driver.wait_unprepared(uid)
    driver.wait_unprepared(second["uid"])
    wait_for(
        "a fresh warm daemon pod",
        lambda: any(
            p["metadata"]["uid"] != daemon_pod["metadata"]["uid"]
            and p["status"].get("phase") == "Running"
            for p in driver.mps_daemon_pods().values()
        ),
        60,
        interval=0.2,
    )
    fresh = warm_pid(driver, daemon_id)
    assert fresh != pid
    log = plugin_log(driver)[offset:]
    gone = f"mps shared daemon stopped daemon_id={daemon_id} (last share gone)"
    restarted = f"mps warm daemon started daemon_id={daemon_id} pid={fresh} "
    assert logged_at(log, restarted) - logged_at(log, gone) < FRESH_WITHIN_S, log[-3000:]


def test_a_killed_plugin_leaves_the_warm_daemon_and_the_restarted_one_adopts_it(
    driver: Driver, kube: Kube, namespace: str
) -> None:
    daemon_id = shared_daemon_id(driver.uuid_of("gpu-0"))
    daemon_pod = warm_pod(driver, daemon_id)
    pid = warm_pid(driver, daemon_id)  # its start finished: recorded in daemon.json

    driver.kill_plugin()
    assert pid in daemons(driver)  # no claim records it, and still it outlives the plugin
    offset = len(plugin_log(driver))
    driver.start_plugin()  # registers after the first warm pass

    # Adopted, not swept as a leftover nor started anew.
    log = plugin_log(driver)[offset:]
    assert f"mps warm daemon adopted daemon_id={daemon_id} pid={pid} " in log, log[-3000:]
    assert f"mps warm daemon started daemon_id={daemon_id}" not in log
    assert f"mps leftover removed daemon_id={daemon_id}" not in log
    assert warm_pid(driver, daemon_id) == pid
    assert recorded_pid(driver, daemon_id) == pid
    assert (
        driver.mps_daemon_pods()[daemon_pod["metadata"]["name"]]["metadata"]["uid"]
        == (daemon_pod["metadata"]["uid"])
    )
    kube.create(m.share_claim("after", namespace, "20Gi", 20))
    kube.create(m.gpu_pod("after", namespace, claim="after", command=m.SHOW_MPS))
    wait_running(kube, "after", namespace)
    assert mps_output(kube, "after", namespace)["pid"] == str(pid)
    delete_pods(kube, namespace, ["after"])
    wait_for("the share to be unprepared", lambda: not driver.checkpoint_claims(), 60)
