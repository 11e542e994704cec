"""Per-claim CDI specs: content, file naming, atomic replacement and name validation."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

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
from tests.fuzzing import cases

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


# What PyYAML writes, with the dumper and options the store uses.
DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# A real node's spec: the driver's userspace as common edits (library mounts, symlink hooks).
USERSPACE = ContainerEdits(
    env={"NVIDIA_DRIVER_CAPABILITIES": "compute,utility", "NVIDIA_CTK_LIBCUDA_DIR": "/usr/lib64"},
    device_nodes=(
        DeviceNode("/dev/nvidiactl", type="c", major=195, minor=255, file_mode=0o666),
        DeviceNode("/dev/nvidia-uvm", type="c", major=507, minor=0, permissions="rwm"),
    ),
    mounts=tuple(
        Mount(
            f"/run/nvidia/driver/usr/lib64/lib{name}.so.570.86.15",
            f"/usr/lib64/lib{name}.so.570.86.15",
            options=("ro", "nosuid", "nodev", "rbind", "rprivate"),
        )
        for name in ("cuda", "nvidia-ml", "nvidia-ptxjitcompiler", "nvidia-nvvm")
    ),
    hooks=(
        Hook(
            "createContainer",
            "/usr/bin/nvidia-cdi-hook",
            args=(
                "nvidia-cdi-hook",
                "create-symlinks",
                "--link",
                "libcuda.so.1::/usr/lib64/libcuda.so",
            ),
            env=("NVIDIA_CTK_DEBUG=false",),
            timeout_s=10,
        ),
        Hook(
            "createContainer",
            "/usr/bin/nvidia-cdi-hook",
            args=("nvidia-cdi-hook", "update-ldcache"),
        ),
    ),
)


def test_spec_file_holds_what_pyyaml_writes(tmp_path: Path) -> None:
    store = ClaimSpecStore(tmp_path)
    for devices, common in (([GPU0], None), ([GPU0, MIG], COMMON), ([GPU0, MIG], USERSPACE)):
        spec = build_claim_spec(UID, devices, common_edits=common)
        path = store.write(UID, devices, common_edits=common)
        assert path.read_text() == yaml.dump(
            spec, Dumper=DUMPER, sort_keys=False, default_flow_style=False
        )


# Text that a YAML emitter must quote, or that a reader would take for another type.
TRICKY = [
    "true",
    "No",
    "~",
    "null",
    "1",
    "-1",
    "0x1F",
    "1_000",
    "1:20",
    "0.5",
    ".inf",
    "=",
    "-",
    "--link",
    "a::b",
    "a:",
    ":a",
    "a: b",
    "a #b",
    "a#b",
    "#a",
    "@a",
    "a,b",
    "[a]",
    "{a}",
    "'a'",
    '"a"',
    "!a",
    "&a",
    "*a",
    "|a",
    ">a",
    "%a",
    "`a",
    "?a",
    "---a",
    "...a",
    "<<",
    "2001-12-14",
    " a",
    "a ",
    "a\tb",
    "é",
    "a\nb",
    "x" * 100,
    "x " * 50,
    "",
    "a  b",
    "- a",
    "NVIDIA H100 80GB HBM3",
    *("a" * n + " b" for n in range(66, 80)),  # around the emitter's 80 columns
]


@pytest.mark.parametrize("text", TRICKY)
def test_spec_file_holds_what_pyyaml_writes_for_text_to_quote(tmp_path: Path, text: str) -> None:
    edits = ContainerEdits(env={"A": text}, mounts=(Mount("/a", "/b", options=("ro", text)),))
    spec = build_claim_spec(UID, [CdiDevice("gpu-0", edits)])
    path = ClaimSpecStore(tmp_path).write(UID, [CdiDevice("gpu-0", edits)])
    assert path.read_text() == yaml.dump(
        spec, Dumper=DUMPER, sort_keys=False, default_flow_style=False
    )


# Text the store writes itself (letters, digits, "-_./=+:, "), and any text: half of the specs hold
# only the former, so that they are written without PyYAML.
plain = st.text(alphabet=st.sampled_from("aZ09-_./=+:, "), min_size=1, max_size=12) | st.text(
    alphabet=st.sampled_from("a "), min_size=60, max_size=90
)
tricky = st.sampled_from(TRICKY) | st.text(
    alphabet=st.sampled_from("aZ09-_./=+:,# @'\"!&*?[]{}|>%`~\té"), max_size=12
)


def edits(scalars: st.SearchStrategy[str]) -> st.SearchStrategy[ContainerEdits]:
    absolute = scalars.map(lambda text: "/" + text)
    return st.builds(
        ContainerEdits,
        env=st.dictionaries(
            scalars.filter(lambda key: key != "" and "=" not in key), scalars, max_size=3
        ),
        device_nodes=st.lists(
            st.builds(
                DeviceNode,
                absolute,
                host_path=st.none() | absolute,
                permissions=st.none() | st.sampled_from(["r", "rw", "rwm"]),
                type=st.none() | st.just("c"),
                major=st.none() | st.integers(0, 2**32 - 1),
            ).filter(lambda node: node.major is None or node.type is not None),
            max_size=2,
        ).map(tuple),
        mounts=st.lists(
            st.builds(Mount, absolute, absolute, options=st.lists(scalars, max_size=3).map(tuple)),
            max_size=2,
        ).map(tuple),
        hooks=st.lists(
            st.builds(
                Hook,
                scalars,
                absolute,
                args=st.lists(scalars, max_size=3).map(tuple),
                env=st.lists(scalars, max_size=2).map(tuple),
                timeout_s=st.none() | st.integers(1, 60),
            ),
            max_size=2,
        ).map(tuple),
    ).filter(lambda edits: not edits.is_empty())


specs = st.one_of(
    *(
        st.tuples(st.lists(edits(text), min_size=1, max_size=2), st.none() | edits(text))
        for text in (plain, plain | tricky)
    )
)


@cases(ci=100, full=5_000)
@given(spec_edits=specs)
def test_spec_file_holds_what_pyyaml_writes_for_any_text(
    spec_edits: tuple[list[ContainerEdits], ContainerEdits | None],
) -> None:
    device_edits, common = spec_edits
    devices = [CdiDevice(f"gpu-{i}", e) for i, e in enumerate(device_edits)]
    spec = build_claim_spec(UID, devices, common_edits=common)
    with tempfile.TemporaryDirectory() as directory:
        path = ClaimSpecStore(Path(directory)).write(UID, devices, common_edits=common)
        assert path.read_text() == yaml.dump(
            spec, Dumper=DUMPER, sort_keys=False, default_flow_style=False
        )


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
