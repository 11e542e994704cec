"""The fake driver root of the real-mode e2e tests (e2e/driverroot.py), built in a temporary
directory without a cluster: libraries in the root's ld cache under their SONAMEs, nvidia-smi
through the root's NVML (the NVML mock of e2e/nvmlmock.py, a dgxh100), device nodes, procfs files,
rebuild and teardown. What nvidia-smi prints is compared with what the library reports through
ctypes. Needs root (mknod, ``ldconfig -r``), gcc, binutils' readelf and Go (the mock is built
into the e2e cache unless it is there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from e2e import driverroot, nvmlmock
from e2e.cluster.paths import ClusterPaths
from e2e.driverroot import LIBRARIES, NVML, DriverRoot, build_driver_root, remove_driver_root
from gpu_dra.kubelet_plugin.node_devices import ProcMigCapabilities

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mknod and ldconfig -r need root (the e2e tooling runs as root)"
)

VERSION = "550.54.15"
MACHINE = "dgxh100"
MINORS = tuple(range(8))
MIG_GPU = 1
DRIVER_NOT_LOADED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> ClusterPaths:
    """A cache of its own, so that the compile and its caching are tested."""
    base = tmp_path_factory.mktemp("cluster")
    return ClusterPaths(cache=base / "cache", state=base / "state")


@pytest.fixture(scope="module")
def nvml_library() -> Path:
    """The NVML mock library, from the e2e cache (built there unless cached)."""
    return nvmlmock.build(ClusterPaths.from_env())


def build(dest: Path, nvml_library: Path, paths: ClusterPaths) -> DriverRoot:
    return build_driver_root(
        dest,
        nvml_library=nvml_library,
        machine=MACHINE,
        gpu_minors=MINORS,
        driver_version=VERSION,
        paths=paths,
    )


@pytest.fixture(scope="module")
def root(
    tmp_path_factory: pytest.TempPathFactory, nvml_library: Path, paths: ClusterPaths
) -> Iterator[DriverRoot]:
    made = build(tmp_path_factory.mktemp("roots") / "driver", nvml_library, paths)
    yield made
    remove_driver_root(made.root)


def mock_env(
    root: DriverRoot,
    *,
    dev_root: Path | None = None,
    state: Path | None = None,
    machine: str | None = MACHINE,
) -> dict[str, str]:
    """This process's environment without loader or mock settings, then the root's library
    directory and the mock's settings (dev root: the driver root unless given)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPU_DRA_NVML_MOCK_") and k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")
    }
    mock = nvmlmock.environment(machine=machine, state=state, dev_root=dev_root or root.root)
    return {**base, **root.tool_env(), **mock}


def run_tool(root: DriverRoot, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(root.bin_dir / args[0]), *args[1:]],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


_MAKE_MIG = r"""
import json, pynvml as n
n.nvmlInit()
gpu = n.nvmlDeviceGetHandleByIndex(int(__import__("sys").argv[1]))
n.nvmlDeviceSetMigMode(gpu, n.NVML_DEVICE_MIG_ENABLE)
made = []
for gi_profile, ci_profile in (
    (n.NVML_GPU_INSTANCE_PROFILE_1_SLICE, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
    (n.NVML_GPU_INSTANCE_PROFILE_1_SLICE, n.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
    (n.NVML_GPU_INSTANCE_PROFILE_3_SLICE, n.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE),
):
    gi_id = n.nvmlDeviceGetGpuInstanceProfileInfo(gpu, gi_profile).id
    gi = n.nvmlDeviceCreateGpuInstance(gpu, gi_id)
    engines = n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    ci_id = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ci_profile, engines).id
    ci = n.nvmlGpuInstanceCreateComputeInstance(gi, ci_id)
    made.append((n.nvmlGpuInstanceGetInfo(gi).id, n.nvmlComputeInstanceGetInfo(ci).id))
n.nvmlShutdown()
print(json.dumps(made))
"""


