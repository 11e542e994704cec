"""The kubelet plugin's dynamic MIG (`MigLifecycle`) through `RealNvml` on the NVML mock library.

Each step is a process of its own (`tests.e2e_tools.plugin_probe`), as the plugin is across
restarts: the start-up discovery with ``--dynamic-mig`` finds the partitions, the lifecycle makes
the MIG device of one; the instances live in the mock's state file. The dev root is the driver
root, which has no MIG capability nodes until the library makes them (as nvidia-modprobe does
on a host). The MIG calls through the library alone are tests/e2e_tools/test_nvml_mock.py's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import nvmlmock
from e2e.cluster.paths import ClusterPaths
from e2e.driverroot import build_driver_root, remove_driver_root
from tests.e2e_tools.support import library_env, plugin_probe

CAPS_MAJOR = 511


@pytest.fixture
def driver_root(
    tmp_path: Path, nvml_mock_library: Path, cluster_paths: ClusterPaths
) -> Iterator[Path]:
    """A fake driver root (e2e/driverroot.py) as the real-mode e2e plugin gets it: the library,
    device nodes made with mknod, the driver's procfs (``nvidia-caps`` major, ``mig-minors``)."""
    made = build_driver_root(
        tmp_path / "driver",
        nvml_library=nvml_mock_library,
        machine="dgxh100",
        gpu_minors=range(8),
        driver_version="550.54.15",
        paths=cluster_paths,
        caps_major=CAPS_MAJOR,
    )
    yield made.root
    remove_driver_root(made.root)


def mock(driver_root: Path, tmp_path: Path, machine: str = "dgxh100") -> dict[str, str]:
    return library_env(machine=machine, state=tmp_path / "state.json", dev_root=driver_root)


def lifecycle(driver_root: Path, env: dict[str, str], *args: str) -> Any:
    return plugin_probe(driver_root, "lifecycle", *args, env=env).json()


def cap_nodes(driver_root: Path) -> dict[str, tuple[int, int]]:
    """The root's GPU- and compute-instance capability nodes (minor > 2): name -> (major,
    minor), all character devices."""
    found = {}
    for path in (driver_root / "dev" / "nvidia-caps").iterdir():
        info = path.lstat()
        assert stat.S_ISCHR(info.st_mode), path
        if os.minor(info.st_rdev) > 2:  # 1, 2: MIG config and monitor, made with the root
            found[path.name] = (os.major(info.st_rdev), os.minor(info.st_rdev))
    return found


def test_a_mig_device_is_made_at_a_published_partition_and_destroyed(
    driver_root: Path, tmp_path: Path
) -> None:
    env = mock(driver_root, tmp_path)

    created = lifecycle(driver_root, env, "create", "0", "1g.10gb", "3", "--edits")

    made = created["made"]
    assert created["partition"] == {"name": "gpu-0-mig-1g10gb-0-3", "giProfileId": 0}
    assert made["parent"] == nvmlmock.gpu_uuid("dgxh100", 0)
    assert made["uuid"].startswith("MIG-")
    assert (made["profile"], made["giProfileId"], made["placement"]) == ("1g.10gb", 0, [3, 1])
    assert created["instances"] == [
        {"giId": made["giId"], "giProfileId": 0, "placement": [3, 1], "ciIds": [made["ciId"]]}
    ]
    assert created["migMode"] == 1  # Hopper: turned on by the create
    minors = [nvmlmock.mig_cap_minor(0, made["giId"], ci) for ci in (None, made["ciId"])]
    # the CDI spec: the parent's node and both capability nodes by major and minor
    assert created["deviceNodes"] == [
        {"path": "/dev/nvidia0", "type": None, "major": None, "minor": None},
        *(
            {
                "path": f"/dev/nvidia-caps/nvidia-cap{m}",
                "type": "c",
                "major": CAPS_MAJOR,
                "minor": m,
            }
            for m in minors
        ),
    ]
    # the host: the library made the nodes, as nvidia-modprobe does
    assert cap_nodes(driver_root) == {f"nvidia-cap{m}": (CAPS_MAJOR, m) for m in minors}

    destroyed = lifecycle(driver_root, env, "destroy", "0", "1g.10gb", "3")

    assert destroyed == {"destroyed": [True, False], "instances": [], "migMode": 0}
    assert cap_nodes(driver_root) == {}


