"""gpu-dra's CDI specs against NVIDIA's ``nvidia-ctk cdi generate`` v1.20.1, device by device.

On one fake driver root per mock machine (dgxh100, dgxa100: `e2e.driverroot`, the NVML mock
library, eight GPUs, DRM nodes on the even ones, MIG devices made through gpu-dra's `RealNvml`
on GPUs 2 and 5), nvidia-ctk generates its spec and the kubelet plugin, composed as in real
mode, prepares one claim per published device plus MPS and TimeSlicing claims
(`tests.e2e_tools.plugin_cdi_probe`). For every device, what a container gets (the spec's
common edits plus the device's) is compared: mounts (container path, host path, options),
device nodes (path, host path, permissions, and major/minor where both give them), hooks
(phase, subcommand, arguments; the hook program's path normalised) and environment.

Every difference must match one entry of `ALLOWED`, the differences by design that
docs/real-nodes.md lists ("Differences from `nvidia-ctk cdi generate` v1.20.1"); every entry
must occur, so the list cannot go stale. MPS and time-sliced claims must get exactly the
userspace of the same device's plain claim, plus (MPS) their daemon's pipe directory and shm.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e import nvmlmock
from e2e.cluster.paths import ClusterPaths
from e2e.driverroot import DriverRoot, build_driver_root, remove_driver_root
from tests.e2e_tools.support import REPO, host_view, library_env, mock_server, probe
from tests.e2e_tools.test_nvidia_ctk import cdi_generate

HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
HOOK_PROGRAM = "nvidia-cdi-hook"
MACHINES = ("dgxh100", "dgxa100")
GPU_MINORS = tuple(range(8))
DRM_GPUS = (0, 2, 4, 6)
"""GPUs (index = minor here) with DRM nodes; GPU 2 is in MIG mode (no DRM for its slices)."""
DRM_MAJOR = 226
MIG_DEVICES = ((2, 0, 0), (2, 2, 4), (5, 4, 0))
"""(GPU index, GPU-instance profile ID, placement start): a 1g and a 3g on GPU 2, a 7g on 5.
The mock's profile IDs are the profile indexes (docs/real-nodes.md)."""
MIG_PER_GPU = Counter(gpu for gpu, _, _ in MIG_DEVICES)
DOC = REPO / "docs" / "real-nodes.md"
DOC_SECTION = "### Differences from `nvidia-ctk cdi generate` v1.20.1"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod and mount need root")


