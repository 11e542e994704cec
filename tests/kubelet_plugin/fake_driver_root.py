"""A small NVIDIA driver root for the userspace tests: real ELF libraries, a real ld.so.cache.

`build_driver_root` compiles a few tiny shared libraries with gcc under the driver's file names
and sonames, lets ``ldconfig -r`` make their soname links and the cache, and adds binaries,
firmware, an IPC socket, device nodes (``os.mknod``; the tests run as root), a DRM sysfs entry
and ``/proc/devices``. The full e2e driver root lives in e2e/; this one is just big enough to
check each rule of `nvidia_userspace`.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

VERSION = "550.54.15"
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
PCI_BUS_ID = "0000:3b:00.0"
NVIDIA_MAJOR = 195
CAPS_MAJOR = 236

LIBRARIES = {
    # file name: soname
    f"libcuda.so.{VERSION}": "libcuda.so.1",
    f"libnvidia-ml.so.{VERSION}": "libnvidia-ml.so.1",
    f"libnvidia-ptxjitcompiler.so.{VERSION}": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm70.so.4": "libnvidia-nvvm70.so.4",
}
VDPAU_LIBRARY = f"libvdpau_nvidia.so.{VERSION}"
OTHER_LIBRARY = "libother.so.1.2.3"
"""Not of the driver version: never injected."""


@dataclass(frozen=True)
class FakeDriverRoot:
    root: Path
    sysfs: Path
    proc: Path
    """The plugin's own ``/proc`` stand-in (the root has its own ``proc/devices`` too)."""


def _library(path: Path, soname: str | None) -> None:
    source = path.parent / f".{path.name}.c"
    source.write_text("int gpu_dra_fake(void) { return 1; }\n")
    command = ["gcc", "-shared", "-fPIC", "-o", str(path), str(source)]
    if soname is not None:
        command.insert(3, f"-Wl,-soname,{soname}")
    subprocess.run(command, check=True)
    source.unlink()


def run_ldconfig(root: Path) -> None:
    """Make the soname links and ``<root>/etc/ld.so.cache`` from ``<root>/etc/ld.so.conf``."""
    subprocess.run(["ldconfig", "-r", str(root)], check=True)


def _executable(path: Path, mode: int = 0o755) -> None:
    """An ELF file (its header's magic only: the plugin mounts driver programs, never runs them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(57))
    path.chmod(mode)


def _char_device(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(major, minor))


def add_version(root: Path, version: str, directory: str = LIB_DIR) -> None:
    """Install libcuda and libnvidia-ml of `version` in `directory` of the root (no ldconfig)."""
    lib_dir = root / directory.lstrip("/")
    lib_dir.mkdir(parents=True, exist_ok=True)
    for name in ("libcuda", "libnvidia-ml"):
        _library(lib_dir / f"{name}.so.{version}", f"{name}.so.1")


def build_driver_root(base: Path, *, lib_dir: str = LIB_DIR) -> FakeDriverRoot:
    """The driver root under ``base/root`` with libraries in `lib_dir` (the only directory of
    ``etc/ld.so.conf``), sysfs under ``base/sys`` and a plugin procfs under ``base/proc``."""
    root = base / "root"
    libs = root / lib_dir.lstrip("/")
    (libs / "vdpau").mkdir(parents=True)
    for name, soname in LIBRARIES.items():
        _library(libs / name, soname)
    _library(libs / "vdpau" / VDPAU_LIBRARY, "libvdpau_nvidia.so.1")
    _library(libs / OTHER_LIBRARY, "libother.so.1")
    # As the driver's installer makes them; ldconfig adds the soname links of `lib_dir` (the
    # vdpau directory is not the linker's: its link is the installer's).
    (libs / "libcuda.so").symlink_to("libcuda.so.1")
    (libs / "libnvidia-ptxjitcompiler.so").symlink_to("libnvidia-ptxjitcompiler.so.1")
    (libs / "vdpau/libvdpau_nvidia.so.1").symlink_to(VDPAU_LIBRARY)
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text(f"{lib_dir}\n")
    run_ldconfig(root)

    for name in ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control"):
        _executable(root / "usr/bin" / name)
    _executable(root / "usr/sbin/nvidia-cuda-mps-server")
    _executable(root / "usr/bin/nvidia-imex", mode=0o644)  # not executable: not a binary

    firmware = root / "lib/firmware/nvidia" / VERSION
    firmware.mkdir(parents=True)
    for name in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        (firmware / name).write_bytes(b"\0" * 16)
    (root / "lib/firmware/nvidia/535.0.0").mkdir()
    (root / "lib/firmware/nvidia/535.0.0/gsp_ga10x.bin").write_bytes(b"\0")

    (root / "run/nvidia-persistenced").mkdir(parents=True)
    # A file stands in for the socket (any non-directory is taken, as NVIDIA's lookup does;
    # a socket path under a deep temporary directory may pass AF_UNIX's 107 bytes).
    (root / "run/nvidia-persistenced/socket").write_bytes(b"")

    dev = root / "dev"
    _char_device(dev / "nvidiactl", NVIDIA_MAJOR, 255)
    _char_device(dev / "nvidia-uvm", 510, 0)
    _char_device(dev / "nvidia0", NVIDIA_MAJOR, 0)
    _char_device(dev / "dri/card1", 226, 1)
    _char_device(dev / "dri/renderD128", 226, 128)
    (dev / "dri/by-path").mkdir()
    (dev / f"dri/by-path/pci-{PCI_BUS_ID}-card").symlink_to("../card1")
    (dev / f"dri/by-path/pci-{PCI_BUS_ID}-render").symlink_to("../renderD128")

    (root / "proc").mkdir()
    (root / "proc/devices").write_text(
        f"Character devices:\n  1 mem\n{NVIDIA_MAJOR} nvidia\n{CAPS_MAJOR} nvidia-caps\n"
        "\nBlock devices:\n  8 sd\n"
    )
    sysfs = base / "sys"
    for name in ("card1", "renderD128"):
        (sysfs / "bus/pci/devices" / PCI_BUS_ID / "drm" / name).mkdir(parents=True)
    proc = base / "proc"
    proc.mkdir()
    return FakeDriverRoot(root=root, sysfs=sysfs, proc=proc)
