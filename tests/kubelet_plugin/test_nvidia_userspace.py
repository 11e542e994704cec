"""The driver userspace a real GPU container gets, found in a small fake driver root.

The root (tests/kubelet_plugin/fake_driver_root.py) has real ELF libraries with sonames, the cache
``ldconfig -r`` made, binaries, firmware, a persistenced socket, device nodes and a DRM sysfs
entry. The expected values below are NVIDIA's rules (nvidia-container-toolkit v1.20.1) spelled
out for that root.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

import pytest

from gpu_dra.kubelet_plugin.cdi import CdiDevice, DeviceNode, build_claim_spec
from gpu_dra.kubelet_plugin.nvidia_driver_root import (
    DriverRoot,
    DriverUserspaceError,
    resolve_in_root,
)
from gpu_dra.kubelet_plugin.nvidia_userspace import (
    CommonEdits,
    DriverUserspace,
    discover_userspace,
    gpu_device_edits,
    hook_name,
    mig_capability_nodes,
    nvidia_caps_major,
)
from tests.kubelet_plugin.fake_driver_root import (
    CAPS_MAJOR,
    LIB_DIR,
    PCI_BUS_ID,
    VERSION,
    FakeDriverRoot,
    add_version,
    build_driver_root,
    run_ldconfig,
)

UID = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
HOOK = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
GPU_OPERATOR_ROOT = PurePosixPath("/run/nvidia/driver")
KERNEL = "6.1.0-test"
LIBRARIES = [
    f"{LIB_DIR}/libcuda.so.{VERSION}",
    f"{LIB_DIR}/libnvidia-ml.so.{VERSION}",
    f"{LIB_DIR}/libnvidia-ptxjitcompiler.so.{VERSION}",
    f"{LIB_DIR}/vdpau/libvdpau_nvidia.so.{VERSION}",
    f"{LIB_DIR}/libnvidia-nvvm70.so.4",
]
LIBRARY_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")
HOST_ROOT = PurePosixPath("/")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> FakeDriverRoot:
    return build_driver_root(tmp_path_factory.mktemp("driver"))


def root_of(fake: FakeDriverRoot, host: PurePosixPath = HOST_ROOT) -> DriverRoot:
    """The fake root as the plugin sees it (a mount), standing for the host's `host`."""
    return DriverRoot(fake.root, host, sysfs=fake.sysfs, proc=fake.proc)


def discover(fake: FakeDriverRoot, host: PurePosixPath = HOST_ROOT) -> DriverUserspace:
    return discover_userspace(root_of(fake, host), VERSION, hook_path=HOOK, kernel_release=KERNEL)


def host(prefix: PurePosixPath, path: str) -> str:
    return str(prefix / path.lstrip("/"))


def hook_args(userspace: DriverUserspace) -> dict[str, tuple[str, ...]]:
    return {hook_name(h): h.args for h in userspace.hooks}


# ---- libraries -------------------------------------------------------------------------------


@pytest.mark.parametrize("host_root", ["/", "/run/nvidia/driver"])
def test_libraries_of_the_driver_version_are_mounted_from_the_host_driver_root(
    fake: FakeDriverRoot, host_root: str
) -> None:
    userspace = discover(fake, PurePosixPath(host_root))

    assert [m.container_path for m in userspace.libraries] == LIBRARIES
    assert [m.host_path for m in userspace.libraries] == [
        host(PurePosixPath(host_root), path) for path in LIBRARIES
    ]
    assert {m.options for m in userspace.libraries} == {LIBRARY_OPTIONS}
    assert userspace.library_dirs == (LIB_DIR,)
    assert userspace.env == {"NVIDIA_CTK_LIBCUDA_DIR": LIB_DIR, "NVIDIA_VISIBLE_DEVICES": "void"}
    assert not [m for m in userspace.libraries if "libother" in m.container_path]


def test_libraries_outside_the_standard_directories_are_found_through_the_ld_cache(
    tmp_path: Path,
) -> None:
    fake = build_driver_root(tmp_path, lib_dir="/opt/nvidia/lib64")

    userspace = discover(fake)

    assert [m.container_path for m in userspace.libraries] == [
        path.replace(LIB_DIR, "/opt/nvidia/lib64") for path in LIBRARIES
    ]
    # Without the cache nothing points there: the root has no library of the version.
    (fake.root / "etc/ld.so.cache").unlink()
    with pytest.raises(DriverUserspaceError) as error:
        discover(fake)
    message = str(error.value)
    assert f"no library of NVIDIA driver {VERSION}" in message
    assert str(fake.root) in message
    assert str(fake.root / "etc/ld.so.cache") in message