# ---- what a container gets, from either spec ---------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One fact of what a container gets: `aspect` (``mount``, ``device node``, ``hook``,
    ``env``), `key` (what it is about) and `value` (what the spec says about it)."""

    aspect: str
    key: str
    value: str


@dataclass(frozen=True)
class Difference:
    """An item one side has and the other has not (`only`: ``nvidia-ctk`` or ``gpu-dra``)."""

    device: str
    only: str
    item: Item

    def __str__(self) -> str:
        item = self.item
        return f"{self.device}: only {self.only}: {item.aspect} {item.key} = {item.value}"


def container_view(common: dict[str, Any], device: dict[str, Any]) -> Counter[Item]:
    """The items a container given `device` gets (spec edits first, as CDI applies them).

    Device nodes carry their numbers only where the spec gives them (NVIDIA leaves out a
    minor of 0); `permissions` and host paths are compared as written. A hook becomes one item
    per link (``create-symlinks``), per folder (``update-ldcache``) or one for its arguments,
    with its phase and environment; its program must be `HOOK_PATH`."""
    items: Counter[Item] = Counter()
    for edits in (common, device):
        for mount in edits.get("mounts", []):
            value = f"{mount['hostPath']} ({','.join(mount.get('options', []))})"
            items[Item("mount", mount["containerPath"], value)] += 1
        for node in edits.get("deviceNodes", []):
            path = node["path"]
            items[Item("device node", path, node.get("hostPath", path))] += 1
            items[Item("device node permissions", path, node.get("permissions", "-"))] += 1
            if "major" in node:
                numbers = f"{node.get('type', 'c')} {node['major']}:{node.get('minor', 0)}"
                items[Item("device node numbers", path, numbers)] += 1
        for hook in edits.get("hooks", []):
            assert hook["path"] == HOOK_PATH, hook
            program, name, *args = hook["args"]
            assert program == HOOK_PROGRAM, hook
            where = f"{hook['hookName']} {name} [{' '.join(hook.get('env', []))}]"
            if name in ("create-symlinks", "update-ldcache"):
                flag = "--link" if name == "create-symlinks" else "--folder"
                assert args[::2] == [flag] * (len(args) // 2), hook
                for value in args[1::2]:
                    items[Item("hook", where, value)] += 1
            else:
                items[Item("hook", where, " ".join(args))] += 1
        for entry in edits.get("env", []):
            key, _, value = entry.partition("=")
            items[Item("env", key, value)] += 1
    return items


def hook_order(common: dict[str, Any], device: dict[str, Any]) -> list[str]:
    """Hook subcommands in the order the runtime runs them, each once."""
    names = [h["args"][1] for edits in (common, device) for h in edits.get("hooks", [])]
    return list(dict.fromkeys(names))


def differences(device: str, ctk: Counter[Item], ours: Counter[Item]) -> list[Difference]:
    found = [Difference(device, "nvidia-ctk", item) for item in (ctk - ours).elements()]
    found += [Difference(device, "gpu-dra", item) for item in (ours - ctk).elements()]
    return found


# ---- the differences by design -----------------------------------------------------------------


@dataclass
class Allowed:
    """A difference by design: `matches` says whether a `Difference` is one of it; `doc` is
    the words of docs/real-nodes.md's list that justify it."""

    name: str
    doc: str
    matches: Callable[[Difference], bool]


def _hook_named(difference: Difference, name: str) -> bool:
    return difference.item.aspect == "hook" and f" {name} " in difference.item.key


ALLOWED = (
    Allowed(
        "no per-GPU CUDA memory limit hook",
        "No per-GPU `apply-cuda-memory-limits` (createRuntime) hook.",
        lambda d: (
            d.only == "nvidia-ctk"
            and _hook_named(d, "apply-cuda-memory-limits")
            and d.item.key.startswith("createRuntime ")
        ),
    ),
    Allowed(
        "no graphics files (the GBM backend link)",
        "the GBM backend link `gbm/nvidia-drm_gbm.so`",
        lambda d: (
            d.only == "nvidia-ctk"
            and _hook_named(d, "create-symlinks")
            and d.item.value.endswith("/gbm/nvidia-drm_gbm.so")
        ),
    ),
    Allowed(
        "device node permissions rw, not rwm",
        "Device nodes carry `permissions: rw`",
        lambda d: (
            d.item.aspect == "device node permissions"
            and d.item.value == {"nvidia-ctk": "rwm", "gpu-dra": "rw"}[d.only]
        ),
    ),
    Allowed(
        "no major/minor for nodes the runtime reads from the host",
        "no `major`/`minor`/`fileMode`/`gid` (the runtime reads",
        lambda d: (
            d.only == "nvidia-ctk"
            and d.item.aspect == "device node numbers"
            and not d.item.key.startswith("/dev/nvidia-caps/")
        ),
    ),
    Allowed(
        "DRM by-path links as container paths",
        "The `/dev/dri/by-path` link paths of the DRM hook are container paths",
        lambda d: _hook_named(d, "create-symlinks") and "/dev/dri/by-path/pci-" in d.item.value,
    ),
    Allowed(
        "per-device GPU_DRA_* variables",
        "`GPU_DRA_<DEVICE>_UUID`",
        lambda d: (
            d.only == "gpu-dra"
            and d.item.aspect == "env"
            and re.fullmatch(
                r"GPU_DRA_GPU_\d+(_MIG_\w+)?_(UUID|PARENT_UUID|PROFILE|PRODUCT)", d.item.key
            )
            is not None
        ),
    ),
    Allowed(
        "an MPS claim's own daemon",
        "the MPS daemon's pipe directory and shm",
        lambda d: (
            d.only == "gpu-dra"
            and (
                (d.item.aspect == "mount" and d.item.key in ("/tmp/nvidia-mps", "/dev/shm"))
                or (d.item.aspect == "env" and d.item.key.startswith("CUDA_MPS_"))
            )
        ),
    ),
)