@pytest.fixture(scope="module")
def mig_state(
    root: DriverRoot, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[tuple[int, int]]]:
    """A mock state file in which GPU `MIG_GPU` is in MIG mode with three MIG devices (1g.10gb,
    1g.10gb, 3g.40gb) made through NVML by pynvml; and their (GPU instance, compute instance)."""
    state = tmp_path_factory.mktemp("mock") / "state.json"
    made = subprocess.run(
        [sys.executable, "-c", _MAKE_MIG, str(MIG_GPU)],
        env=mock_env(root, state=state),
        capture_output=True,
        text=True,
        check=True,
    )
    return state, [(gi, ci) for gi, ci in json.loads(made.stdout)]


ContainerDev = Callable[[Sequence[int], Sequence[tuple[int, int, int]]], Path]


@pytest.fixture
def container_dev(tmp_path: Path, root: DriverRoot) -> Iterator[ContainerDev]:
    """Makes a ``dev/`` as a container given GPUs and MIG devices (GPU minor, GPU instance,
    compute instance) sees it: their nodes only, the MIG capability nodes with the minors of
    ``mig-minors`` (as a CDI spec makes them); returns its parent (the mock's dev root).
    Removed afterwards, device nodes and all."""
    top = tmp_path / "container"

    def make(gpus: Sequence[int], migs: Sequence[tuple[int, int, int]]) -> Path:
        (top / "dev" / "nvidia-caps").mkdir(parents=True)
        for minor in gpus:
            node = top / "dev" / f"nvidia{minor}"
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, minor))
        for gpu, gi, ci in migs:
            for cap in (nvmlmock.mig_cap_minor(gpu, gi), nvmlmock.mig_cap_minor(gpu, gi, ci)):
                node = top / "dev" / "nvidia-caps" / f"nvidia-cap{cap}"
                os.mknod(node, stat.S_IFCHR | 0o400, os.makedev(root.caps_major, cap))
        return top

    yield make
    shutil.rmtree(top, ignore_errors=True)


def readelf(path: Path) -> str:
    return subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout


def ld_cache_entries(root: Path) -> dict[str, str]:
    """``ldconfig -r <root> -p``: library name -> path (x86-64 entries)."""
    listing = subprocess.run(
        ["ldconfig", "-r", str(root), "-p"], capture_output=True, text=True, check=True
    ).stdout
    entries = {}
    for line in listing.splitlines()[1:]:
        match = re.fullmatch(r"\s+(\S+) \(libc6,x86-64\) => (\S+)", line)
        if match:
            entries[match[1]] = match[2]
    return entries


def test_every_library_is_in_the_ld_cache_under_its_soname(root: DriverRoot) -> None:
    entries = ld_cache_entries(root.root)
    lib_dir = "/" + driverroot.LIB_DIR
    for library in LIBRARIES:
        soname = library.soname(VERSION)
        assert entries.pop(soname) == f"{lib_dir}/{soname}"
        if library.dev_link:
            assert entries.pop(f"{library.stem}.so") == f"{lib_dir}/{library.stem}.so"
        # the SONAME resolves to the versioned file, as a .run/.deb install leaves it
        resolved = Path(os.path.realpath(root.lib_dir / soname))
        assert resolved == root.lib_dir / f"{library.stem}.so.{VERSION}"
    assert entries == {}  # nothing else in the cache
    wanted = {
        "libcuda.so.1",
        "libnvidia-ml.so.1",
        "libnvidia-ptxjitcompiler.so.1",
        "libnvidia-nvvm.so.4",
        "libcudadebugger.so.1",
        "libnvidia-opencl.so.1",
        "libnvidia-cfg.so.1",
        "libnvidia-allocator.so.1",
        f"libnvidia-gpucomp.so.{VERSION}",
        f"libnvidia-pkcs11.so.{VERSION}",
        f"libnvidia-pkcs11-openssl3.so.{VERSION}",
    }
    assert {library.soname(VERSION) for library in LIBRARIES} == wanted


def test_the_libraries_are_elf_shared_objects_with_the_real_sonames(
    root: DriverRoot, nvml_library: Path
) -> None:
    for library in LIBRARIES:
        path = root.library(library.stem)
        dynamic = readelf(path)
        assert f"Library soname: [{library.soname(VERSION)}]" in dynamic
        assert driverroot.read_soname(path) == library.soname(VERSION)
        assert path.stat().st_mode & 0o777 == 0o755
    # libnvidia-ml is the NVML library handed in, byte for byte, not a stub
    assert root.nvml_library.read_bytes() == nvml_library.read_bytes()
    assert root.library(NVML.stem) == root.nvml_library