def test_a_version_without_libraries_is_an_error(fake: FakeDriverRoot) -> None:
    with pytest.raises(DriverUserspaceError, match=r"no library of NVIDIA driver 999\.1\.2"):
        discover_userspace(root_of(fake), "999.1.2")


def test_a_malformed_ld_cache_is_logged_and_libraries_still_come_from_standard_dirs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = build_driver_root(tmp_path)
    (fake.root / "etc/ld.so.cache").write_bytes(b"garbage")

    userspace = discover(fake)
    assert [m.container_path for m in userspace.libraries] == LIBRARIES

    # Only a root without libraries in the standard directories reads the cache.
    moved = build_driver_root(tmp_path / "moved", lib_dir="/opt/lib")
    (moved.root / "etc/ld.so.cache").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING), pytest.raises(DriverUserspaceError):
        discover(moved)
    assert f"{moved.root / 'etc/ld.so.cache'}: not an ld.so.cache" in caplog.text


def test_absolute_symlinks_resolve_inside_the_driver_root(tmp_path: Path) -> None:
    fake = build_driver_root(tmp_path)
    libs = fake.root / LIB_DIR.lstrip("/")
    real = fake.root / "opt/driver"
    real.mkdir(parents=True)
    shutil.move(libs / f"libnvidia-ml.so.{VERSION}", real / f"libnvidia-ml.so.{VERSION}")
    # An absolute target names the root's /opt, not the plugin's.
    (libs / f"libnvidia-ml.so.{VERSION}").symlink_to(f"/opt/driver/libnvidia-ml.so.{VERSION}")

    userspace = discover(fake, GPU_OPERATOR_ROOT)

    (nvml,) = [m for m in userspace.libraries if "libnvidia-ml" in m.container_path]
    assert nvml.container_path == f"/opt/driver/libnvidia-ml.so.{VERSION}"
    assert nvml.host_path == f"/run/nvidia/driver/opt/driver/libnvidia-ml.so.{VERSION}"
    assert resolve_in_root(fake.root, PurePosixPath("/opt/../opt/driver")) == PurePosixPath(
        "/opt/driver"
    )
    (fake.root / "loop").symlink_to("/loop")
    assert resolve_in_root(fake.root, PurePosixPath("/loop/x")) is None


# ---- binaries, firmware, IPC -----------------------------------------------------------------


def test_driver_binaries_are_the_executables_in_the_bin_dirs(fake: FakeDriverRoot) -> None:
    userspace = discover(fake, GPU_OPERATOR_ROOT)

    assert {m.container_path: m.host_path for m in userspace.binaries} == {
        "/usr/bin/nvidia-smi": "/run/nvidia/driver/usr/bin/nvidia-smi",
        "/usr/bin/nvidia-debugdump": "/run/nvidia/driver/usr/bin/nvidia-debugdump",
        "/usr/bin/nvidia-cuda-mps-control": "/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control",
        "/usr/sbin/nvidia-cuda-mps-server": "/run/nvidia/driver/usr/sbin/nvidia-cuda-mps-server",
    }  # nvidia-persistenced is missing; nvidia-imex is not executable


def test_a_wrapper_script_is_skipped_for_the_program_in_the_driver_bundle(
    fake: FakeDriverRoot, caplog: pytest.LogCaptureFixture
) -> None:
    # As on a real GPU sandbox: /usr/bin/nvidia-smi is a script that execs the bundle's program
    # from /usr/local/nvidia/bin, a path a container of the claim would not have.
    wrapper = fake.root / "usr/bin/nvidia-smi"
    wrapper.write_text('#!/bin/sh\nexec /usr/local/nvidia/bin/nvidia-smi "$@"\n')
    bundle = fake.root / "usr/local/nvidia/bin/nvidia-smi"
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(b"\x7fELF" + bytes(60))
    bundle.chmod(0o755)

    with caplog.at_level(logging.INFO):
        userspace = discover(fake, GPU_OPERATOR_ROOT)

    (smi,) = [m for m in userspace.binaries if m.container_path.endswith("/nvidia-smi")]
    assert (smi.container_path, smi.host_path) == (
        "/usr/local/nvidia/bin/nvidia-smi",
        "/run/nvidia/driver/usr/local/nvidia/bin/nvidia-smi",
    )
    assert f"driver binary {wrapper} is not an ELF program: skipped" in caplog.text


