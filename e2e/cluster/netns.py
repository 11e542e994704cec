"""The network namespace the whole cluster lives in.

Everything (etcd, control plane, kubelet, containerd, the CNI bridge, pods, the driver, tests)
talks over addresses that exist only inside this namespace; the root namespace keeps just its
loopback. The node address sits on one end of a veth pair whose other end is in the same
namespace; it also carries the default route, so nothing inside ever routes out.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from e2e.cluster import versions

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def path(name: str = versions.NETNS) -> Path:
    return NETNS_DIR / name


def exists(name: str = versions.NETNS) -> bool:
    return path(name).exists()


def _ip(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "-n", netns] if netns else ["ip"]
    subprocess.run([*prefix, *args], check=True, capture_output=True)


def create(name: str = versions.NETNS) -> None:
    if not exists(name):
        _ip("netns", "add", name)
    _ip("link", "set", "lo", "up", netns=name)
    links = subprocess.run(
        ["ip", "-n", name, "-o", "link", "show"], check=True, capture_output=True, text=True
    ).stdout
    if versions.NODE_INTERFACE not in links:
        # No dummy-interface module on this VM kind: a veth pair whose both ends stay inside.
        _ip(
            "link", "add", versions.NODE_INTERFACE, "type", "veth",
            "peer", "name", f"{versions.NODE_INTERFACE}p", netns=name,
        )  # fmt: skip
        _ip("link", "set", f"{versions.NODE_INTERFACE}p", "up", netns=name)
        _ip(
            "addr", "add", f"{versions.NODE_IP}/{versions.NODE_PREFIX}",
            "dev", versions.NODE_INTERFACE, netns=name,
        )  # fmt: skip
        _ip("link", "set", versions.NODE_INTERFACE, "up", netns=name)
        _ip("route", "add", "default", "dev", versions.NODE_INTERFACE, netns=name)
    # Pod traffic crosses the CNI bridge; forwarding is per namespace.
    subprocess.run(
        ["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
        check=True, capture_output=True,
    )  # fmt: skip


def delete(name: str = versions.NETNS) -> None:
    if exists(name):
        _ip("netns", "delete", name)


def command(argv: list[str], name: str = versions.NETNS) -> list[str]:
    """Prefix a command so that it runs in the namespace (network only: mounts stay shared)."""
    return ["nsenter", f"--net={path(name)}", "--", *argv]


_left: list[int] = []
"""A descriptor of the network namespace `enter` left (the host's), for `outside_command`."""


def enter(name: str = versions.NETNS) -> None:
    """Move the calling thread (and threads/processes it starts later) into the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not _left:
        _left.append(os.open("/proc/thread-self/ns/net", os.O_RDONLY))
    fd = os.open(path(name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path(name)}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def current_is(name: str = versions.NETNS) -> bool:
    """True if this process already runs in the namespace."""
    try:
        return os.stat("/proc/thread-self/ns/net").st_ino == os.stat(path(name)).st_ino
    except FileNotFoundError:
        return False


def outside_command(argv: list[str]) -> tuple[list[str], tuple[int, ...]]:
    """(command, descriptors to pass) running `argv` in the network namespace this process was in
    before `enter` (the host's: package mirrors are reachable there); `argv` as is when this
    process never entered one."""
    if not _left:
        return argv, ()
    return ["nsenter", f"--net=/proc/self/fd/{_left[0]}", "--", *argv], (_left[0],)
