"""Real mode on go-nvml's mock machines vs the simulator on the same hardware, field by field.

Real mode is the kubelet plugin's start-up with ``--driver-root`` on a root holding the NVML
mock library (`tests.e2e_tools.plugin_probe`, in a subprocess: pynvml keeps one library per
process), PCIe roots and NUMA nodes read from a sysfs tree that gives the mock's bus ids the
simulator profile's topology. Simulated is the same start-up with ``--simulate``. After the
per-machine identities are normalised (`tests.e2e_tools.published_diff`), every difference must
be one of `EXPLAINED`, and every entry of `EXPLAINED` must occur in each of its cases, so the
list cannot go stale. docs/real-nodes.md, "Real mode vs the simulator", has the same table and
says which side is right. ``gpu-dra devices --driver-root`` must print what the plugin
publishes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import nvmlmock
from gpu_dra.driver.nvml.simulated_profiles import builtin_models, load_profile
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.discovery import discover, node_inventory, node_nvml
from tests.e2e_tools.plugin_probe import publication
from tests.e2e_tools.published_diff import DEVICE, Difference, differences
from tests.e2e_tools.support import gpu_nodes, library_env, mock_server, plugin_probe

ALL_CASES = frozenset(
    {"dgxh100", "dgxh100-dynamic-mig", "dgxh100-static-mig", "dgxa100", "dgxa100-mig-dynamic-mig"}
)
H100 = frozenset(case for case in ALL_CASES if case.startswith("dgxh100"))
H100_MIG = H100 - {"dgxh100"}
A100 = ALL_CASES - H100
WITH_MIG = ALL_CASES - {"dgxh100", "dgxa100"}


@dataclass(frozen=True)
class Case:
    """One machine, and how its GPUs are set up and published."""

    name: str
    machine: str
    simulated: str
    """The simulator's profile of the same hardware: a built-in name, or one of `DERIVED`."""
    dynamic_mig: bool = False
    mig_on: bool = False
    """MIG mode on for every GPU before the start-up (as an administrator sets it)."""
    static_mig: tuple[tuple[int, str, int], ...] = ()
    """MIG devices made before the start-up: (GPU index, profile name, placement start)."""


CASES = (
    Case("dgxh100", "dgxh100", "hgx-h100"),
    Case("dgxh100-dynamic-mig", "dgxh100", "hgx-h100", dynamic_mig=True),
    Case(
        "dgxh100-static-mig",
        "dgxh100",
        "hgx-h100",
        static_mig=((1, "1g.10gb", 0), (1, "3g.40gb", 4), (2, "7g.80gb", 0), (3, "1g.20gb", 2)),
    ),
    Case("dgxa100", "dgxa100", "dgx-a100-40gb"),
    Case("dgxa100-mig-dynamic-mig", "dgxa100", "dgx-a100-40gb", dynamic_mig=True, mig_on=True),
)
assert {case.name for case in CASES} == ALL_CASES

DERIVED = {"dgx-a100-40gb": ("dgx-a100", "A100-SXM4-40GB")}
"""Profiles the built-ins lack: (built-in machine, GPU model put in): go-nvml's dgxa100 has the
40 GB A100 of the first DGX A100 (320 GB), the built-in dgx-a100 the 80 GB one (DGX A100 640GB)."""


@dataclass(frozen=True)
class Explained:
    """Differences with one cause: those of `cases` whose device and field match the patterns
    (whole match) and, unless `values` is None, whose (real, simulated) pair is listed."""

    name: str
    cases: frozenset[str]
    device: str
    field: str
    values: frozenset[tuple[str | None, str | None]] | None = None

    def covers(self, case: str, difference: Difference) -> bool:
        return (
            case in self.cases
            and re.fullmatch(self.device, difference.device) is not None
            and re.fullmatch(self.field, difference.field) is not None
            and (self.values is None or (difference.real, difference.simulated) in self.values)
        )


def pairs(*values: tuple[str | None, str | None]) -> frozenset[tuple[str | None, str | None]]:
    return frozenset(values)


ANY = r".*"
MIG_DEVICE = r"gpu-\d+-mig-.*"
COUNTED = r"(capacity|consumesCounters\.gpu-\d+-counter-set|counters)"
"""A field that is a capacity, a counter a device consumes, or a counter of a counter set."""

