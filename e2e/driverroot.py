"""A fake NVIDIA driver root for the real-mode e2e tests, laid out like a data-center driver.

`build_driver_root` makes, under one directory, what NVIDIA's tools and gpu-dra look for in a
driver root: the driver's libraries as real ELF shared objects under the real file names, SONAMEs
and symlinks (``libnvidia-ml`` is the NVML mock, the others stubs from `e2e/fakedriver/`), an
``ld.so.cache`` made by ``ldconfig -r``, ``nvidia-smi`` (a real program linked against
``libnvidia-ml.so.1``) and the other driver programs, GSP firmware files, device nodes made with
mknod, the driver's procfs files (``devices``, ``mig-minors``, ``version``) and the IPC sockets.
The compiled files are cached under ``<cache>/tools/fakedriver-<hash>-<version>/``; a layout only
copies them, in well under a second. `remove_driver_root` removes a root (device nodes included).
Needs root (mknod, ``ldconfig -r``), gcc and glibc's ldconfig. See docs/e2e-cluster.md, "The fake
driver root".
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from e2e import nvmlmock
from e2e.cluster.paths import REPO_ROOT, ClusterPaths

log = logging.getLogger(__name__)

SOURCES = REPO_ROOT / "e2e" / "fakedriver"
LIB_DIR = "usr/lib/x86_64-linux-gnu"
BIN_DIR = "usr/bin"
MARKER = ".gpu-dra-fake-driver-root.json"
"""A file in every root this module made: `remove_driver_root` deletes nothing without it."""


@dataclass(frozen=True)
class DriverLibrary:
    """One library of the driver as a .run/.deb install leaves it.

    The file is ``<stem>.so.<driver version>``; its SONAME is ``<stem><soname_suffix>`` (a link
    of that name points at the file) or, with no suffix, the file name itself (NVIDIA versions
    those SONAMEs: gpucomp, pkcs11). `dev_link` adds ``<stem>.so -> <SONAME>``.
    """

    stem: str
    soname_suffix: str | None
    dev_link: bool = False

    def file_name(self, driver_version: str) -> str:
        return f"{self.stem}.so.{driver_version}"

    def soname(self, driver_version: str) -> str:
        if self.soname_suffix is None:
            return self.file_name(driver_version)
        return self.stem + self.soname_suffix

    def links(self, driver_version: str) -> dict[str, str]:
        """Symlinks the install makes: name -> target (relative, in the library directory)."""
        links: dict[str, str] = {}
        soname = self.soname(driver_version)
        if soname != self.file_name(driver_version):
            links[soname] = self.file_name(driver_version)
        if self.dev_link:
            links[f"{self.stem}.so"] = soname
        return links


NVML = DriverLibrary("libnvidia-ml", ".so.1", dev_link=True)
"""Not a stub: the NVML mock library (SONAME libnvidia-ml.so.1) is installed under this name."""

LIBRARIES: tuple[DriverLibrary, ...] = (
    # The utility and compute libraries of a 550-series data-center driver
    # (libnvidia-container's nvc_info.c lists; file names and SONAMEs as the driver ships them).
    NVML,
    DriverLibrary("libnvidia-cfg", ".so.1", dev_link=True),
    DriverLibrary("libcuda", ".so.1", dev_link=True),
    DriverLibrary("libcudadebugger", ".so.1"),
    DriverLibrary("libnvidia-opencl", ".so.1"),
    DriverLibrary("libnvidia-ptxjitcompiler", ".so.1", dev_link=True),
    DriverLibrary("libnvidia-nvvm", ".so.4", dev_link=True),
    DriverLibrary("libnvidia-allocator", ".so.1", dev_link=True),
    DriverLibrary("libnvidia-gpucomp", None),
    DriverLibrary("libnvidia-pkcs11", None),
    DriverLibrary("libnvidia-pkcs11-openssl3", None),
)
STUB_LIBRARIES = tuple(library for library in LIBRARIES if library != NVML)

NVIDIA_SMI = "nvidia-smi"
TOOLS = (
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
"""Programs built from ``tool.c``: they print a version line and do nothing else."""
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")

NVIDIA_MAJOR = 195
"""``nvidia-frontend``: /dev/nvidia<minor>, /dev/nvidiactl (255), /dev/nvidia-modeset (254)."""
CTL_MINOR = 255
MODESET_MINOR = 254
DEFAULT_UVM_MAJOR = 510
"""The real ``nvidia-uvm`` and ``nvidia-caps`` majors are dynamic; these are typical values."""
DEFAULT_CAPS_MAJOR = 511
IMEX_CHANNELS_MAJOR = 509
MIG_CONFIG_MINOR = 1
MIG_MONITOR_MINOR = 2

_CFLAGS = ("-O2", "-Wall", "-Wextra", "-fPIC")
_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, \n, \\ so


@dataclass(frozen=True)
class DeviceNode:
    """A character device node of the root: `path` relative to the root."""

    path: str
    major: int
    minor: int
    mode: int


@dataclass(frozen=True)
class DriverRoot:
    """A fake driver root that `build_driver_root` laid out at `root`.

    Paths are host paths under `root`; inside a container they are the same paths with `root`
    taken off (``/usr/lib/x86_64-linux-gnu/libcuda.so.1``, ``/dev/nvidia0``, ...).
    """

    root: Path
    driver_version: str
    machine: str
    gpu_minors: tuple[int, ...]
    uvm_major: int = DEFAULT_UVM_MAJOR
    caps_major: int = DEFAULT_CAPS_MAJOR

    @property
    def lib_dir(self) -> Path:
        return self.root / LIB_DIR

    @property
    def bin_dir(self) -> Path:
        return self.root / BIN_DIR

    @property
    def nvidia_smi(self) -> Path:
        return self.bin_dir / NVIDIA_SMI

    @property
    def nvml_library(self) -> Path:
        """``libnvidia-ml.so.<version>``: the NVML mock (``libnvidia-ml.so.1`` links to it)."""
        return self.lib_dir / NVML.file_name(self.driver_version)

    @property
    def ld_cache(self) -> Path:
        return self.root / "etc" / "ld.so.cache"

    @property
    def firmware_dir(self) -> Path:
        return self.root / "lib" / "firmware" / "nvidia" / self.driver_version

    @property
    def dev_dir(self) -> Path:
        return self.root / "dev"

    @property
    def proc_dir(self) -> Path:
        """The driver's procfs files: ``devices``, ``driver/nvidia/version``, ``mig-minors``."""
        return self.root / "proc"

    @property
    def persistenced_socket(self) -> Path:
        return self.root / "run" / "nvidia-persistenced" / "socket"

    @property
    def fabricmanager_socket(self) -> Path:
        return self.root / "run" / "nvidia-fabricmanager" / "socket"

    def library(self, stem: str) -> Path:
        """The versioned file of the library `stem` (``libcuda`` -> ``.../libcuda.so.<ver>``)."""
        for library in LIBRARIES:
            if library.stem == stem:
                return self.lib_dir / library.file_name(self.driver_version)
        raise KeyError(f"{stem} is not a library of the fake driver root")

    def device_nodes(self) -> tuple[DeviceNode, ...]:
        """Every device node of the root (MIG capability nodes of GPU/compute instances are not
        made: CDI specs carry those by major/minor from ``mig-minors``)."""
        nodes = [
            DeviceNode("dev/nvidiactl", NVIDIA_MAJOR, CTL_MINOR, 0o666),
            DeviceNode("dev/nvidia-modeset", NVIDIA_MAJOR, MODESET_MINOR, 0o666),
            DeviceNode("dev/nvidia-uvm", self.uvm_major, 0, 0o666),
            DeviceNode("dev/nvidia-uvm-tools", self.uvm_major, 1, 0o666),
            *(DeviceNode(f"dev/nvidia{m}", NVIDIA_MAJOR, m, 0o666) for m in self.gpu_minors),
            DeviceNode("dev/nvidia-caps/nvidia-cap1", self.caps_major, MIG_CONFIG_MINOR, 0o400),
            DeviceNode("dev/nvidia-caps/nvidia-cap2", self.caps_major, MIG_MONITOR_MINOR, 0o444),
        ]
        return tuple(nodes)

    def add_mig_capability_nodes(self, gpu_minor: int, gi_id: int, ci_id: int) -> list[Path]:
        """Make the capability nodes of one MIG device in the root's ``dev/nvidia-caps/`` (its
        GPU instance's and its compute instance's, minors from ``mig-minors``), as they appear
        on a host once the instance exists; return their paths. `build_driver_root` makes none:
        the NVML mock shows a MIG device only where both exist, so host-side tools that read
        the root's ``dev/`` see the MIG devices given nodes here. Existing nodes are kept;
        `remove_driver_root` removes them with the root."""
        made = []
        for minor in (
            nvmlmock.mig_cap_minor(gpu_minor, gi_id),
            nvmlmock.mig_cap_minor(gpu_minor, gi_id, ci_id),
        ):
            path = self.dev_dir / "nvidia-caps" / f"nvidia-cap{minor}"
            if not path.exists():
                os.mknod(path, stat.S_IFCHR | 0o400, os.makedev(self.caps_major, minor))
                path.chmod(0o400)
            made.append(path)
        return made

    def tool_env(self) -> dict[str, str]:
        """Environment that runs the root's programs on the host: its libraries first (in a
        container the ld cache does this)."""
        return {"LD_LIBRARY_PATH": str(self.lib_dir)}

    @classmethod
    def load(cls, root: Path) -> DriverRoot:
        """The description of a root this module made, from its marker file."""
        data = json.loads((root / MARKER).read_text())
        return cls(
            root=root,
            driver_version=data["driver_version"],
            machine=data["machine"],
            gpu_minors=tuple(data["gpu_minors"]),
            uvm_major=data["uvm_major"],
            caps_major=data["caps_major"],
        )