def test_gsp_firmware_of_the_driver_version_is_mounted(fake: FakeDriverRoot) -> None:
    userspace = discover(fake, GPU_OPERATOR_ROOT)

    firmware = f"/lib/firmware/nvidia/{VERSION}"
    assert [(m.container_path, m.host_path) for m in userspace.firmware] == [
        (f"{firmware}/gsp_ga10x.bin", f"/run/nvidia/driver{firmware}/gsp_ga10x.bin"),
        (f"{firmware}/gsp_tu10x.bin", f"/run/nvidia/driver{firmware}/gsp_tu10x.bin"),
    ]


def test_firmware_search_follows_the_kernel_and_the_custom_class_path(tmp_path: Path) -> None:
    fake = build_driver_root(tmp_path)
    custom = fake.root / "opt/fw/nvidia" / VERSION
    custom.mkdir(parents=True)
    (custom / "gsp_custom.bin").write_bytes(b"\0")
    updates = fake.root / "lib/firmware/updates" / KERNEL / "nvidia" / VERSION
    updates.mkdir(parents=True)
    (updates / "gsp_ga10x.bin").write_bytes(b"\0")
    (updates / "ucodes_ga10x.bin").write_bytes(b"\0")
    class_path = fake.sysfs / "module/firmware_class/parameters/path"
    class_path.parent.mkdir(parents=True)
    class_path.write_text("/opt/fw\n")

    paths = [m.container_path for m in discover(fake).firmware]

    assert paths == [
        f"/opt/fw/nvidia/{VERSION}/gsp_custom.bin",
        f"/lib/firmware/updates/{KERNEL}/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
        f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin",
        f"/lib/firmware/updates/{KERNEL}/nvidia/{VERSION}/ucodes_ga10x.bin",
    ]


def test_ipc_sockets_present_are_mounted_and_the_host_mps_directory_is_not(
    fake: FakeDriverRoot,
) -> None:
    (fake.root / "tmp/nvidia-mps").mkdir(parents=True, exist_ok=True)

    userspace = discover(fake, GPU_OPERATOR_ROOT)

    assert [(m.container_path, m.host_path, m.options) for m in userspace.ipc] == [
        (
            "/run/nvidia-persistenced/socket",
            "/run/nvidia/driver/run/nvidia-persistenced/socket",
            ("nosuid", "nodev", "rbind", "rprivate", "noexec"),
        )
    ]
    assert not [m for m in userspace.edits().mounts if "nvidia-mps" in m.container_path]


# ---- device nodes ------------------------------------------------------------------------------