EXPLAINED = (
    # Which side is right: docs/real-nodes.md, "Real mode vs the simulator".
    Explained(
        "driver version",
        ALL_CASES,
        ANY,
        r"attributes\.(driverVersion|cudaDriverVersion)",
        pairs(("550.54.15", "580.95.5"), ("550.54.15", "580.65.6"), ("12.4.0", "13.0.0")),
    ),
    Explained(
        "A100 name",
        A100,
        ANY,
        r"attributes\.productName",
        pairs(("Mock NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB")),
    ),
    Explained("H100 memory", H100, r"gpu-\d+", r"capacity\.memory", pairs(("80Gi", "81559Mi"))),
    Explained(
        "GPU-instance profile IDs",
        WITH_MIG,
        MIG_DEVICE,
        r"name\.giProfileId",
        pairs(
            ("0", "19"), ("1", "14"), ("2", "9"), ("3", "5"), ("4", "0"), ("7", "20"), ("9", "15")
        ),
    ),
    Explained(
        "Hopper profile memory",
        H100_MIG,
        ANY,
        COUNTED + r"\.memory",
        pairs(("10Gi", "9984Mi"), ("20Gi", "20096Mi"), ("40Gi", "40448Mi"), ("80Gi", "81152Mi")),
    ),
    Explained(
        "Hopper memory slices",
        H100 - {"dgxh100"},
        ANY,
        COUNTED + r"\.memory-slice-\d|capacity\.memorySlice\d",
        pairs((None, "1")),
    ),
    Explained(
        # the mock's 1g.20gb spans one memory slice, as 1g.10gb does, so the default's shape
        # 1g takes both; on an H100 it spans two and is offered only on request
        "Hopper 1g.20gb offered",
        frozenset({"dgxh100-dynamic-mig"}),
        r"gpu-\d+-mig-1g20gb-\*-[0-6]",
        re.escape(DEVICE),
        pairs(("published", None)),
    ),
    Explained(
        "Hopper SMs",
        H100_MIG,
        ANY,
        COUNTED + r"\.multiprocessors",
        pairs(("16", "26"), ("48", "60"), ("112", "132")),
    ),
    Explained(
        "Hopper copy engines",
        frozenset({"dgxh100-dynamic-mig", "dgxh100-static-mig"}),
        ANY,
        COUNTED + r"\.(copyEngines|copy-engines)",
        pairs(("7", "8")),
    ),
    Explained(
        "Hopper decoders",
        H100_MIG,
        ANY,
        COUNTED + r"\.decoders",
        pairs(("1", "2"), ("2", "3"), ("2", "4"), ("5", "7")),
    ),
    Explained(
        # the mock's 7g has 5 decoders, its seven 1g.10gb one each: seven 1g slices need more
        # than the GPU has, so the counter can run out; an H100's 7g has 7
        "Hopper decoders counter",
        frozenset({"dgxh100-dynamic-mig"}),
        ANY,
        r"(counters|consumesCounters\.gpu-\d+-counter-set)\.decoders",
        pairs(("1", None), ("2", None), ("5", None)),
    ),
    Explained(
        # the mock's 3g.40gb spans 3 memory slices of 7, leaving one between two of them: 3g,
        # 1g, 3g fit the slices and need 90Gi of 80Gi, so the counter can run out; an H100's
        # 3g spans 4 of 8 and no set of placements needs more memory than it has
        "Hopper memory counter",
        frozenset({"dgxh100-dynamic-mig"}),
        ANY,
        r"(counters|consumesCounters\.gpu-\d+-counter-set)\.memory",
        pairs(("10Gi", None), ("20Gi", None), ("40Gi", None), ("80Gi", None)),
    ),
    Explained(
        "Hopper JPEG engines",
        H100_MIG,
        ANY,
        COUNTED + r"\.(jpegEngines|jpeg-engines)",
        pairs(("0", "1"), ("0", "2"), ("0", "3"), ("0", "4"), ("0", "7"), ("1", "7")),
    ),
    Explained(
        "Hopper OFA engines",
        frozenset({"dgxh100-dynamic-mig", "dgxh100-static-mig"}),
        ANY,
        COUNTED + r"\.(ofaEngines|ofa-engines)",
        pairs(("0", "1")),
    ),
)


