"""Per-claim CDI specs: content, file naming, atomic replacement and name validation."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from gpu_dra.kubelet_plugin.cdi import (
    CDI_VERSION,
    CdiDevice,
    ClaimSpecStore,
    ContainerEdits,
    DeviceNode,
    Hook,
    InvalidNameError,
    Mount,
    build_claim_spec,
    qualified_device_id,
)

UID = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
OTHER_UID = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"

GPU0 = CdiDevice(
    "gpu-0",
    ContainerEdits(
        env={"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa", "CUDA_MPS_PIPE_DIRECTORY": "/mps/pipe"},
        device_nodes=(DeviceNode("/dev/nvidia0"),),
        mounts=(Mount("/run/mps/claim", "/mps", options=("rw", "bind")),),
    ),
)
MIG = CdiDevice(
    "gpu-1-mig-1g10gb-19-0",
    ContainerEdits(
        device_nodes=(
            DeviceNode("/dev/nvidia1"),
            DeviceNode("/dev/nvidia-caps/nvidia-cap21", host_path="/dev/nvidia-caps/nvidia-cap21"),
        ),
    ),
)
COMMON = ContainerEdits(
    device_nodes=(DeviceNode("/dev/nvidiactl", permissions="rw"),),
    hooks=(Hook("createContainer", "/usr/bin/nvidia-cdi-hook", args=("ldconfig",)),),
)


def test_spec_has_claim_kind_and_one_device_per_prepared_device() -> None:
    spec = build_claim_spec(UID, [GPU0, MIG], common_edits=COMMON)
    assert spec == {
        "cdiVersion": CDI_VERSION,
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [
            {
                "name": f"{UID}-gpu-0",
                "containerEdits": {
                    "env": ["NVIDIA_VISIBLE_DEVICES=GPU-aaaa", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe"],
                    "deviceNodes": [{"path": "/dev/nvidia0"}],
                    "mounts": [
                        {
                            "hostPath": "/run/mps/claim",
                            "containerPath": "/mps",
                            "options": ["rw", "bind"],
                        }
                    ],
                },
            },
            {
                "name": f"{UID}-gpu-1-mig-1g10gb-19-0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/nvidia1"},
                        {
                            "path": "/dev/nvidia-caps/nvidia-cap21",
                            "hostPath": "/dev/nvidia-caps/nvidia-cap21",
                        },
                    ]
                },
            },
        ],
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidiactl", "permissions": "rw"}],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["ldconfig"],
                }
            ],
        },
    }


def test_qualified_id_names_the_device_in_the_claim_spec() -> None:
    assert qualified_device_id(UID, "gpu-0") == f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"
    spec = build_claim_spec(UID, [GPU0])
    kind, name = qualified_device_id(UID, "gpu-0").split("=")
    assert (kind, name) == (spec["kind"], spec["devices"][0]["name"])


def test_vendor_follows_the_driver_name() -> None:
    spec = build_claim_spec(UID, [GPU0], driver_name="gpu.example.com")
    assert spec["kind"] == "k8s.gpu.example.com/claim"
    assert qualified_device_id(UID, "gpu-0", "gpu.example.com").startswith(
        "k8s.gpu.example.com/claim="
    )


@pytest.mark.parametrize(
    "edits",
    [
        ContainerEdits(env={"A=B": "x"}),
        ContainerEdits(env={"": "x"}),
        ContainerEdits(device_nodes=(DeviceNode("dev/nvidia0"),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0", permissions="rwx"),)),
        ContainerEdits(mounts=(Mount("relative", "/x"),)),
        ContainerEdits(hooks=(Hook("createContainer", "/bin/hook", timeout_s=0),)),
        ContainerEdits(),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="s", major=1, minor=0),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", major=236, minor=3),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="p", major=1),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=-1, minor=0),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=1, minor=True),)),
        ContainerEdits(device_nodes=(DeviceNode("/dev/x", type="c", major=1, file_mode=0o10000),)),
    ],
    ids=[
        "env-key-with-equals",
        "empty-env-key",
        "relative-node",
        "bad-perms",
        "relative-mount",
        "zero-timeout",
        "no-edits",
        "unknown-node-type",
        "numbers-without-type",
        "fifo-with-major",
        "negative-major",
        "bool-minor",
        "file-type-bits-in-mode",
    ],
)
def test_invalid_container_edits_are_rejected(edits: ContainerEdits) -> None:
    with pytest.raises(ValueError, match=UID):
        build_claim_spec(UID, [CdiDevice("gpu-0", edits)])


def test_device_nodes_can_be_given_by_type_and_numbers() -> None:
    """A MIG capability node need not exist on the host: type, major and minor make it."""
    cap = DeviceNode(
        "/dev/nvidia-caps/nvidia-cap21",
        host_path="/run/nvidia/driver/dev/nvidia-caps/nvidia-cap21",
        permissions="rw",
        type="c",
        major=236,
        minor=21,
        file_mode=0o444,
    )

    spec = build_claim_spec(UID, [CdiDevice("gpu-0", ContainerEdits(device_nodes=(cap,)))])

    node = spec["devices"][0]["containerEdits"]["deviceNodes"][0]
    assert node == {
        "path": "/dev/nvidia-caps/nvidia-cap21",
        "hostPath": "/run/nvidia/driver/dev/nvidia-caps/nvidia-cap21",
        "type": "c",
        "major": 236,
        "minor": 21,
        "fileMode": 0o444,
        "permissions": "rw",
    }
    assert spec["cdiVersion"] == "0.5.0"  # type/major/minor/fileMode exist since 0.3.0


def test_spec_without_devices_or_with_duplicates_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        build_claim_spec(UID, [])
    with pytest.raises(ValueError, match="duplicate"):
        build_claim_spec(UID, [GPU0, GPU0])


# --- names that could escape the CDI directory ----------------------------------------


@pytest.mark.parametrize(
    "claim_uid",
    ["../../etc", "../" + UID, UID.upper(), f"{UID}/x", "", "not-a-uuid", f"{UID}\n"],
)
def test_claim_uid_that_is_not_a_uuid_never_becomes_a_path(tmp_path: Path, claim_uid: str) -> None:
    store = ClaimSpecStore(tmp_path / "cdi")
    with pytest.raises(InvalidNameError):
        store.write(claim_uid, [GPU0])
    with pytest.raises(InvalidNameError):
        store.remove(claim_uid)
    with pytest.raises(InvalidNameError):
        build_claim_spec(claim_uid, [GPU0])
    assert not (tmp_path / "cdi").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "device_name", ["../gpu-0", "GPU-0", "gpu_0", "gpu-0-", "a" * 64, "gpu-0\n", ""]
)
def test_device_name_that_is_not_a_dns_label_is_rejected(device_name: str) -> None:
    with pytest.raises(InvalidNameError):
        build_claim_spec(UID, [CdiDevice(device_name, GPU0.edits)])
    with pytest.raises(InvalidNameError):
        qualified_device_id(UID, device_name)


# --- files ----------------------------------------------------------------------------


def test_spec_file_is_named_after_vendor_class_and_claim_uid(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path / "cdi")
    path = store.write(UID, [GPU0])
    assert path == tmp_path / "cdi" / f"k8s.gpu.nvidia.com-claim_{UID}.yaml"
    assert yaml.safe_load(path.read_text()) == build_claim_spec(UID, [GPU0])
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_rewriting_a_spec_replaces_it_atomically(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    path = store.write(UID, [GPU0])
    with path.open() as reader_of_old_version:
        store.write(UID, [GPU0, MIG])
        old = yaml.safe_load(reader_of_old_version.read())
    assert len(old["devices"]) == 1
    assert len(yaml.safe_load(path.read_text())["devices"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_failed_write_leaves_the_previous_spec_in_place(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    path = store.write(UID, [GPU0])
    before = path.read_bytes()
    with pytest.raises(ValueError, match="absolute"):
        store.write(UID, [CdiDevice("gpu-0", ContainerEdits(mounts=(Mount("a", "/b"),)))])
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_mounts_of_given_host_paths_are_made_read_only_and_nothing_else(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    shared = ContainerEdits(mounts=(Mount("/run/mps/claim", "/common", options=("rw",)),))
    store.write(UID, [GPU0, MIG], common_edits=shared)
    assert store.make_mounts_read_only(OTHER_UID, ["/run/mps/claim"]) == []  # no spec

    changed = store.make_mounts_read_only(UID, ["/run/mps/claim"])

    assert changed == ["common: /common", f"{UID}-gpu-0: /mps"]
    spec = yaml.safe_load(store.path_for(UID).read_text())
    assert spec["containerEdits"]["mounts"][0]["options"] == ["ro"]
    assert spec["devices"][0]["containerEdits"]["mounts"][0]["options"] == ["ro", "bind"]
    assert spec["devices"][1] == build_claim_spec(UID, [GPU0, MIG])["devices"][1]
    before = store.path_for(UID).read_bytes()
    assert store.make_mounts_read_only(UID, ["/run/mps/claim"]) == []  # nothing left to do
    assert store.make_mounts_read_only(UID, ["/elsewhere"]) == []
    assert store.path_for(UID).read_bytes() == before


def test_remove_is_idempotent(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    store.write(UID, [GPU0])
    assert store.remove(UID) is True
    assert store.remove(UID) is False
    assert list(tmp_path.iterdir()) == []


def test_listing_finds_only_this_drivers_claim_specs(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    store.write(UID, [GPU0])
    store.write(OTHER_UID, [MIG])
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    (tmp_path / f"k8s.gpu.example.com-claim_{UID}.yaml").write_text("{}\n")
    (tmp_path / f".k8s.gpu.nvidia.com-claim_{UID}.yaml.abc.tmp").write_text("")
    assert store.claim_uids() == sorted([UID, OTHER_UID])


def test_listing_a_missing_cdi_root_is_empty(tmp_path: Path) -> None:
    assert ClaimSpecStore(tmp_path / "absent").claim_uids() == []