def build_driver_root(
    dest: Path,
    *,
    nvml_library: Path,
    machine: str,
    gpu_minors: Sequence[int],
    driver_version: str,
    paths: ClusterPaths | None = None,
    uvm_major: int = DEFAULT_UVM_MAJOR,
    caps_major: int = DEFAULT_CAPS_MAJOR,
) -> DriverRoot:
    """Lay out a fake driver root at `dest` and return its description.

    `nvml_library` is installed as the driver's ``libnvidia-ml`` (its SONAME must be
    ``libnvidia-ml.so.1``); `machine` names the NVML mock server it stands for (recorded only);
    `gpu_minors` get ``/dev/nvidia<minor>``. An existing root at `dest` made by this function is
    replaced (the new one is built beside it and renamed into place); any other existing,
    non-empty `dest` is refused. Compiled files come from the cache of `paths`.
    """
    description = _describe(
        DriverRoot(dest, driver_version, machine, tuple(gpu_minors), uvm_major, caps_major),
        nvml_library,
    )
    _refuse_foreign(dest)
    built = build_fakedriver(paths or ClusterPaths.from_env(), driver_version)
    staging = dest.with_name(dest.name + ".partial")
    _remove_tree(staging)
    staging.mkdir(parents=True)
    _write(staging / MARKER, _marker_text(description))
    staged = dataclasses.replace(description, root=staging)
    minors = description.gpu_minors
    try:
        _install_libraries(staged, built, nvml_library)
        _install_programs(staged, built)
        _install_firmware(staged)
        _make_device_nodes(staged)
        _write_procfs(staged)
        _make_sockets(staged)
        _update_ld_cache(staging)
    except BaseException:
        _remove_tree(staging)
        raise
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()  # an empty directory made for it
    _remove_root(dest)
    staging.rename(dest)
    log.info("fake driver root %s: %s, driver %s, GPUs %s", dest, machine, driver_version, minors)
    return description