@pytest.fixture(scope="module")
def sim_profiles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Profile name -> what ``--simulate`` takes: built-ins as they are, `DERIVED` as files."""
    builtin = json.loads(
        resources.files("gpu_dra.driver.nvml").joinpath("machine_profiles.json").read_text()
    )
    directory = tmp_path_factory.mktemp("profiles")
    specs = {}
    for name, (machine, model) in DERIVED.items():
        document = dict(builtin[machine], name=name)
        document["gpus"] = [dict(gpu, model=model) for gpu in builtin[machine]["gpus"]]
        path = directory / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        specs[name] = str(path)
    return specs


def simulated(case: Case, spec: str, tmp_path: Path) -> dict[str, Any]:
    """The simulated start-up of `case`, in this process."""
    profile: dict[str, Any] | None = None
    if case.mig_on or case.static_mig:
        loaded = yaml.safe_load(Path(spec).read_text()) if spec.endswith(".yaml") else None
        profile = loaded or _builtin_document(spec)
        for index, gpu in enumerate(profile["gpus"]):
            made = [(p, s) for g, p, s in case.static_mig if g == index]
            if case.mig_on or made:
                gpu["migMode"] = [1, 1]
            if made:
                gpu["migDevices"] = [
                    {"profileId": _simulated_profile_id(gpu["model"], p), "start": s}
                    for p, s in made
                ]
        path = tmp_path / f"{case.name}.yaml"
        path.write_text(yaml.safe_dump(profile))
        spec = str(path)
    flags = ["--node-name=node-a", f"--simulate={spec}", f"--data-dir={tmp_path / 'sim-data'}"]
    settings = KubeletPluginSettings.parse(
        [*flags, *(["--dynamic-mig"] if case.dynamic_mig else [])], {}
    )
    nvml, pci = node_nvml(settings)
    devices = discover(settings, nvml, pci)
    return publication(devices, node_inventory(settings, devices))


def _builtin_document(name: str) -> dict[str, Any]:
    builtin = json.loads(
        resources.files("gpu_dra.driver.nvml").joinpath("machine_profiles.json").read_text()
    )
    document: dict[str, Any] = json.loads(json.dumps(builtin[name]))
    return document


def _simulated_profile_id(model: str, profile: str) -> int:
    geometry = builtin_models()[model].mig
    assert geometry is not None
    (found,) = [p.id for p in geometry.profiles if p.name == profile]
    return found


def real(case: Case, driver_root: Path, spec: str, tmp_path: Path) -> dict[str, Any]:
    """The real-mode start-up of `case` on the mock library, with the simulated profile's PCI
    topology under the mock's bus ids."""
    gpu_nodes(driver_root, range(8))
    env = library_env(machine=case.machine, state=tmp_path / "state.json", dev_root=driver_root)
    if case.mig_on:
        plugin_probe(driver_root, "mig-mode", "1", env=env).json()
    for gpu, profile, start in case.static_mig:
        plugin_probe(
            driver_root, "lifecycle", "create", str(gpu), profile, str(start), env=env
        ).json()
    flags = ["--dynamic-mig"] if case.dynamic_mig else []
    first = plugin_probe(driver_root, "publish", *flags, env=env).json()
    sysfs = sysfs_tree(
        tmp_path / "sys",
        [gpu["pciBusId"] for gpu in first["gpus"]],
        load_profile(spec, node_name="node-a").gpus,
    )
    published: dict[str, Any] = plugin_probe(
        driver_root, "publish", *flags, "--sysfs", str(sysfs), env=env
    ).json()
    return published