def test_control_nodes_present_are_injected_and_missing_ones_logged(
    fake: FakeDriverRoot, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        userspace = discover(fake, GPU_OPERATOR_ROOT)

    assert userspace.edits().device_nodes == (
        DeviceNode("/dev/nvidia-uvm", "/run/nvidia/driver/dev/nvidia-uvm", permissions="rw"),
        DeviceNode("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl", permissions="rw"),
    )
    for missing in ("nvidia-modeset", "nvidia-uvm-tools"):
        assert f"control device node {fake.root}/dev/{missing} not found" in caplog.text


def test_with_a_host_root_of_slash_device_nodes_need_no_host_path(fake: FakeDriverRoot) -> None:
    nodes = discover(fake).control_nodes

    assert {n.host_path for n in nodes} == {None}


def test_a_driver_root_without_dev_nvidiactl_takes_device_nodes_from_slash_dev(
    tmp_path: Path,
) -> None:
    root = DriverRoot(tmp_path, GPU_OPERATOR_ROOT)

    dev = root.dev_root()

    assert (dev.path, dev.host_path) == (Path("/"), PurePosixPath("/"))
    (tmp_path / "dev").mkdir()
    # an empty /dev in a driver bundle, as on a real GPU sandbox: still /dev
    assert root.dev_root().path == Path("/")
    (tmp_path / "dev" / "nvidiactl").touch()
    assert root.dev_root() == root


def test_a_gpu_gets_its_node_its_drm_nodes_and_their_by_path_links(fake: FakeDriverRoot) -> None:
    edits = gpu_device_edits(root_of(fake, GPU_OPERATOR_ROOT), 0, PCI_BUS_ID, hook_path=HOOK)

    assert [(n.path, n.host_path) for n in edits.device_nodes] == [
        ("/dev/nvidia0", "/run/nvidia/driver/dev/nvidia0"),
        ("/dev/dri/card1", "/run/nvidia/driver/dev/dri/card1"),
        ("/dev/dri/renderD128", "/run/nvidia/driver/dev/dri/renderD128"),
    ]
    (hook,) = edits.hooks
    assert (hook.hook_name, hook.path, hook.env) == (
        "createContainer",
        HOOK,
        ("NVIDIA_CTK_DEBUG=false",),
    )
    assert hook.args == (
        "nvidia-cdi-hook",
        "create-symlinks",
        "--link",
        f"../card1::/dev/dri/by-path/pci-{PCI_BUS_ID}-card",
        "--link",
        f"../renderD128::/dev/dri/by-path/pci-{PCI_BUS_ID}-render",
    )


def test_missing_gpu_nodes_are_left_out_with_a_log_line(
    fake: FakeDriverRoot, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        edits = gpu_device_edits(root_of(fake), 1, "0000:99:00.0")

    assert edits.device_nodes == ()
    assert edits.hooks == ()
    assert f"device node {fake.root}/dev/nvidia1 not found" in caplog.text


def test_mig_capability_nodes_are_character_devices_with_the_drivers_major(
    fake: FakeDriverRoot,
) -> None:
    nodes = mig_capability_nodes(root_of(fake, GPU_OPERATOR_ROOT), [21, 22])

    assert nodes == tuple(
        DeviceNode(
            path=f"/dev/nvidia-caps/nvidia-cap{minor}",
            host_path=f"/run/nvidia/driver/dev/nvidia-caps/nvidia-cap{minor}",
            permissions="rw",
            type="c",
            major=CAPS_MAJOR,
            minor=minor,
            file_mode=0o444,
        )
        for minor in (21, 22)
    )
    assert not (fake.root / "dev/nvidia-caps").exists()  # they need not exist


def test_the_caps_major_comes_from_the_driver_root_procfs_then_the_plugins(tmp_path: Path) -> None:
    driver_proc = tmp_path / "root/proc"
    own_proc = tmp_path / "proc"
    own_proc.mkdir(parents=True)
    (own_proc / "devices").write_text("Character devices:\n195 nvidia\n511 nvidia-caps\n")

    assert nvidia_caps_major([driver_proc, own_proc]) == 511
    driver_proc.mkdir(parents=True)
    (driver_proc / "devices").write_text("Character devices:\n237 nvidia-caps\n")
    assert nvidia_caps_major([driver_proc, own_proc]) == 237

    (own_proc / "devices").write_text("Character devices:\n\nBlock devices:\n236 nvidia-caps\n")
    with pytest.raises(DriverUserspaceError) as error:
        nvidia_caps_major([tmp_path / "none", own_proc])
    assert str(own_proc / "devices") in str(error.value)


# ---- hooks -------------------------------------------------------------------------------------


def test_hooks_are_nvidias_in_its_order_with_its_arguments(fake: FakeDriverRoot) -> None:
    userspace = discover(fake, GPU_OPERATOR_ROOT)

    assert [h.hook_name for h in userspace.hooks] == ["createContainer"] * 5
    assert {h.path for h in userspace.hooks} == {HOOK}
    assert {h.env for h in userspace.hooks} == {("NVIDIA_CTK_DEBUG=false",)}
    args = hook_args(userspace)
    assert list(args) == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
        "update-application-profile",
    ]
    lib = LIB_DIR
    assert args["create-symlinks"] == (
        "nvidia-cdi-hook",
        "create-symlinks",
        "--link",
        f"libcuda.so.1::{lib}/libcuda.so",
        "--link",
        f"libcuda.so.{VERSION}::{lib}/libcuda.so.1",
        "--link",
        f"libnvidia-ml.so.{VERSION}::{lib}/libnvidia-ml.so.1",
        # no libnvidia-ml.so link: the root has none
        "--link",
        f"libnvidia-ptxjitcompiler.so.{VERSION}::{lib}/libnvidia-ptxjitcompiler.so.1",
        "--link",
        f"libnvidia-ptxjitcompiler.so.1::{lib}/libnvidia-ptxjitcompiler.so",
        "--link",
        f"libvdpau_nvidia.so.{VERSION}::{lib}/vdpau/libvdpau_nvidia.so.1",
    )
    assert args["enable-cuda-compat"] == (
        "nvidia-cdi-hook",
        "enable-cuda-compat",
        f"--host-driver-version={VERSION}",
    )
    assert args["update-ldcache"] == (
        "nvidia-cdi-hook",
        "update-ldcache",
        "--folder",
        lib,
        "--folder",
        f"{lib}/vdpau",
    )
    assert args["disable-device-node-modification"] == (
        "nvidia-cdi-hook",
        "disable-device-node-modification",
    )


def test_hooks_can_be_left_out_and_nvidia_ctk_runs_them_as_a_subcommand(
    fake: FakeDriverRoot,
) -> None:
    userspace = discover_userspace(
        root_of(fake),
        VERSION,
        hook_path="/usr/bin/nvidia-ctk",
        disabled_hooks={"update-application-profile", "enable-cuda-compat"},
    )

    assert [h.args[:3] for h in userspace.hooks] == [
        ("nvidia-ctk", "hook", "create-symlinks"),
        ("nvidia-ctk", "hook", "update-ldcache"),
        ("nvidia-ctk", "hook", "disable-device-node-modification"),
    ]
    assert discover_userspace(root_of(fake), VERSION, disabled_hooks={"all"}).hooks == ()
    with pytest.raises(ValueError, match="absolute"):
        discover_userspace(root_of(fake), VERSION, hook_path="nvidia-cdi-hook")


# ---- the spec ----------------------------------------------------------------------------------


def test_common_edits_and_a_gpu_make_a_valid_spec_sorted_as_nvidias(fake: FakeDriverRoot) -> None:
    root = root_of(fake, GPU_OPERATOR_ROOT)
    common = discover_userspace(root, VERSION, kernel_release=KERNEL).edits()
    device = CdiDevice("gpu-0", gpu_device_edits(root, 0, PCI_BUS_ID))

    spec = build_claim_spec(UID, [device], common_edits=common)

    paths = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert paths == sorted(paths, key=lambda p: (p.count("/"), p))
    assert paths[0] == "/run/nvidia-persistenced/socket"
    # As NVIDIA's: void keeps nvidia-container-runtime's legacy hook from adding GPUs that a
    # CUDA image's NVIDIA_VISIBLE_DEVICES=all asks for.
    assert spec["containerEdits"]["env"] == [
        f"NVIDIA_CTK_LIBCUDA_DIR={LIB_DIR}",
        "NVIDIA_VISIBLE_DEVICES=void",
    ]
    assert [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia0",
        "/dev/dri/card1",
        "/dev/dri/renderD128",
    ]


# ---- kept current ------------------------------------------------------------------------------


class Versions:
    """The driver version source: what NVML would answer, counted."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        return self.version


def test_common_edits_are_computed_once_and_again_after_a_driver_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = build_driver_root(tmp_path)
    versions = Versions(VERSION)
    common = CommonEdits(root_of(fake, GPU_OPERATOR_ROOT), versions, kernel_release=KERNEL)

    with caplog.at_level(logging.INFO):
        first = common.current()
        assert common.current() is first
    assert versions.calls == 1
    assert "driver userspace found: driver 550.54.15" in caplog.text

    # An upgrade: new libraries, ldconfig rewrites the cache, NVML reports the new version.
    add_version(fake.root, "560.35.03")
    for old in (fake.root / LIB_DIR.lstrip("/")).glob(f"*.so.{VERSION}"):
        old.unlink()
    run_ldconfig(fake.root)
    versions.version = "560.35.03"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = common.current()

    assert versions.calls == 2
    assert "driver userspace changed, recomputed: driver 560.35.03" in caplog.text
    assert [m.container_path for m in second.mounts if "libcuda" in m.container_path] == [
        f"{LIB_DIR}/libcuda.so.560.35.03"
    ]
    enable_compat = [h for h in second.hooks if hook_name(h) == "enable-cuda-compat"]
    assert enable_compat[0].args[-1] == "--host-driver-version=560.35.03"
    assert common.current() is second
    assert versions.calls == 2


def test_a_failing_version_source_fails_with_its_message_and_is_retried(tmp_path: Path) -> None:
    fake = build_driver_root(tmp_path)
    calls = []

    def version() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Driver Not Loaded")
        return VERSION

    common = CommonEdits(root_of(fake), version)

    with pytest.raises(DriverUserspaceError, match="cannot read the driver version: Driver Not"):
        common.current()
    assert common.current().env["NVIDIA_CTK_LIBCUDA_DIR"] == LIB_DIR
    assert common.userspace is not None
    assert common.userspace.version == VERSION


def test_fake_root_device_nodes_are_real_character_devices(fake: FakeDriverRoot) -> None:
    """The fixture's nodes are what the rules look for (made with mknod, as root)."""
    mode = os.lstat(fake.root / "dev/nvidia0").st_mode
    assert stat.S_ISCHR(mode)