def test_every_allowed_difference_is_in_the_docs_list() -> None:
    section = DOC.read_text().split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    for allowed in ALLOWED:
        assert " ".join(allowed.doc.split()) in flat, allowed.name


# ---- the node: a fake driver root, MIG devices, DRM nodes -------------------------------------


@dataclass(frozen=True)
class Node:
    machine: str
    root: DriverRoot
    pci_devices: Path
    """Stands for /sys/bus/pci/devices: the GPUs' ``drm/`` entries."""
    env: dict[str, str]
    whole: dict[str, int]
    """UUID -> minor of the GPUs not in MIG mode."""
    mig: dict[str, tuple[int, int, int]]
    """MIG UUID -> (GPU minor, GPU-instance id, compute-instance id)."""

    def gpu_minor(self, uuid: str) -> int:
        """The minor of the GPU `uuid` is or is a MIG device of."""
        return self.mig[uuid][0] if uuid in self.mig else self.whole[uuid]


def pci_bus_id(index: int) -> str:
    """The mock's PCI location of GPU `index` (docs/real-nodes.md, "What it answers")."""
    return f"0000:{index:02x}:00.0"


def add_drm_nodes(root: DriverRoot, pci_devices: Path, index: int) -> None:
    """``card<i+1>`` and ``renderD<128+i>`` in the PCI device's ``drm/`` and in ``/dev/dri``,
    with the ``by-path`` links udev makes."""
    bus = pci_bus_id(index)
    dri = root.dev_dir / "dri"
    (dri / "by-path").mkdir(parents=True, exist_ok=True)
    for name, minor, kind in (
        (f"card{index + 1}", index + 1, "card"),
        (f"renderD{128 + index}", 128 + index, "render"),
    ):
        (pci_devices / bus / "drm" / name).mkdir(parents=True)
        os.mknod(dri / name, stat.S_IFCHR | 0o666, os.makedev(DRM_MAJOR, minor))
        (dri / "by-path" / f"pci-{bus}-{kind}").symlink_to(f"../{name}")


@pytest.fixture(scope="module", params=MACHINES)
def node(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    cluster_paths: ClusterPaths,
    nvml_mock_library: Path,
    go_nvml: Path,
) -> Iterator[Node]:
    machine: str = request.param
    top = tmp_path_factory.mktemp(machine)
    version = mock_server(go_nvml, machine).driver_version
    root = build_driver_root(
        top / "driver-root",
        nvml_library=nvml_mock_library,
        machine=machine,
        gpu_minors=GPU_MINORS,
        driver_version=version,
        paths=cluster_paths,
    )
    try:
        env = library_env(machine=machine, state=top / "nvml-state.json", dev_root=root.root)
        mig = {}
        for gpu, profile, start in MIG_DEVICES:
            made = probe(root.root, "create", str(gpu), str(profile), str(start), env=env).json()
            root.add_mig_capability_nodes(gpu, made["gi_id"], made["ci_id"])
            mig[made["uuid"]] = (gpu, made["gi_id"], made["ci_id"])
        pci_devices = top / "pci-devices"
        for index in DRM_GPUS:
            add_drm_nodes(root, pci_devices, index)
        mig_gpus = {gpu for gpu, _, _ in MIG_DEVICES}
        whole = {nvmlmock.gpu_uuid(machine, i): i for i in GPU_MINORS if i not in mig_gpus}
        yield Node(machine, root, pci_devices, env, whole, mig)
    finally:
        remove_driver_root(root.root)