def sysfs_tree(sysfs: Path, bus_ids: list[str], gpus: Any) -> Path:
    """``<sysfs>/bus/pci/devices/<bus id>`` linking to a device under its PCIe root, with its
    ``numa_node``, as Linux lays them out; the i-th bus id gets the i-th GPU's topology."""
    assert len(bus_ids) == len(gpus)
    links = sysfs / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    for bus_id, gpu in zip(bus_ids, gpus, strict=True):
        device = sysfs / "devices" / (gpu.pcie_root or "platform") / bus_id
        device.mkdir(parents=True)
        numa = -1 if gpu.numa_node is None else gpu.numa_node
        (device / "numa_node").write_text(f"{numa}\n")
        (links / bus_id).symlink_to(os.path.relpath(device, links))
    return sysfs


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_real_mode_publishes_what_the_simulator_does_but_the_explained(
    case: Case, driver_root: Path, sim_profiles: dict[str, str], tmp_path: Path
) -> None:
    spec = sim_profiles.get(case.simulated, case.simulated)
    mine, theirs = real(case, driver_root, spec, tmp_path), simulated(case, spec, tmp_path)

    assert mine["problems"] == theirs["problems"] == []
    assert len(mine["gpus"]) == len(theirs["gpus"]) == 8
    assert len(mine["migDevices"]) == len(theirs["migDevices"]) == len(case.static_mig)
    found = differences(mine, theirs)
    unexplained = [str(d) for d in found if not any(e.covers(case.name, d) for e in EXPLAINED)]
    assert unexplained == []
    stale = [
        e.name
        for e in EXPLAINED
        if case.name in e.cases and not any(e.covers(case.name, d) for d in found)
    ]
    assert stale == []
    # The fields both publish are most of them: the comparison is not vacuous.
    assert len(mine["devices"]) >= 8


@pytest.mark.parametrize("machine", ["dgxh100", "dgxa100"])
def test_the_simulated_profile_is_the_mock_machines_hardware(
    machine: str, go_nvml: Path, sim_profiles: dict[str, str]
) -> None:
    """GPU count, product, PCI device id and compute capability; memory differs on the H100
    (`EXPLAINED`). The built-in dgx-a100 is the 80 GB machine, hence `DERIVED`."""
    mock = mock_server(go_nvml, machine)
    (case,) = {c.simulated for c in CASES if c.machine == machine}
    gpus = load_profile(sim_profiles.get(case, case), node_name="node-a").gpus
    assert len(gpus) == mock.gpu_count
    for gpu in gpus:
        assert gpu.model.name == mock.name.removeprefix("Mock ")
        assert gpu.model.pci_device_id == mock.pci_device_id
        assert gpu.model.cuda_compute_capability == mock.cuda_compute_capability
    if machine == "dgxa100":
        assert gpu.model.memory_total_mib == mock.memory_mib
        builtin = load_profile("dgx-a100", node_name="node-a").gpus[0].model
        assert builtin.pci_device_id != mock.pci_device_id


def gpu_dra(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).parent / "gpu-dra"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("machine", "flags"),
    [("dgxh100", ()), ("dgxh100", ("--dynamic-mig",)), ("dgxa100", ())],
)
def test_gpu_dra_devices_prints_what_the_plugin_publishes(
    machine: str, flags: tuple[str, ...], driver_root: Path
) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(machine=machine, dev_root=driver_root)
    published = plugin_probe(driver_root, "publish", *flags, env=env).json()

    listed = gpu_dra("devices", "--driver-root", str(driver_root), *flags, "-o", "json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr == ""
    assert json.loads(listed.stdout) == published["devices"]

    table = gpu_dra("devices", "--driver-root", str(driver_root), *flags, env=env)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["NAME", "TYPE", "PROFILE", "PRODUCT"]
    assert [row.split()[0] for row in rows] == [d["name"] for d in published["devices"]]
    types = {d["name"]: d["attributes"]["type"]["string"] for d in published["devices"]}
    assert {row.split()[0]: row.split()[1] for row in rows} == types


def test_gpu_dra_devices_without_device_nodes_fails(driver_root: Path) -> None:
    """The library loads and counts 0 GPUs (no /dev/nvidia<minor> here): exit status 1."""
    env = library_env(machine="dgxh100", dev_root=driver_root)
    listed = gpu_dra("devices", "--driver-root", str(driver_root), env=env)
    assert listed.returncode == 1
    assert "no GPUs found: NVML reports 0 GPUs" in listed.stderr


def test_gpu_dra_devices_without_the_mock_machine_fails_naming_the_return_code(
    driver_root: Path,
) -> None:
    gpu_nodes(driver_root, range(8))
    env = library_env(dev_root=driver_root)  # the mock then answers DRIVER_NOT_LOADED
    listed = gpu_dra("devices", "--driver-root", str(driver_root), env=env)
    assert listed.returncode == 1
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in listed.stderr
    assert nvmlmock.ENV_MACHINE in listed.stderr  # the library's own line