def remove_driver_root(root: Path) -> None:
    """Remove a root `build_driver_root` made, device nodes and sockets included, and a leftover
    ``<root>.partial``. Refuses a directory without the marker file or with mounts under it."""
    _remove_root(root.with_name(root.name + ".partial"))
    _remove_root(root)


def _remove_root(directory: Path) -> None:
    if not directory.exists() and not directory.is_symlink():
        return
    if not (directory / MARKER).is_file():
        raise RuntimeError(f"{directory} is not a fake driver root (no {MARKER}); not removed")
    _remove_tree(directory)


# --- the cache of compiled files -------------------------------------------------------------


def fakedriver_digest() -> str:
    """Hash of everything that decides the compiled files but the driver version: the C
    sources, the library and program lists, the compiler flags and the compiler's version."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    digest.update(repr((LIBRARIES, NVIDIA_SMI, TOOLS, _CFLAGS)).encode())
    digest.update(_gcc(["-dumpfullversion"], capture=True).encode())
    return digest.hexdigest()[:12]


def fakedriver_dir(paths: ClusterPaths, driver_version: str) -> Path:
    return paths.cache / "tools" / f"fakedriver-{fakedriver_digest()}-{driver_version}"


def build_fakedriver(paths: ClusterPaths, driver_version: str) -> Path:
    """Compile the stub libraries and programs for `driver_version` unless cached; return the
    directory holding them (``lib<name>.so.<version>``, ``nvidia-smi``, the tools).

    Builds of other source hashes are removed once a build completes; other driver versions of
    the same sources stay. A lock file serialises concurrent builds.
    """
    _check_version(driver_version)
    directory = fakedriver_dir(paths, driver_version)
    wanted = [lib.file_name(driver_version) for lib in STUB_LIBRARIES] + [NVIDIA_SMI, *TOOLS]
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.parent / "fakedriver.lock"):
        if all((directory / name).is_file() for name in wanted):
            return directory
        staging = directory.with_name(directory.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "link").mkdir(parents=True)
        _compile(staging, driver_version)
        shutil.rmtree(staging / "link")
        (staging / "library.o").unlink()
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
        digest = directory.name.split("-")[1]
        for stale in directory.parent.glob("fakedriver-*"):
            if stale.is_dir() and stale.name.split("-")[1] != digest:
                shutil.rmtree(stale, ignore_errors=True)
    log.info("fake driver: compiled %d files into %s", len(wanted), directory)
    return directory


def _compile(out: Path, driver_version: str) -> None:
    version = f'-DFAKEDRIVER_VERSION="{driver_version}"'
    include = f"-I{SOURCES}"
    _gcc([*_CFLAGS, version, "-c", str(SOURCES / "library.c"), "-o", str(out / "library.o")])
    for library in STUB_LIBRARIES:
        soname = library.soname(driver_version)
        target = out / library.file_name(driver_version)
        _gcc(["-shared", "-s", f"-Wl,-soname,{soname}", str(out / "library.o"), "-o", str(target)])
    # nvidia-smi needs libnvidia-ml.so.1 (DT_NEEDED) but not any one NVML build: link it against
    # a stub of that SONAME that stays here, as programs link against NVIDIA's stub libraries.
    link_stub = out / "link" / "libnvidia-ml.so.1"
    nvml_soname = NVML.soname(driver_version)
    stub = [str(SOURCES / "nvml_link_stub.c"), "-o", str(link_stub)]
    _gcc([*_CFLAGS, include, "-shared", "-s", f"-Wl,-soname,{nvml_soname}", *stub])
    smi = [str(SOURCES / "nvidia-smi.c"), "-o", str(out / NVIDIA_SMI)]
    _gcc([*_CFLAGS, include, version, "-s", *smi, "-L", str(link_stub.parent), f"-l:{nvml_soname}"])
    for tool in TOOLS:
        name = f'-DFAKEDRIVER_TOOL="{tool}"'
        _gcc([*_CFLAGS, version, name, "-s", str(SOURCES / "tool.c"), "-o", str(out / tool)])


def _gcc(arguments: list[str], *, capture: bool = False) -> str:
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc is needed to build the fake driver root's libraries and programs")
    result = subprocess.run(["gcc", *arguments], check=True, capture_output=True, text=True)
    if result.stderr.strip():
        log.warning("gcc %s: %s", " ".join(arguments), result.stderr.strip())
    return result.stdout if capture else ""


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- the layout ------------------------------------------------------------------------------


def _describe(root: DriverRoot, nvml_library: Path) -> DriverRoot:
    """`root` after checking its parameters and that `nvml_library` is an NVML library."""
    _check_version(root.driver_version)
    minors = root.gpu_minors
    if not minors or len(set(minors)) != len(minors):
        raise ValueError(f"gpu_minors must be distinct and not empty: {minors}")
    if any(not 0 <= m < MODESET_MINOR for m in minors):
        raise ValueError(f"GPU minors are 0..{MODESET_MINOR - 1} (254/255 are the driver's)")
    if len({NVIDIA_MAJOR, root.uvm_major, root.caps_major, IMEX_CHANNELS_MAJOR}) != 4:
        raise ValueError(f"the device majors must differ: {root.uvm_major}, {root.caps_major}")
    soname = read_soname(nvml_library)
    wanted = NVML.soname(root.driver_version)
    if soname != wanted:
        raise ValueError(f"{nvml_library} has SONAME {soname!r}, not {wanted}")
    return root


def _check_version(driver_version: str) -> None:
    if not _VERSION.fullmatch(driver_version):
        raise ValueError(f"not a driver version: {driver_version!r} (like 550.54.15)")


def _refuse_foreign(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise RuntimeError(f"{dest} exists and is not a directory; not replaced")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / MARKER).is_file():
        raise RuntimeError(f"{dest} is not empty and not a fake driver root; not replaced")


def _marker_text(root: DriverRoot) -> str:
    data = {
        "driver_version": root.driver_version,
        "machine": root.machine,
        "gpu_minors": list(root.gpu_minors),
        "uvm_major": root.uvm_major,
        "caps_major": root.caps_major,
    }
    return json.dumps(data, indent=2) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _install_libraries(root: DriverRoot, built: Path, nvml_library: Path) -> None:
    root.lib_dir.mkdir(parents=True)
    version = root.driver_version
    for library in LIBRARIES:
        source = nvml_library if library == NVML else built / library.file_name(version)
        target = root.lib_dir / library.file_name(version)
        shutil.copyfile(source, target)
        target.chmod(0o755)
        for name, link_target in library.links(version).items():
            (root.lib_dir / name).symlink_to(link_target)


def _install_programs(root: DriverRoot, built: Path) -> None:
    root.bin_dir.mkdir(parents=True)
    for program in (NVIDIA_SMI, *TOOLS):
        shutil.copyfile(built / program, root.bin_dir / program)
        (root.bin_dir / program).chmod(0o755)


def _install_firmware(root: DriverRoot) -> None:
    for name in FIRMWARE:
        text = f"gpu-dra fake GSP firmware {name} for driver {root.driver_version} (no GPU)\n"
        _write(root.firmware_dir / name, text)


def _make_device_nodes(root: DriverRoot) -> None:
    for node in root.device_nodes():
        path = root.root / node.path
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, stat.S_IFCHR | node.mode, os.makedev(node.major, node.minor))
        path.chmod(node.mode)


def _write_procfs(root: DriverRoot) -> None:
    char = [
        (1, "mem"),
        (4, "tty"),
        (5, "/dev/tty"),
        (10, "misc"),
        (NVIDIA_MAJOR, "nvidia-frontend"),
        (IMEX_CHANNELS_MAJOR, "nvidia-caps-imex-channels"),
        (root.uvm_major, "nvidia-uvm"),
        (root.caps_major, "nvidia-caps"),
    ]
    lines = ["Character devices:"] + [f"{major:3d} {name}" for major, name in sorted(char)]
    lines += ["", "Block devices:", "  7 loop", "  8 sd"]
    _write(root.proc_dir / "devices", "\n".join(lines) + "\n", 0o444)
    _write(
        root.proc_dir / "driver" / "nvidia" / "version",
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {root.driver_version}  "
        "Release Build  (gpu-dra fake driver root)\nGCC version:  gcc version 12.2.0\n",
        0o444,
    )
    _write(
        root.proc_dir / "driver" / "nvidia-caps" / "mig-minors",
        nvmlmock.mig_minors_file_text(),  # all 32 GPUs of the driver's table, as the real file
        0o444,
    )
    capabilities = root.proc_dir / "driver" / "nvidia" / "capabilities" / "mig"
    for name, minor, mode in (
        ("config", MIG_CONFIG_MINOR, 0o400),
        ("monitor", MIG_MONITOR_MINOR, 0o444),
    ):
        text = f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"
        _write(capabilities / name, text, 0o444)


def _make_sockets(root: DriverRoot) -> None:
    (root.root / "var").mkdir()
    (root.root / "var" / "run").symlink_to("../run")
    for path in (root.persistenced_socket, root.fabricmanager_socket):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Bound through the directory's descriptor: a unix socket path is limited to 107 bytes.
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
                server.bind(f"/proc/self/fd/{directory}/{path.name}")
        finally:
            os.close(directory)


def _update_ld_cache(root: Path) -> None:
    _write(root / "etc" / "ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n")
    _write(root / "etc" / "ld.so.conf.d" / "x86_64-linux-gnu.conf", f"/{LIB_DIR}\n")
    result = subprocess.run(
        ["ldconfig", "-r", str(root)], check=False, capture_output=True, text=True
    )
    if result.returncode != 0 or not (root / "etc" / "ld.so.cache").is_file():
        raise RuntimeError(f"ldconfig -r {root} failed ({result.returncode}): {result.stderr}")


def _remove_tree(directory: Path) -> None:
    if not directory.exists() and not directory.is_symlink():
        return
    mounted = _mounts_under(directory)
    if mounted:
        raise RuntimeError(f"{directory} has mounts under it ({', '.join(mounted)}); not removed")
    shutil.rmtree(directory)


def _mounts_under(directory: Path) -> list[str]:
    top = os.path.realpath(directory)
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m[1], 8)), line.split()[4])
            if point == top or point.startswith(top + "/"):
                found.append(point)
    return found


# --- ELF ---------------------------------------------------------------------------------------

_PT_LOAD = 1
_PT_DYNAMIC = 2
_DT_NULL = 0
_DT_STRTAB = 5
_DT_SONAME = 14


def read_soname(path: Path) -> str | None:
    """The DT_SONAME of a 64-bit little-endian ELF shared object (None if it has none)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for index in range(phnum):
        kind, _, offset, vaddr, _, filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + index * phentsize
        )
        if kind == _PT_LOAD:
            loads.append((vaddr, filesz, offset))
        elif kind == _PT_DYNAMIC:
            dynamic = (offset, filesz)
    if dynamic is None:
        return None
    strtab = soname = None
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = value
        elif tag == _DT_SONAME:
            soname = value
    if strtab is None or soname is None:
        return None
    for vaddr, filesz, offset in loads:
        if vaddr <= strtab < vaddr + filesz:
            start = strtab - vaddr + offset + soname
            return data[start : data.index(b"\0", start)].decode()
    raise ValueError(f"{path}: the dynamic string table lies in no loaded segment")


# --- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m e2e.driverroot build DEST --nvml LIB ...`` / ``remove DEST`` (as root)."""
    parser = argparse.ArgumentParser(prog="python -m e2e.driverroot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="lay out a fake driver root at DEST (replacing one)")
    build.add_argument("dest", type=Path)
    build.add_argument("--nvml", type=Path, required=True, help="the libnvidia-ml.so.1 to install")
    build.add_argument("--machine", default="dgxh100", help="the NVML mock server it stands for")
    build.add_argument("--gpu-minors", default="0-7", help="like 0-7 or 0,2,5")
    build.add_argument("--driver-version", default="550.54.15")
    remove = sub.add_parser("remove", help="remove a fake driver root")
    remove.add_argument("dest", type=Path)
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if options.command == "remove":
        remove_driver_root(options.dest)
        return 0
    root = build_driver_root(
        options.dest,
        nvml_library=options.nvml,
        machine=options.machine,
        gpu_minors=_minors(options.gpu_minors),
        driver_version=options.driver_version,
    )
    print(root.root)
    return 0


def _minors(text: str) -> list[int]:
    minors: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        minors += range(int(first), int(last or first) + 1)
    return minors


if __name__ == "__main__":
    raise SystemExit(main())