def test_nvidia_smi_is_an_elf_program_linked_against_libnvidia_ml(root: DriverRoot) -> None:
    dynamic = readelf(root.nvidia_smi)
    assert "Shared library: [libnvidia-ml.so.1]" in dynamic
    assert "RPATH" not in dynamic
    assert (
        "RUNPATH" not in dynamic
    )  # found through the ld cache or LD_LIBRARY_PATH, as the real one


_REPORTED = r"""
import ctypes, json, sys
nvml = ctypes.CDLL(sys.argv[1])
def ok(rc):
    if rc != 0:
        raise SystemExit(f"NVML error {rc}")
def text(call, handle):
    buffer = ctypes.create_string_buffer(96)
    ok(call(handle, buffer, 96))
    return buffer.value.decode()
ok(nvml.nvmlInit_v2())
count = ctypes.c_uint()
ok(nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)))
gpus = []
for index in range(count.value):
    gpu = ctypes.c_void_p()
    ok(nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(gpu)))
    current, pending, most = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    migs = []
    rc = nvml.nvmlDeviceGetMigMode(gpu, ctypes.byref(current), ctypes.byref(pending))
    if rc == 0 and current.value == 1:
        ok(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu, ctypes.byref(most)))
        for at in range(most.value):
            mig = ctypes.c_void_p()
            rc = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, at, ctypes.byref(mig))
            if rc == 6:
                continue
            ok(rc)
            migs.append((text(nvml.nvmlDeviceGetName, mig), text(nvml.nvmlDeviceGetUUID, mig)))
    elif rc not in (0, 3):
        ok(rc)
    gpus.append((text(nvml.nvmlDeviceGetName, gpu), text(nvml.nvmlDeviceGetUUID, gpu), migs))
ok(nvml.nvmlShutdown())
print(json.dumps(gpus))
"""


