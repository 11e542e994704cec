"""Brings the single-node e2e cluster up and down.

`up` is idempotent (a healthy running cluster is left alone, a half-started one is torn down and
started again) and `down` leaves nothing behind: no process, mount, cgroup, network namespace,
sysctl change or state directory. The calling process moves into the cluster's network namespace
during `up`, so every component it starts lives there too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from e2e.cluster import configs, images, netns, pki, toolchain, versions
from e2e.cluster.paths import ClusterPaths

log = logging.getLogger(__name__)

# The kubelet changes these at start (protectKernelDefaults=false); `down` puts them back.
KUBELET_SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)

CDI_SPEC_DIRS = tuple(Path(d) for d in versions.CDI_SPEC_DIRS)

COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "containerd",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
)


class ClusterError(RuntimeError):
    """The cluster could not be brought up; the message names the component and its log."""


class Cluster:
    def __init__(self, paths: ClusterPaths | None = None) -> None:
        self.paths = paths or ClusterPaths.from_env()
        # Children started by this object, kept so that they are reaped when stopped.
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    # ---- state -----------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.paths.state_file.read_text()))
        except FileNotFoundError:
            return {}

    def _save_state(self, state: dict[str, Any]) -> None:
        self.paths.state_file.write_text(json.dumps(state, indent=2))

    @property
    def bin_dir(self) -> Path:
        return toolchain.bin_dir(self.paths)

    @property
    def kubeconfig(self) -> Path:
        return self.paths.admin_kubeconfig

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        """Run the pinned kubectl as the admin (the caller must be inside the namespace)."""
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            check=False,
        )
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    # ---- processes ---------------------------------------------------------------------------
    def start_process(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        """Start a process in the cluster's namespace, logged and stopped by `down`."""
        return self._start(name, argv, env)

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        with open(self.paths.logs / f"{name}.log", "ab") as logfile:
            process = subprocess.Popen(
                argv,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        self._children[process.pid] = process
        state = self._state()
        state.setdefault("processes", {})[name] = process.pid
        self._save_state(state)
        log.info("started %s (pid %d)", name, process.pid)
        return process.pid

    def pid(self, name: str) -> int | None:
        pid = self._state().get("processes", {}).get(name)
        return int(pid) if pid and _alive(int(pid)) else None

    def stop_component(self, name: str, timeout: float = 20.0) -> None:
        pid = self._state().get("processes", {}).get(name)
        if pid:
            self._terminate(int(pid), timeout)
        state = self._state()
        state.get("processes", {}).pop(name, None)
        self._save_state(state)

    def _terminate(self, pid: int, timeout: float) -> None:
        _terminate(pid, timeout)
        child = self._children.pop(pid, None)
        if child is not None:
            child.wait(timeout=5)

    def start_component(self, name: str) -> None:
        """(Re)start one component with its usual command line (used by restart tests)."""
        commands: dict[str, Callable[[], list[str]]] = {
            "etcd": lambda: configs.etcd_command(self.paths),
            "kube-apiserver": lambda: configs.apiserver_command(self.paths, self.bin_dir),
            "containerd": lambda: configs.containerd_command(self.paths, self.bin_dir),
            "kube-controller-manager": lambda: configs.controller_manager_command(
                self.paths, self.bin_dir
            ),
            "kube-scheduler": lambda: configs.scheduler_command(self.paths, self.bin_dir),
            "kubelet": lambda: configs.kubelet_command(self.paths, self.bin_dir),
        }
        env = dict(os.environ, PATH=f"{self.bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        if name == "kubelet":  # every kubelet of the test bed starts without device plugins
            _forget_device_plugin_allocations()
        self._start(name, commands[name](), env)

    def restart_kubelet(self) -> None:
        self.stop_component("kubelet")
        self.start_component("kubelet")
        self.wait_node_ready()

    # ---- health ----------------------------------------------------------------------------
    def _api_get(self, path: str) -> tuple[int, str]:
        context = ssl.create_default_context(cafile=str(self.paths.pki / "ca.crt"))
        context.load_cert_chain(
            str(self.paths.pki / "admin.crt"), str(self.paths.pki / "admin.key")
        )
        url = f"https://{versions.NODE_IP}:{versions.APISERVER_PORT}{path}"
        try:
            with urllib.request.urlopen(url, context=context, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def healthy(self) -> bool:
        if not netns.exists() or any(self.pid(name) is None for name in COMPONENTS):
            return False
        try:
            if not netns.current_is():
                netns.enter()
            return self._api_get("/readyz")[0] == 200 and self._node_ready()
        except OSError:
            return False

    def _node_ready(self) -> bool:
        out = self.kubectl("get", "node", versions.NODE_NAME, "-o", "json", check=False)
        if not out:
            return False
        conditions = json.loads(out).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _wait(self, what: str, probe: Callable[[], bool], timeout: float, component: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if component and self.pid(component) is None:
                raise ClusterError(
                    f"{component} exited while waiting for {what}; see {self.paths.logs}/"
                    f"{component}.log:\n{self.log_tail(component)}"
                )
            try:
                if probe():
                    return
            except (OSError, ClusterError):
                pass
            time.sleep(0.5)
        raise ClusterError(
            f"timed out after {timeout:.0f}s waiting for {what}; "
            f"{component} log:\n{self.log_tail(component)}"
        )

    def wait_node_ready(self, timeout: float = 120.0) -> None:
        self._wait("node Ready", self._node_ready, timeout, "kubelet")

    def wait_apiserver_ready(self, timeout: float = 120.0) -> None:
        """Wait until the apiserver's ``/readyz`` answers 200 (after `start_component`)."""
        self._wait(
            "apiserver /readyz",
            lambda: self._api_get("/readyz")[0] == 200,
            timeout,
            "kube-apiserver",
        )

    def log_tail(self, name: str, lines: int = 40) -> str:
        try:
            text = (self.paths.logs / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def collect_logs(self, destination: Path) -> Path:
        """Copy every component's log (and the driver's) out of the state dir."""
        destination.mkdir(parents=True, exist_ok=True)
        if self.paths.logs.exists():
            for logfile in self.paths.logs.glob("*.log"):
                shutil.copy2(logfile, destination / logfile.name)
        return destination

    # ---- up ----------------------------------------------------------------------------------
    def up(self) -> None:
        if self.healthy():
            log.info("cluster already up")
            return
        if self.paths.state_file.exists() or netns.exists():
            log.info("cleaning up a previous, unhealthy cluster")
            self.down()
        bin_dir = toolchain.build(self.paths)
        _check_host()
        paths = self.paths
        for directory in (paths.state, paths.logs, paths.run, paths.kubelet_root):
            directory.mkdir(parents=True, exist_ok=True)
        paths.state.chmod(0o700)
        _make_shared(paths.state)
        self._save_state(
            {"sysctls": _read_sysctls(), "processes": {}, "cdi_specs_before": _cdi_specs()}
        )
        try:
            self._up(bin_dir)
        except BaseException:
            self.collect_logs(paths.cache / "last-failure-logs")
            raise

    def _up(self, bin_dir: Path) -> None:
        paths = self.paths
        netns.create()
        netns.enter()
        pki.create(paths.pki)
        for identity in ("admin", "kubelet", "scheduler", "controller-manager", "gpu-dra-driver"):
            pki.write_kubeconfig(paths.state / f"{identity}.kubeconfig", paths.pki, identity)
        paths.admin_kubeconfig.write_text((paths.state / "admin.kubeconfig").read_text())
        (paths.state / "containerd.toml").write_text(configs.containerd_config(paths))
        (paths.state / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        (paths.state / "cni" / "net.d" / "10-gpu-dra-e2e.conflist").write_text(
            configs.cni_config(paths)
        )
        (paths.state / "kubelet.yaml").write_text(configs.kubelet_config(paths, bin_dir))
        (paths.state / "resolv.conf").write_text("")
        for directory in CDI_SPEC_DIRS:
            directory.mkdir(parents=True, exist_ok=True)

        self.start_component("etcd")
        self._wait("etcd", lambda: _http_ok("http://127.0.0.1:2379/health"), 60, "etcd")
        self.start_component("kube-apiserver")
        self.wait_apiserver_ready()
        self.start_component("containerd")
        self._wait("containerd socket", paths.containerd_socket.exists, 60, "containerd")
        archives = [paths.images_dir / "busybox.tar", paths.images_dir / "pause.tar"]
        images.write_oci_archive(images.busybox_image(), archives[0])
        images.write_oci_archive(images.pause_image(bin_dir / "pause"), archives[1])
        images.import_images(bin_dir / "ctr", paths.containerd_socket, archives)
        self.start_component("kube-controller-manager")
        self.start_component("kube-scheduler")
        self.start_component("kubelet")
        self.wait_node_ready()
        self._wait(
            "the default ServiceAccount",
            lambda: bool(
                self.kubectl("get", "serviceaccount", "default", "-o", "name", check=False)
            ),
            60,
            "kube-controller-manager",
        )
        log.info("cluster up: kubeconfig %s", paths.admin_kubeconfig)

    # ---- down --------------------------------------------------------------------------------
    def down(self) -> None:
        state = self._state()
        paths = self.paths
        if netns.exists() and not netns.current_is():
            netns.enter()
        crictl = self.bin_dir / "crictl"
        if self.pid("containerd") and crictl.exists():
            endpoint = f"unix://{paths.containerd_socket}"
            for action in (["stopp"], ["rmp", "--force"]):
                pods = subprocess.run(
                    [str(crictl), "--runtime-endpoint", endpoint, "pods", "-q"],
                    capture_output=True, text=True, check=False,
                ).stdout.split()  # fmt: skip
                if pods:
                    with contextlib.suppress(subprocess.TimeoutExpired):  # the kills below follow
                        subprocess.run(
                            [str(crictl), "--runtime-endpoint", endpoint, *action, *pods],
                            capture_output=True, check=False, timeout=120,
                        )  # fmt: skip
        for name in reversed(COMPONENTS):
            pid = state.get("processes", {}).get(name)
            if pid:
                self._terminate(int(pid), 20.0)
        for name, pid in state.get("processes", {}).items():
            if name not in COMPONENTS:
                self._terminate(int(pid), 10.0)
        _kill_shims(self.bin_dir)
        _kill_cgroup_processes()
        _delete_pod_netns()
        _unmount_under(paths.state)
        _remove_kubelet_cgroups()
        _restore_sysctls(state.get("sysctls", {}))
        # CDI specs the cluster's driver wrote for its claims die with the cluster.
        if "cdi_specs_before" in state:
            for spec in set(_cdi_specs()) - set(state["cdi_specs_before"]):
                Path(spec).unlink(missing_ok=True)
        netns.delete()
        if paths.state.exists():
            shutil.rmtree(paths.state)
        _forget_device_plugin_allocations()
        log.info("cluster down")


# ---- helpers -------------------------------------------------------------------------------------
DEVICE_PLUGIN_CHECKPOINT: Final = Path(
    "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
)
"""The kubelet's device manager checkpoint: always under /var/lib/kubelet/device-plugins, whatever
its --root-dir, so it outlives the cluster's state directory. Its pods' device-plugin
allocations (e2e/test_migration.py's device plugin) would make the next kubelet hold
``nvidia.com/gpu`` as a registered resource without an endpoint, and refuse every pod asking for
it through DRA (``endpoint not found in cache for a registered resource``)."""


def _forget_device_plugin_allocations() -> None:
    """Remove the previous test-bed kubelet's device manager checkpoint (the host runs no kubelet
    of its own: the e2e kubelet serves /var/lib/kubelet/device-plugins/kubelet.sock)."""
    if DEVICE_PLUGIN_CHECKPOINT.exists():
        log.info("removing the previous kubelet's device plugin checkpoint %s",
                 DEVICE_PLUGIN_CHECKPOINT)  # fmt: skip
        DEVICE_PLUGIN_CHECKPOINT.unlink(missing_ok=True)


def _check_host() -> None:
    missing = [
        what
        for what, present in (
            ("runc (Debian package runc)", Path("/usr/sbin/runc").exists()),
            ("CNI plugins (containernetworking-plugins)", Path("/usr/lib/cni/bridge").exists()),
            ("etcd (etcd-server)", shutil.which("etcd") is not None),
            ("nsenter (util-linux)", shutil.which("nsenter") is not None),
            ("busybox (busybox-static)", images.BUSYBOX.exists()),
            ("openssl", shutil.which("openssl") is not None),
        )
        if not present
    ]
    if missing:
        raise ClusterError(
            "missing host packages: " + ", ".join(missing) + "; run e2e/setup-host as root"
        )
    if os.geteuid() != 0:
        raise ClusterError("the e2e cluster needs root (network namespaces, mounts, cgroups)")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as response:
        return bool(response.status == 200)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM the process (group), wait, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            # Our components lead their own process group; anything else gets the signal alone.
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not _alive(pid):
                return
            time.sleep(0.1)


def _processes_matching(needle: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            pids.append(int(entry.name))
    return pids


def _kill_shims(bin_dir: Path) -> None:
    """Stop the runc shims of our containerd (its binary is in our bin dir) and their containers."""
    for pid in _processes_matching(str(bin_dir / "containerd-shim-runc-v2")):
        _terminate(pid, 5.0)


def _delete_pod_netns() -> None:
    """Remove pod sandbox namespaces containerd left behind (only ones no process uses)."""
    for entry in netns.NETNS_DIR.glob("cni-*"):
        pids = subprocess.run(
            ["ip", "netns", "pids", entry.name], capture_output=True, text=True, check=False
        ).stdout.split()
        if not pids:
            subprocess.run(["ip", "netns", "delete", entry.name], capture_output=True, check=False)


def _kubepods_cgroups() -> list[Path]:
    found: list[Path] = []
    for controller in Path("/sys/fs/cgroup").iterdir():
        found.extend(p for p in controller.glob("kubepods*") if p.is_dir())
    return found


def _kill_cgroup_processes() -> None:
    for top in _kubepods_cgroups():
        for procs in top.rglob("cgroup.procs"):
            try:
                pids = procs.read_text().split()
            except OSError:
                continue
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _remove_kubelet_cgroups() -> None:
    for top in _kubepods_cgroups():
        for directory in sorted(
            (p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
        ):
            with contextlib.suppress(OSError):
                directory.rmdir()
        try:
            top.rmdir()
        except OSError as error:
            log.warning("could not remove cgroup %s: %s", top, error)


def _make_shared(directory: Path) -> None:
    """Make `directory` a shared mount (a bind mount onto itself), as systemd makes ``/`` on real
    nodes: the kubelet refuses ``mountPropagation: Bidirectional`` volumes (the chart's plugin
    DaemonSet) under a private mount, and this VM's ``/`` is private. `down` unmounts it with
    everything else under the state directory."""
    target = str(directory)
    with open("/proc/self/mountinfo") as mountinfo:
        mounted = any(line.split()[4] == target for line in mountinfo)
    if not mounted:
        subprocess.run(["mount", "--bind", target, target], check=True, capture_output=True)
    subprocess.run(["mount", "--make-rshared", target], check=True, capture_output=True)


def _unmount_under(root: Path) -> None:
    prefix = str(root)
    mounts = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            target = line.split()[4].replace("\\040", " ")
            if target == prefix or target.startswith(prefix + "/"):
                mounts.append(target)
    for target in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def _cdi_specs() -> list[str]:
    return sorted(str(p) for d in CDI_SPEC_DIRS for p in d.glob("*") if p.is_file())


def _read_sysctls() -> dict[str, str]:
    values = {}
    for key in KUBELET_SYSCTLS:
        try:
            values[key] = (Path("/proc/sys") / key).read_text().strip()
        except OSError:
            continue
    return values


def _restore_sysctls(values: dict[str, str]) -> None:
    for key, value in values.items():
        try:
            (Path("/proc/sys") / key).write_text(value)
        except OSError as error:
            log.warning("could not restore sysctl %s=%s: %s", key, value, error)