def test_a_mig_device_made_by_the_plugin_is_discovered_after_a_restart(
    driver_root: Path, tmp_path: Path
) -> None:
    """A restarted plugin without dynamic MIG publishes the MIG device as a static one, under
    the partition's name; with dynamic MIG the GPU is published in partitionable form again."""
    env = mock(driver_root, tmp_path)
    made = lifecycle(driver_root, env, "create", "0", "1g.10gb", "3")["made"]

    static = plugin_probe(driver_root, "publish", env=env).json()

    assert static["problems"] == []
    assert static["migDevices"] == [made]
    (device,) = [d for d in static["devices"] if d["name"].startswith("gpu-0")]
    assert device["name"] == "gpu-0-mig-1g10gb-0-3"
    assert device["attributes"]["uuid"] == {"string": made["uuid"]}
    assert device["attributes"]["parentUUID"] == {"string": made["parent"]}

    dynamic = plugin_probe(driver_root, "publish", "--dynamic-mig", env=env).json()
    names = [d["name"] for d in dynamic["devices"]]
    assert "gpu-0" in names
    assert "gpu-0-mig-1g10gb-0-3" in names
    assert [s["name"] for s in dynamic["counterSets"]] == [f"gpu-{i}-counter-set" for i in range(8)]


def test_an_occupied_placement_is_refused_with_the_return_code(
    driver_root: Path, tmp_path: Path
) -> None:
    env = mock(driver_root, tmp_path)
    big = lifecycle(driver_root, env, "create", "0", "2g.20gb", "2")["made"]

    refused = lifecycle(driver_root, env, "occupied", "0", "1g.10gb", "3")

    message = refused["error"]["message"]
    assert refused["error"]["retryable"] is True
    assert "cannot create GPU instance 1g.10gb (profile ID 0) at memory slices 3..3" in message
    assert "nvmlDeviceCreateGpuInstanceWithPlacement answered " in message
    assert (
        "NVML_ERROR_INSUFFICIENT_RESOURCES: placement 3..3 is occupied by GPU instance" in message
    )
    assert f"GPU instance {big['giId']} (profile ID 1) at memory slices 2..3" in message
    assert nvmlmock.gpu_uuid("dgxh100", 0) in message
    assert refused["instances"] == [
        {"giId": big["giId"], "giProfileId": 1, "placement": [2, 2], "ciIds": [big["ciId"]]}
    ]


def test_a_compute_instance_made_meanwhile_keeps_the_gpu_instance_in_use(
    driver_root: Path, tmp_path: Path
) -> None:
    """Another client makes a compute instance in the GPU instance between the lifecycle's
    listing and its destroy: NVML answers IN_USE, reported as such; MIG mode stays on."""
    env = mock(driver_root, tmp_path)
    made = lifecycle(driver_root, env, "create", "1", "1g.10gb", "0")["made"]

    raced = lifecycle(driver_root, env, "in-use", "1", "1g.10gb", "0", "compute-instance")

    message = raced["error"]["message"]
    assert raced["error"]["retryable"] is True
    assert f"cannot destroy GPU instance {made['giId']}: " in message
    assert message.endswith("(NVML_ERROR_IN_USE)")
    [instance] = raced["instances"]
    assert (instance["giId"], instance["placement"], len(instance["ciIds"])) == (
        made["giId"],
        [0, 1],
        1,
    )
    assert raced["migMode"] == 1


def test_mig_mode_is_not_turned_off_while_another_gpu_instance_appears(
    driver_root: Path, tmp_path: Path
) -> None:
    """The last GPU instance is destroyed, but another client makes one before MIG mode goes
    off: NVML refuses with IN_USE, reported; the other instance and MIG mode stay."""
    env = mock(driver_root, tmp_path)
    lifecycle(driver_root, env, "create", "2", "1g.10gb", "0")

    raced = lifecycle(driver_root, env, "in-use", "2", "1g.10gb", "0", "gpu-instance")

    message = raced["error"]["message"]
    assert raced["error"]["retryable"] is True
    assert "cannot turn MIG mode off: " in message
    assert message.endswith("(NVML_ERROR_IN_USE)")
    [other] = raced["instances"]
    assert other["giProfileId"] == 0
    assert other["placement"] != [0, 1]
    assert raced["migMode"] == 1


def test_ampere_keeps_its_mig_mode(driver_root: Path, tmp_path: Path) -> None:
    """An A100 with MIG off is not partitionable and the lifecycle does not switch it (that
    needs a reset); with MIG on, destroying the last MIG device leaves MIG mode on."""
    env = mock(driver_root, tmp_path, machine="dgxa100")

    off = lifecycle(driver_root, env, "ampere-mig-off", "0")

    assert off["partitionable"] == []
    assert "has MIG mode off; gpu-dra switches MIG mode only on Hopper" in off["error"]["message"]
    assert off["error"]["retryable"] is False
    assert off["migMode"] == 0

    plugin_probe(driver_root, "mig-mode", "1", env=env).json()
    created = lifecycle(driver_root, env, "create", "0", "1g.5gb", "0")
    assert created["partition"] == {"name": "gpu-0-mig-1g5gb-0-0", "giProfileId": 0}
    assert created["made"]["profile"] == "1g.5gb"
    destroyed = lifecycle(driver_root, env, "destroy", "0", "1g.5gb", "0")
    assert destroyed == {"destroyed": [True, False], "instances": [], "migMode": 1}