def reported(root: DriverRoot, env: dict[str, str]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """What the root's NVML library reports, read through ctypes in a separate process."""
    result = subprocess.run(
        [sys.executable, "-c", _REPORTED, str(root.nvml_library)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    gpus = json.loads(result.stdout)
    return [(name, uuid, [(m[0], m[1]) for m in migs]) for name, uuid, migs in gpus]


def listing(gpus: list[tuple[str, str, list[tuple[str, str]]]]) -> str:
    """``nvidia-smi -L`` of `gpus` in the real format: the MIG profile (from the MIG device's
    name, "<GPU name> MIG <profile>") left-aligned in 11 columns, the device index in 2."""
    lines = []
    for index, (name, uuid, migs) in enumerate(gpus):
        lines.append(f"GPU {index}: {name} (UUID: {uuid})")
        for number, (mig_name, mig_uuid) in enumerate(migs):
            profile = mig_name.rsplit("MIG ", 1)[1]
            lines.append(f"  MIG {profile:<11} Device {number:>2}: (UUID: {mig_uuid})")
    return "\n".join(lines) + "\n"


def test_nvidia_smi_lists_the_gpus_the_library_reports(root: DriverRoot) -> None:
    env = mock_env(root)
    result = run_tool(root, "nvidia-smi", "-L", env=env)

    assert result.returncode == 0, result.stderr
    gpus = reported(root, env)
    assert len(gpus) == 8
    assert result.stdout == listing(gpus)
    assert result.stdout.splitlines() == [
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {nvmlmock.gpu_uuid(MACHINE, i)})" for i in MINORS
    ]
    assert run_tool(root, "nvidia-smi", "--list-gpus", env=env).stdout == result.stdout


def test_nvidia_smi_runs_with_the_root_nvml_preloaded(root: DriverRoot) -> None:
    """As NVIDIA's kubelet plugin runs the driver root's nvidia-smi from its own image: the
    preloaded library satisfies the DT_NEEDED libnvidia-ml.so.1."""
    env = {k: v for k, v in mock_env(root).items() if k != "LD_LIBRARY_PATH"}
    bare = run_tool(root, "nvidia-smi", "-L", env=env)
    host_cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True)
    if "libnvidia-ml.so.1 " not in host_cache.stdout:  # a host without an NVIDIA driver
        assert bare.returncode == 127
        assert "libnvidia-ml.so.1: cannot open shared object file" in bare.stderr

    preload = {**env, "LD_PRELOAD": str(root.lib_dir / "libnvidia-ml.so.1")}
    preloaded = run_tool(root, "nvidia-smi", "-L", env=preload)

    assert preloaded.returncode == 0, preloaded.stderr
    assert preloaded.stdout == listing(reported(root, mock_env(root)))


def test_nvidia_smi_lists_the_mig_devices_of_a_gpu_in_mig_mode(
    root: DriverRoot,
    mig_state: tuple[Path, list[tuple[int, int]]],
    container_dev: ContainerDev,
) -> None:
    state, made = mig_state
    migs = [(MIG_GPU, gi, ci) for gi, ci in made]
    env = mock_env(root, state=state, dev_root=container_dev(MINORS, migs))
    result = run_tool(root, "nvidia-smi", "-L", env=env)

    assert result.returncode == 0, result.stderr
    gpus = reported(root, env)
    assert len(gpus[MIG_GPU][2]) == 3
    assert result.stdout == listing(gpus)
    lines = result.stdout.splitlines()
    assert lines[MIG_GPU] == f"GPU {MIG_GPU}: NVIDIA H100 80GB HBM3 (UUID: {gpus[MIG_GPU][1]})"
    # spacing exactly as NVIDIA's MIG user guide shows it
    assert lines[MIG_GPU + 1].startswith("  MIG 1g.10gb     Device  0: (UUID: MIG-")
    assert lines[MIG_GPU + 2].startswith("  MIG 1g.10gb     Device  1: (UUID: MIG-")
    assert lines[MIG_GPU + 3].startswith("  MIG 3g.40gb     Device  2: (UUID: MIG-")
    assert lines[MIG_GPU + 4].startswith(f"GPU {MIG_GPU + 1}: ")
    # on the host (dev root: the driver root) the library made the capability nodes when the
    # instances were created, as nvidia-modprobe does: the host lists the same MIG devices
    host = run_tool(root, "nvidia-smi", "-L", env=mock_env(root, state=state))
    assert host.stdout == result.stdout
    for gi, ci in made:
        for minor in (nvmlmock.mig_cap_minor(MIG_GPU, gi), nvmlmock.mig_cap_minor(MIG_GPU, gi, ci)):
            node = (root.dev_dir / "nvidia-caps" / f"nvidia-cap{minor}").lstat()
            assert stat.S_ISCHR(node.st_mode)
            assert (os.major(node.st_rdev), os.minor(node.st_rdev)) == (root.caps_major, minor)


def test_mig_capability_nodes_added_to_the_root_show_the_mig_devices_on_the_host(
    tmp_path: Path,
    nvml_library: Path,
    paths: ClusterPaths,
    mig_state: tuple[Path, list[tuple[int, int]]],
) -> None:
    made = build(tmp_path / "driver", nvml_library, paths)
    state, instances = mig_state
    gi, ci = instances[2]

    nodes = made.add_mig_capability_nodes(MIG_GPU, gi, ci)

    minors = [nvmlmock.mig_cap_minor(MIG_GPU, gi), nvmlmock.mig_cap_minor(MIG_GPU, gi, ci)]
    assert [p.name for p in nodes] == [f"nvidia-cap{m}" for m in minors]
    for node, minor in zip(nodes, minors, strict=True):
        info = node.lstat()
        assert stat.S_ISCHR(info.st_mode)
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (made.caps_major, minor)
    assert made.add_mig_capability_nodes(MIG_GPU, gi, ci) == nodes  # idempotent
    host = run_tool(made, "nvidia-smi", "-L", env=mock_env(made, state=state))
    assert host.stdout.splitlines()[MIG_GPU + 1].startswith("  MIG 3g.40gb     Device  0: ")
    remove_driver_root(made.root)
    assert list(tmp_path.iterdir()) == []


def test_a_container_sees_only_its_gpu_and_mig_device(
    root: DriverRoot,
    mig_state: tuple[Path, list[tuple[int, int]]],
    container_dev: ContainerDev,
) -> None:
    state, made = mig_state
    gi, ci = made[1]
    dev = container_dev([MIG_GPU], [(MIG_GPU, gi, ci)])
    env = mock_env(root, state=state, dev_root=dev)

    result = run_tool(root, "nvidia-smi", "-L", env=env)

    assert result.returncode == 0, result.stderr
    [(name, uuid, migs)] = reported(root, env)
    [(_, mig_uuid)] = migs
    assert uuid == nvmlmock.gpu_uuid(MACHINE, MIG_GPU)
    assert result.stdout == (
        f"GPU 0: {name} (UUID: {uuid})\n  MIG 1g.10gb     Device  0: (UUID: {mig_uuid})\n"
    )


def test_nvidia_smi_exits_9_when_the_driver_is_not_loaded(root: DriverRoot) -> None:
    no_driver = mock_env(root, machine=None)  # the mock then answers DRIVER_NOT_LOADED
    result = run_tool(root, "nvidia-smi", "-L", env=no_driver)

    assert result.returncode == 9
    assert result.stdout == DRIVER_NOT_LOADED + "\n\n"
    assert run_tool(root, "nvidia-smi", env=no_driver).returncode == 9


def test_nvidia_smi_reports_other_init_errors_with_nvml_error_string(
    root: DriverRoot, tmp_path: Path
) -> None:
    broken = tmp_path / "state.json"
    broken.write_text("not json")  # the mock cannot load its state: NVML_ERROR_UNKNOWN

    result = run_tool(root, "nvidia-smi", "-L", env=mock_env(root, state=broken))

    assert result.returncode == 255
    assert result.stdout == "Failed to initialize NVML: Unknown Error\n"


def test_nvidia_smi_without_arguments_prints_the_driver_version(
    root: DriverRoot, mig_state: tuple[Path, list[tuple[int, int]]]
) -> None:
    env = mock_env(root, state=mig_state[0])
    result = run_tool(root, "nvidia-smi", env=env)

    assert result.returncode == 0, result.stderr
    assert f"| NVIDIA-SMI {VERSION}" in result.stdout
    assert f"Driver Version: {VERSION}" in result.stdout  # from nvmlSystemGetDriverVersion
    rows = [line for line in result.stdout.splitlines() if "NVIDIA H100 80GB HBM3" in line]
    assert len(rows) == 8
    assert "Enabled" in rows[MIG_GPU]
    assert "Disabled" in rows[0]
    assert {len(line) for line in result.stdout.splitlines()} == {89}
    version = run_tool(root, "nvidia-smi", "--version", env=env)
    assert version.stdout.splitlines() == [
        f"NVIDIA-SMI version  : {VERSION}",
        f"DRIVER version      : {VERSION}",
    ]
    invalid = run_tool(root, "nvidia-smi", "-q", env=env)
    assert invalid.returncode == 2
    assert invalid.stdout.startswith("Invalid combination of input arguments.")


@pytest.mark.parametrize("tool", driverroot.TOOLS)
def test_the_other_driver_programs_print_a_version_line(root: DriverRoot, tool: str) -> None:
    result = run_tool(root, tool, "--version", env=mock_env(root))

    assert result.returncode == 0
    assert result.stdout.startswith(f"{tool}: version {VERSION}")
    assert (root.bin_dir / tool).read_bytes()[:4] == b"\x7fELF"
    refused = run_tool(root, tool, "-d", env=mock_env(root))
    assert refused.returncode == 2
    assert "not available in the gpu-dra fake driver root" in refused.stderr


def test_device_nodes_are_character_devices_with_the_driver_numbers(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths
) -> None:
    """The nodes a fresh root has (the module's root gains the MIG capability nodes of the
    instances `mig_state` creates there)."""
    root = build(tmp_path / "driver", nvml_library, paths)
    found = {}
    for path in sorted(root.dev_dir.rglob("*")):
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            continue
        assert stat.S_ISCHR(info.st_mode), path
        relative = str(path.relative_to(root.root))
        found[relative] = (os.major(info.st_rdev), os.minor(info.st_rdev), info.st_mode & 0o777)

    uvm, caps = root.uvm_major, root.caps_major
    assert found == {
        "dev/nvidiactl": (195, 255, 0o666),
        "dev/nvidia-modeset": (195, 254, 0o666),
        "dev/nvidia-uvm": (uvm, 0, 0o666),
        "dev/nvidia-uvm-tools": (uvm, 1, 0o666),
        **{f"dev/nvidia{minor}": (195, minor, 0o666) for minor in MINORS},
        "dev/nvidia-caps/nvidia-cap1": (caps, 1, 0o400),
        "dev/nvidia-caps/nvidia-cap2": (caps, 2, 0o444),
    }
    assert {n.path for n in root.device_nodes()} == set(found)
    remove_driver_root(root.root)


def test_proc_devices_names_the_majors_of_the_device_nodes(root: DriverRoot) -> None:
    text = (root.proc_dir / "devices").read_text()
    character = text.split("\n\n")[0].splitlines()
    assert character[0] == "Character devices:"
    majors = {line.split()[1]: int(line.split()[0]) for line in character[1:]}

    assert majors["nvidia-frontend"] == 195
    assert majors["nvidia-uvm"] == os.major((root.dev_dir / "nvidia-uvm").lstat().st_rdev)
    caps = root.dev_dir / "nvidia-caps" / "nvidia-cap1"
    assert majors["nvidia-caps"] == os.major(caps.lstat().st_rdev)
    assert "Block devices:" in text


def test_mig_minors_number_instances_as_the_driver_does(root: DriverRoot) -> None:
    lines = (root.proc_dir / "driver" / "nvidia-caps" / "mig-minors").read_text().splitlines()
    minors = dict(line.split() for line in lines)

    assert lines[:4] == ["config 1", "monitor 2", "gpu0/gi0/access 3", "gpu0/gi0/ci0/access 4"]
    assert minors["gpu0/gi0/ci7/access"] == "11"
    assert minors["gpu0/gi1/access"] == "12"
    assert minors["gpu1/gi1/access"] == "147"  # 135 minors per GPU: 15 GIs x (1 + 8 CIs)
    assert len(lines) == 2 + 32 * 15 * 9  # the driver's table lists 32 GPUs, whatever the node
    assert len(set(minors.values())) == len(lines)  # no minor twice
    # gpu-dra's own reader finds the capability nodes in it
    lookup = ProcMigCapabilities((root.proc_dir,))
    assert lookup(0, 1, None) == 12
    assert lookup(0, 1, 0) == 13
    assert lookup(31, 14, 7) == 2 + 32 * 135


def test_procfs_version_firmware_and_sockets(root: DriverRoot) -> None:
    version = (root.proc_dir / "driver" / "nvidia" / "version").read_text()
    assert re.search(rf"^NVRM version: .*Kernel Module.*  {re.escape(VERSION)}  ", version, re.M)

    firmware = sorted(p.name for p in root.firmware_dir.iterdir())
    assert firmware == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    assert root.firmware_dir == root.root / "lib" / "firmware" / "nvidia" / VERSION
    assert all((root.firmware_dir / name).stat().st_size > 0 for name in firmware)

    for name in ("nvidia-persistenced", "nvidia-fabricmanager"):
        socket = root.root / "run" / name / "socket"
        assert stat.S_ISSOCK(socket.lstat().st_mode)
        assert (root.root / "var" / "run" / name / "socket").resolve() == socket.resolve()
    assert root.persistenced_socket == root.root / "run" / "nvidia-persistenced" / "socket"


def test_the_marker_describes_the_root(root: DriverRoot) -> None:
    assert DriverRoot.load(root.root) == root
    assert root.machine == "dgxh100"


def tree(directory: Path) -> dict[str, tuple[object, ...]]:
    """Every entry under `directory`: type, mode, device number, link target, content digest."""
    entries: dict[str, tuple[object, ...]] = {}
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        content: object = None
        if stat.S_ISREG(info.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(info.st_mode):
            content = os.readlink(path)
        key = str(path.relative_to(directory))
        entries[key] = (stat.S_IFMT(info.st_mode), info.st_mode & 0o7777, info.st_rdev, content)
    return entries


def test_a_rebuild_gives_the_same_root_and_compiles_nothing(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths
) -> None:
    first = build(tmp_path / "driver", nvml_library, paths)
    before = tree(first.root)
    compiled = driverroot.fakedriver_dir(paths, VERSION)
    stamps = {p.name: p.stat().st_mtime_ns for p in compiled.iterdir()}

    second = build(tmp_path / "driver", nvml_library, paths)

    assert second == first
    assert tree(second.root) == before
    assert {p.name: p.stat().st_mtime_ns for p in compiled.iterdir()} == stamps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver"]  # no staging left
    remove_driver_root(second.root)


def test_build_takes_an_empty_directory_and_leaves_nothing_when_it_fails(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "driver").mkdir()
    made = build(tmp_path / "driver", nvml_library, paths)
    assert made.nvidia_smi.is_file()
    remove_driver_root(made.root)

    def failing(root: Path) -> None:
        raise RuntimeError(f"ldconfig -r {root} failed (1): injected")

    monkeypatch.setattr(driverroot, "_update_ld_cache", failing)  # the last step fails
    with pytest.raises(RuntimeError, match="injected"):
        build(tmp_path / "driver", nvml_library, paths)
    assert list(tmp_path.iterdir()) == []


def test_teardown_leaves_nothing(tmp_path: Path, nvml_library: Path, paths: ClusterPaths) -> None:
    made = build(tmp_path / "driver", nvml_library, paths)

    remove_driver_root(made.root)

    assert list(tmp_path.iterdir()) == []
    remove_driver_root(made.root)  # nothing there: nothing to do


def test_teardown_refuses_what_it_did_not_make(tmp_path: Path) -> None:
    foreign = tmp_path / "driver"
    foreign.mkdir()
    (foreign / "keep").write_text("not a driver root")

    with pytest.raises(RuntimeError, match="not a fake driver root"):
        remove_driver_root(foreign)
    assert (foreign / "keep").read_text() == "not a driver root"


def test_build_refuses_a_foreign_directory_and_a_non_nvml_library(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths, root: DriverRoot
) -> None:
    foreign = tmp_path / "driver"
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    with pytest.raises(RuntimeError, match="not a fake driver root"):
        build(foreign, nvml_library, paths)
    assert sorted(p.name for p in foreign.iterdir()) == ["keep"]

    with pytest.raises(ValueError, match=r"SONAME 'libcuda.so.1', not libnvidia-ml.so.1"):
        build(tmp_path / "other", root.library("libcuda"), paths)
    assert not (tmp_path / "other").exists()


def test_teardown_refuses_a_root_with_a_mount_under_it(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths
) -> None:
    made = build(tmp_path / "driver", nvml_library, paths)
    mount_point = made.root / "a mount"  # mountinfo escapes the space
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)], check=True)
    try:
        with pytest.raises(RuntimeError, match="has mounts under it"):
            remove_driver_root(made.root)
        assert made.nvidia_smi.is_file()
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
    remove_driver_root(made.root)
    assert not made.root.exists()


def test_the_command_line_builds_and_removes_a_root(
    tmp_path: Path, nvml_library: Path, paths: ClusterPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_DRA_CACHE", str(paths.cache))
    dest = tmp_path / "driver"
    arguments = ["build", str(dest), "--nvml", str(nvml_library), "--gpu-minors", "0-2,5"]
    assert driverroot.main(arguments) == 0

    made = DriverRoot.load(dest)
    assert made.gpu_minors == (0, 1, 2, 5)
    assert (made.machine, made.driver_version) == ("dgxh100", VERSION)
    assert sorted(p.name for p in made.dev_dir.glob("nvidia[0-9]*")) == [
        "nvidia0",
        "nvidia1",
        "nvidia2",
        "nvidia5",
    ]
    assert driverroot.main(["remove", str(dest)]) == 0
    assert list(tmp_path.iterdir()) == []