@dataclass(frozen=True)
class Specs:
    node: Node
    ctk: dict[str, Any]
    """nvidia-ctk's spec."""
    claims: list[dict[str, Any]]
    """The plugin's claims: label, device, uuid, sharing, spec (`plugin_cdi_probe`)."""

    def ctk_device(self, name: str) -> dict[str, Any]:
        (device,) = [d for d in self.ctk["devices"] if d["name"] == name]
        return dict(device["containerEdits"])

    def plain_claims(self) -> dict[str, dict[str, Any]]:
        """The claims of one device without sharing, by the device's UUID."""
        return {c["uuid"]: c for c in self.claims if c["sharing"] is None}


@pytest.fixture(scope="module")
def specs(node: Node, nvidia_ctk_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Specs:
    minors = node.root.proc_dir / "driver" / "nvidia-caps" / "mig-minors"
    ctk, _ = cdi_generate(nvidia_ctk_dir, node.root.root, node.env, minors, node.pci_devices)
    work = tmp_path_factory.mktemp(f"{node.machine}-plugin")
    command = [
        sys.executable,
        "-m",
        "tests.e2e_tools.plugin_cdi_probe",
        *(str(node.root.root), str(work), HOOK_PATH),
    ]
    done = subprocess.run(
        host_view(command, mig_minors=minors, pci_devices=node.pci_devices),
        cwd=REPO,
        env=node.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return Specs(node, ctk, json.loads(done.stdout.splitlines()[-1]))


# ---- the comparison -----------------------------------------------------------------------------


def ours(claim: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(common edits, the device's edits) of a one-device claim's spec."""
    spec = claim["spec"]
    (device,) = spec["devices"]
    return spec.get("containerEdits", {}), device["containerEdits"]


def compare(specs: Specs, claim: dict[str, Any]) -> list[Difference]:
    """What a container of `claim` gets vs what nvidia-ctk gives its device (by UUID)."""
    ctk = container_view(specs.ctk["containerEdits"], specs.ctk_device(claim["uuid"]))
    mine = container_view(*ours(claim))
    return differences(claim["label"], ctk, mine)


def classify(found: list[Difference]) -> tuple[dict[str, list[Difference]], list[Difference]]:
    """The differences by `ALLOWED` entry name, and those no entry allows."""
    by_entry: dict[str, list[Difference]] = {a.name: [] for a in ALLOWED}
    unexplained = []
    for difference in found:
        entry = next((a for a in ALLOWED if a.matches(difference)), None)
        if entry is None:
            unexplained.append(difference)
        else:
            by_entry[entry.name].append(difference)
    return by_entry, unexplained


@needs_root
def test_nvidia_ctk_and_gpu_dra_offer_the_same_devices(specs: Specs) -> None:
    whole = specs.node.whole
    assert set(specs.plain_claims()) == set(whole) | set(specs.node.mig)
    names = {d["name"] for d in specs.ctk["devices"]} - {"all"}
    mig_indexes = {f"{gpu}:{n}" for gpu, count in MIG_PER_GPU.items() for n in range(count)}
    assert names == {*map(str, whole.values()), *whole, *mig_indexes, *specs.node.mig}
    # nvidia-ctk names each device twice: by index and by UUID, with the same edits.
    for uuid, index in whole.items():
        assert specs.ctk_device(str(index)) == specs.ctk_device(uuid)
    for uuid, (gpu, _, _) in specs.node.mig.items():
        same = [n for n in mig_indexes if n.startswith(f"{gpu}:")]
        assert sum(specs.ctk_device(n) == specs.ctk_device(uuid) for n in same) == 1, uuid


@needs_root
def test_each_device_gets_what_nvidia_ctk_gives_it_or_a_difference_by_design(
    specs: Specs,
) -> None:
    """Per device (whole GPUs, MIG devices, and the MPS and TimeSlicing claims): equal, but for
    the `ALLOWED` differences, each of which occurs."""
    found = [d for claim in specs.claims for d in compare(specs, claim)]

    by_entry, unexplained = classify(found)

    assert not unexplained, (
        "differences from nvidia-ctk not justified in docs/real-nodes.md:\n"
        + "\n".join(map(str, unexplained))
    )
    assert [name for name, seen in by_entry.items() if not seen] == []


@needs_root
def test_the_comparison_sees_the_device_nodes_that_matter(specs: Specs) -> None:
    """Not an empty comparison: each view has its GPU node, DRM nodes where the GPU has them,
    MIG capability nodes with nvidia-caps major and the minors of mig-minors, equal on both
    sides (`compare` finds none of them different)."""
    caps_major = specs.node.root.caps_major
    for claim in specs.claims:
        view = container_view(*ours(claim))
        nodes = {i.key for i in view if i.aspect == "device node"}
        numbers = {i.key: i.value for i in view if i.aspect == "device node numbers"}
        mig = specs.node.mig.get(claim["uuid"])
        gpu = specs.node.gpu_minor(claim["uuid"])
        assert f"/dev/nvidia{gpu}" in nodes
        assert {
            "/dev/nvidiactl",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset",
        } <= nodes
        drm = {n for n in nodes if n.startswith("/dev/dri/")}
        if mig is None and gpu in DRM_GPUS:
            assert drm == {f"/dev/dri/card{gpu + 1}", f"/dev/dri/renderD{128 + gpu}"}
        else:
            assert drm == set()
        if mig is not None:
            _, gi, ci = mig
            caps = [nvmlmock.mig_cap_minor(gpu, gi), nvmlmock.mig_cap_minor(gpu, gi, ci)]
            assert numbers == {
                f"/dev/nvidia-caps/nvidia-cap{m}": f"c {caps_major}:{m}" for m in caps
            }
        # Numbers where both give them: gpu-dra gives them for capability nodes only.
        differing = [
            d
            for d in compare(specs, claim)
            if d.item.aspect in ("device node", "mount")
            or (d.item.aspect == "device node numbers" and d.item.key in numbers)
        ]
        if claim["sharing"] == "MPS":  # the daemon's pipe directory and shm
            differing = [d for d in differing if d.item.key not in ("/tmp/nvidia-mps", "/dev/shm")]
        assert differing == [], claim["label"]


@needs_root
def test_hooks_run_in_nvidia_ctk_order(specs: Specs) -> None:
    for claim in specs.plain_claims().values():
        ctk = hook_order(specs.ctk["containerEdits"], specs.ctk_device(claim["uuid"]))
        mine = hook_order(*ours(claim))
        both = [h for h in ctk if h in mine]
        assert [h for h in mine if h in ctk] == both, claim["label"]
        assert len(both) == 5, both  # create-symlinks ... update-application-profile


@needs_root
def test_shared_claims_get_the_userspace_of_a_plain_claim_and_their_own_edits(
    specs: Specs,
) -> None:
    """MPS and TimeSlicing, on a whole GPU and on a MIG device: the same common edits, device
    nodes and hooks as the device's plain claim; MPS adds its daemon's pipe directory, shm and
    CUDA_MPS_* variables, TimeSlicing nothing."""
    plain = specs.plain_claims()
    shared = [c for c in specs.claims if c["sharing"] is not None]
    assert sorted(c["sharing"] for c in shared) == ["MPS", "MPS", "TimeSlicing", "TimeSlicing"]
    for claim in shared:
        common, device = ours(claim)
        plain_common, plain_device = ours(plain[claim["uuid"]])
        assert common == plain_common, claim["label"]
        view, plain_view = (
            container_view(common, device),
            container_view(plain_common, plain_device),
        )
        assert plain_view - view == Counter(), claim["label"]
        extra = {(i.aspect, i.key) for i in view - plain_view}
        if claim["sharing"] == "TimeSlicing":
            assert extra == set(), claim["label"]
        else:
            assert {("mount", "/tmp/nvidia-mps"), ("mount", "/dev/shm")} <= extra
            assert all(a == "mount" or k.startswith("CUDA_MPS_") for a, k in extra), extra
